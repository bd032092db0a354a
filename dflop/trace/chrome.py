"""The one trace format: Chrome trace-event JSON, loadable in Perfetto and chrome://tracing.

One process (pid) per worker, thread 0 its compute stream, thread 1 its
communication; complete events (``ph: "X"``) in microseconds with the
microbatch, stage, samples, tokens and tiles in ``args``; memory as counter
events. ``otherData`` carries what metrics need beyond events: the workers
(GPUs, module, capacity), step boundaries, out-of-memory events and the
hardware peak. Both the simulator and a real backend write this format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflop.errors import DflopError
from dflop.specs.loading import limit, load_json, number_problem, shown

FORMAT = "dflop.trace/1"
COMPUTE, COMM = 0, 1
OPTIMIZER = "optimizer"
"""Category of a measured optimizer step: compute after the step graph (busy, but not in the bubble's span)."""


@dataclass
class TraceBuilder:
    """Collects events of one or more steps into a trace document."""

    workers: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    oom: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def set_workers(self, workers: list[dict[str, Any]]) -> None:
        self.workers = workers

    def op(self, pid: int, tid: int, name: str, cat: str, start_ns: int, end_ns: int,
           args: dict[str, Any] | None = None) -> None:
        event = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                 "ts": start_ns / 1000.0, "dur": (end_ns - start_ns) / 1000.0}
        if args:
            event["args"] = args
        self.events.append(event)

    def counter(self, pid: int, name: str, ns: int, value: float) -> None:
        self.events.append({"name": name, "ph": "C", "pid": pid, "ts": ns / 1000.0,
                            "args": {"GiB": round(value / 2**30, 4)}})

    def step(self, index: int, start_ns: int, compute_end_ns: int, end_ns: int, **extra: Any) -> None:
        self.steps.append({"step": index, "start_us": start_ns / 1000.0,
                           "compute_end_us": compute_end_ns / 1000.0, "end_us": end_ns / 1000.0,
                           **extra})

    def document(self) -> dict[str, Any]:
        metadata = []
        for pid, w in enumerate(self.workers):
            metadata.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": w["name"]}})
            metadata.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
            for tid, label in ((COMPUTE, "compute"), (COMM, "communication")):
                metadata.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                 "args": {"name": label}})
        return {"traceEvents": metadata + self.events, "displayTimeUnit": "ms",
                "otherData": {"format": FORMAT, "workers": self.workers, "steps": self.steps,
                              "oom": self.oom, **self.meta}}


def save_trace(doc: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc))
    except OSError as exc:
        raise DflopError(f"{p}: cannot write the trace ({exc.strerror})") from None
    return p


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a trace, checked so that metrics and timelines can trust every field they use."""
    doc = load_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise DflopError(f"{path}: not a Chrome trace (no 'traceEvents' list)")
    check_trace(doc, str(path))
    return doc


def check_trace(doc: dict[str, Any], where: str) -> None:
    """Raise DflopError naming the entry unless ``otherData`` has the shape this module writes and
    every complete (X) and counter (C) event has a pid (a worker's index when workers are listed)
    and finite times; events of other kinds are left as they are."""
    workers = _check_other(doc.get("otherData", {}), where)
    for i, event in enumerate(doc["traceEvents"]):
        at = f"{where}: traceEvents[{i}]"
        if not isinstance(event, dict):
            raise DflopError(f"{at}: expected an event object, got {type(event).__name__}")
        if event.get("ph") in ("X", "C"):
            _check_event(event, at, workers)


def _check_other(other: Any, where: str) -> list[dict[str, Any]]:
    """Check otherData; return its workers."""
    if not isinstance(other, dict):
        raise DflopError(f"{where}: otherData: expected a mapping")
    workers = _entries(other, "workers", ("name", "module", "rank", "gpus"), where)
    for i, worker in enumerate(workers):
        if not isinstance(worker["gpus"], list) or not worker["gpus"]:
            raise DflopError(f"{where}: otherData.workers[{i}]: 'gpus' must be a non-empty list")
    for i, step in enumerate(_entries(other, "steps", ("start_us", "end_us"), where)):
        for key in ("start_us", "end_us", "compute_end_us"):
            if key in step:
                _number(step[key], f"{where}: otherData.steps[{i}]: '{key}'")
    if not isinstance(other.get("oom", []), list):
        raise DflopError(f"{where}: otherData.oom: expected a list")
    if other.get("peak_flops") is not None:
        _number(other["peak_flops"], f"{where}: otherData: 'peak_flops'", low=0)
    return workers


def _check_event(event: dict[str, Any], at: str, workers: list[dict[str, Any]]) -> None:
    needed = ("pid", "ts", "dur") if event["ph"] == "X" else ("pid", "ts")
    missing = [k for k in needed if k not in event]
    if missing:
        raise DflopError(f"{at}: a '{event['ph']}' event needs '{missing[0]}'")
    pid = event["pid"]
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 0:
        raise DflopError(f"{at}: 'pid' must be an integer >= 0, got {shown(pid)}")
    if workers and pid >= len(workers):
        raise DflopError(f"{at}: pid {pid} is not one of the {len(workers)} workers in otherData")
    _number(event["ts"], f"{at}: 'ts'")
    if event["ph"] == "X":
        _number(event["dur"], f"{at}: 'dur'", low=0)
    args = event.get("args", {})
    if not isinstance(args, dict):
        raise DflopError(f"{at}: 'args' must be a mapping")
    for key in ("flops", "GiB"):
        if key in args:
            _number(args[key], f"{at}: args.{key}", low=0)


def _entries(other: dict[str, Any], key: str, required: tuple[str, ...], where: str) -> list[dict[str, Any]]:
    """otherData[key]: a list of mappings, each with the ``required`` keys."""
    entries = other.get(key, [])
    if not isinstance(entries, list):
        raise DflopError(f"{where}: otherData.{key}: expected a list")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or any(k not in entry for k in required):
            raise DflopError(f"{where}: otherData.{key}[{i}]: expected a mapping with "
                             + ", ".join(f"'{k}'" for k in required))
    return entries


def _number(value: Any, where: str, low: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DflopError(f"{where}: expected a number, got {shown(value)}")
    problem = number_problem(value, limit(low))
    if problem:
        raise DflopError(f"{where}: {problem}")
