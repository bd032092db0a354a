"""Metrics of any trace in the dflop format, computed by one function.

Definitions (GPU-weighted: a worker of 4 GPUs counts 4 times):

- step time: from a step's start to its end (the last gradient all-reduce);
- busy time of a rank: the sum of its compute events;
- bubble fraction: idle share of GPU time between a step's start and its last
  compute op (pipeline bubbles, and waiting for slower replicas or modules);
  work after that op (a measured optimizer step, category ``optimizer``) is
  outside this span and not counted in it;
  for one pipeline with equal stages this is the textbook (p-1)/(m+p-1);
- idle fraction: idle share over the whole step (the all-reduce tail included);
- idle by module: the idle fraction of each module's GPUs ("encoder", "llm"; in a
  colocated plan the LLM's first stage, which also runs the encoder, is
  "llm+encoder"), so a text report can say which module waits;
- utilisation: 1 - idle fraction; MFU: model FLOPs / (GPUs x peak x time);
  HFU: the same with the FLOPs executed (recomputation counted; ``hw_flops``).

A trace with no steps (no complete events, or steps that take no time) has
nothing to measure: its step times are empty and its step time, bubble, idle
fraction, utilisation, MFU and HFU are None (null in JSON), not a 0 or a 1 that
would read as a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop.specs.plan import Module
from dflop.trace.chrome import COMPUTE, OPTIMIZER


@dataclass(frozen=True)
class TraceMetrics:
    steps: int
    step_time_s: list[float]
    busy_s: list[float]
    """Per rank (pid), summed over steps."""
    idle_s: list[float]
    bubble_fraction: float | None
    idle_fraction: float | None
    idle_by_module: dict[str, float]
    utilisation: float | None
    mfu: float | None
    hfu: float | None
    peak_memory_gib: list[float]
    oom: list[dict[str, Any]]

    @property
    def step_time_mean(self) -> float | None:
        return float(np.mean(self.step_time_s)) if self.step_time_s else None

    @property
    def step_time_p50(self) -> float | None:
        return float(np.median(self.step_time_s)) if self.step_time_s else None

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "step_time_s": {"mean": self.step_time_mean, "p50": self.step_time_p50,
                                                     "each": self.step_time_s},
                "bubble_fraction": self.bubble_fraction, "idle_fraction": self.idle_fraction,
                "idle_by_module": self.idle_by_module,
                "utilisation": self.utilisation, "mfu": self.mfu, "hfu": self.hfu,
                "peak_memory_gib": max(self.peak_memory_gib, default=0.0), "oom": self.oom}


def metrics(doc: dict[str, Any]) -> TraceMetrics:
    other = doc.get("otherData", {})
    events = doc["traceEvents"]
    compute = [e for e in events if e.get("ph") == "X" and e.get("tid") == COMPUTE]
    pids = sorted({e["pid"] for e in events if "pid" in e and e.get("ph") in ("X", "C")}
                  | set(range(len(other.get("workers", [])))))
    workers = other.get("workers", [])
    weight = {pid: len(workers[pid]["gpus"]) if pid < len(workers) else 1 for pid in pids}
    steps = other.get("steps") or _whole(events)
    n = len(pids)
    index = {pid: i for i, pid in enumerate(pids)}
    busy = np.zeros(n)
    after_graph = 0.0  # GPU-weighted busy time of work that follows the step graph (the optimizer step)
    step_times, compute_spans = [], []
    flops = hw_flops = 0.0
    for e in compute:
        busy[index[e["pid"]]] += e["dur"]
        if e.get("cat") == OPTIMIZER:
            after_graph += e["dur"] * weight[e["pid"]]
        args = e.get("args", {})
        flops += args.get("flops", 0.0) * weight[e["pid"]]
        hw_flops += args.get("hw_flops", args.get("flops", 0.0)) * weight[e["pid"]]
    for s in steps:
        step_times.append((s["end_us"] - s["start_us"]) / 1e6)
        compute_spans.append((s.get("compute_end_us", s["end_us"]) - s["start_us"]) / 1e6)
    gpus = sum(weight.values())
    total_busy = float(sum(busy[index[p]] * weight[p] for p in pids)) / 1e6
    total_step, total_compute = sum(step_times), sum(compute_spans)
    peaks = [0.0] * n
    for e in events:
        if e.get("ph") == "C" and e.get("pid") in index:
            i = index[e["pid"]]
            peaks[i] = max(peaks[i], e.get("args", {}).get("GiB", 0.0))
    peak_flops = other.get("peak_flops")
    idle_fraction = 1.0 - total_busy / (gpus * total_step) if total_step > 0 else None
    return TraceMetrics(
        steps=len(steps),
        step_time_s=step_times,
        busy_s=(busy / 1e6).tolist(),
        idle_s=(total_step - busy / 1e6).tolist(),
        bubble_fraction=1.0 - (total_busy - after_graph / 1e6) / (gpus * total_compute) if total_compute > 0 else None,
        idle_fraction=idle_fraction,
        idle_by_module=_idle_by_module(workers, pids, busy, weight, total_step),
        utilisation=None if idle_fraction is None else 1.0 - idle_fraction,
        mfu=flops / (gpus * peak_flops * total_step) if peak_flops and total_step > 0 else None,
        hfu=hw_flops / (gpus * peak_flops * total_step) if peak_flops and total_step > 0 else None,
        peak_memory_gib=peaks,
        oom=other.get("oom", []),
    )


MODULE_GROUP_NAMES = {"encoder": "encoder", "llm": "LLM", "llm+encoder": "LLM stage 0 + encoder",
                      "llm+encoder-phase": "LLM + encoder phase"}
"""How reports and pictures name each group of ``module_groups``."""


def module_groups(workers: list[dict[str, Any]]) -> list[str]:
    """The module each worker's GPUs serve: its own, "llm+encoder" for a colocated first LLM stage, or
    "llm+encoder-phase" for every rank of a heterogeneous plan."""
    if any(w.get("encoder_phase") for w in workers):
        return ["llm+encoder-phase"] * len(workers)
    colocated = not any(w.get("module") == Module.ENCODER for w in workers)
    return ["llm+encoder" if colocated and w.get("module", Module.LLM) == Module.LLM and w.get("rank") == 0
            else w.get("module", "llm") for w in workers]


def _idle_by_module(workers: list[dict[str, Any]], pids: list[int], busy: np.ndarray, weight: dict[int, int],
                    total_step: float) -> dict[str, float]:
    if total_step <= 0:
        return {}
    names = module_groups(workers)
    busy_us: dict[str, float] = {}
    gpus: dict[str, int] = {}
    for i, pid in enumerate(pids):
        group = names[pid] if pid < len(names) else "llm"
        busy_us[group] = busy_us.get(group, 0.0) + busy[i] * weight[pid]
        gpus[group] = gpus.get(group, 0) + weight[pid]
    return {g: 1.0 - busy_us[g] / 1e6 / (gpus[g] * total_step) for g in busy_us}


def _whole(events: list[dict[str, Any]]) -> list[dict[str, float]]:
    """One step spanning every complete event of a trace that marks no steps (none without events)."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"]
    if not spans:
        return []
    compute_end = max((e["ts"] + e["dur"] for e in events if e.get("ph") == "X" and e.get("tid") == COMPUTE),
                      default=0.0)
    return [{"start_us": min(s for s, _ in spans), "end_us": max(t for _, t in spans),
             "compute_end_us": compute_end}]
