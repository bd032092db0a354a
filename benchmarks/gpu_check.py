"""Everything only a GPU can show, measured in one go and kept as data: `make gpu-check`.

Run: make gpu-check            (one CUDA device; at most --budget-s seconds, 8 minutes by default)
     make gpu-check ARGS="--out FOLDER --again STEP ..."   (steps that failed or ran out of time, again)
     make gpu-check DRY=1      (any machine: the same steps on the CPU with tiny shapes; `make test` runs it)

GPUs are lent now and then for a few minutes, so this is ready to run the moment one is
there and puts the most valuable figures first. Its steps, in order:

1. environment: torch, CUDA, driver, GPU name and memory, NCCL, flash-attn importable or not;
2. attention: dflop's packed (varlen) attention through flash-attn and through SDPA, forward
   and backward, against the naive definition in fp32, on the packed shapes dflop feeds the
   presets' models (tolerance: ``TOLERANCE``), and their times;
3. profiles: one real-size layer of Qwen2.5-7B, SigLIP-so400m and InternViT-6B (random
   weights, bf16) over the profiler's GPU grid, and the tiny models, as profile stores;
4. analytical: the analytical model's prediction of every measured block against the
   measurement, and the efficiency curve refitted from them (the curve the hardware entry
   of this GPU gets, with ``calibrated_from`` naming this run's file);
5. torch backend: a real-width model (the presets' widths, ``TORCH_LAYERS`` layers each) trained on
   CUDA by one process, without and with full recomputation, measured against the step time
   the simulator predicts from the profile just measured (as ``bench_fidelity``) and from the
   analytical model (as shipped, and refitted);
6. two processes: NCCL between two ranks where the machine has two GPUs, or two ranks on the one
   GPU if NCCL allows it (it says why not, if not);
7. profile check: ``dflop profile check`` on the store just written.

Each step runs inside its own time box and the whole inside ``--budget-s``; a step that fails or
runs out of time is recorded as such and the next one runs; the results file is written after
every step, so a hard stop keeps what was measured. The exit status is 1 when a step failed, ran
out of time or was not reached. On a machine without CUDA (the dry run) the parts that need one
(flash-attn, NCCL) say "no device"; nothing is skipped without a line that says so.

Results: ``benchmarks/results/gpu-<device>-<date>/`` (``gpu_check.json`` and the profile store);
a GPU section of ``benchmarks/REPORT.md`` made from them (``report_section``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = "gpu_check.json"
STORE = "profiles"
REPORT_START, REPORT_END = "<!-- gpu-check: start -->", "<!-- gpu-check: end -->"

OK, NO_DEVICE, FAILED, OUT_OF_TIME, NOT_REACHED = "ok", "no device", "failed", "out of time", "not reached"
PASSING = (OK, NO_DEVICE)
"""Statuses of a step that did what it could: "no device" only where a part needs CUDA and there is none."""

TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}
"""Largest |output - reference| over the reference's largest |value| that passes, per dtype: bf16
keeps 8 bits of mantissa (relative rounding 2^-8 = 0.4%), and a softmax over thousands of keys adds
some; flash-attn's own tests hold bf16 to a few percent of the fp32 reference."""
TORCH_LAYERS = {"encoder": 4, "llm": 4}
"""Layers of each module in the torch-backend step: the presets' widths, few enough layers that a step
of a real data mix takes seconds on one GPU."""
REAL_MODELS = ("qwen2.5-7b", "siglip-so400m", "internvit-6b", "tiny-llm", "tiny-vit")
DRY_MODELS = ("tiny-llm", "tiny-vit")


@dataclass(frozen=True)
class Target:
    """What the steps run on: a CUDA device at full size, or (dry) the CPU with tiny shapes."""

    dry: bool
    device: str
    dtype: str
    models: tuple[str, ...]
    refit_models: tuple[str, ...]
    """The models whose blocks the efficiency curve is refitted on: the real sizes the presets price
    (the tiny models' blocks are launch-bound, a regime a curve in log FLOPs cannot follow)."""
    grid: str
    repeats: int | None
    encoder: str
    llm: str
    budgets: dict[str, float] = field(default_factory=dict)
    """Seconds each step may take at most (its time box), besides the whole run's budget."""

    @classmethod
    def of(cls, dry: bool) -> "Target":
        if dry:
            return cls(True, "cpu", "float32", DRY_MODELS, DRY_MODELS, "quick", 2, "tiny-vit", "tiny-llm",
                       {"environment": 30, "attention": 60, "profiles": 120, "analytical": 30, "torch_backend": 180,
                        "two_processes": 30, "profile_check": 60})
        return cls(False, "cuda", "bfloat16", REAL_MODELS, REAL_MODELS[:3], "gpu", 5, "siglip-so400m", "qwen2.5-7b",
                   {"environment": 30, "attention": 45, "profiles": 250, "analytical": 20, "torch_backend": 150,
                    "two_processes": 25, "profile_check": 45})


class OutOfTime(BaseException):
    """A time box ran out (a BaseException: the code inside must not swallow it)."""


@contextmanager
def time_box(seconds: float) -> Iterator[None]:
    """Raise OutOfTime in the main thread after ``seconds`` (SIGALRM): a CUDA call or a child process
    it waits on returns first, then the exception lands. Boxes nest: an inner one ends no later
    than the box around it, and gives the outer one back what it has left."""
    def expire(signum: int, frame: Any) -> None:  # noqa: ARG001
        raise OutOfTime()

    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    began = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(min(seconds, outer) if outer > 0 else seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - began), 0.01))


@dataclass
class Check:
    target: Target
    out: Path
    deadline: float
    log: Callable[[str], None] = print
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def store(self) -> Path:
        return self.out / STORE

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / RESULTS).write_text(json.dumps(self.results, indent=1, default=str) + "\n")


# ---- the steps ------------------------------------------------------------------------------------

def environment(c: Check) -> dict[str, Any]:
    import torch

    from dflop.profile.profiler import machine_identity

    cuda = torch.cuda.is_available()
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "cuda_available": cuda,
                           "flash_attn": _flash_attn_version()}
    if c.target.dry:
        out["device"] = {"status": NO_DEVICE, "why": "dry run: the steps run on the CPU"}
    elif not cuda:
        raise RuntimeError("no CUDA device: torch.cuda.is_available() is False (run with DRY=1 on a CPU)")
    else:
        props = torch.cuda.get_device_properties(0)
        out["device"] = {"status": OK, "name": props.name, "count": torch.cuda.device_count(),
                         "memory_gib": round(props.total_memory / 2**30, 1), "capability": f"{props.major}.{props.minor}",
                         "multiprocessors": props.multi_processor_count, "bf16": torch.cuda.is_bf16_supported()}
    out["machine"] = machine_identity(c.target.device, torch.get_num_threads())
    out["nccl"] = out["machine"].get("nccl") if cuda else None
    out["matmul"] = _matmul_rate(c.target)
    hardware = _hardware(c, strict=False)
    out["hardware"] = hardware.name if hardware else None
    return out


def _matmul_rate(t: Target) -> dict[str, Any]:
    """The achieved rate of one large square matrix product in the run's dtype: the ceiling every
    efficiency below is a fraction of, beside the datasheet's peak."""
    import torch

    n = 256 if t.dry else 8192
    a, b = (torch.randn(n, n, device=t.device, dtype=getattr(torch, t.dtype)) for _ in range(2))
    ms = _time_ms(lambda: a @ b, t.device, repeats=10)
    return {"n": n, "ms": ms, "tflops": 2 * n**3 / (ms * 1e-3) / 1e12}


def _flash_attn_version() -> str | None:
    try:
        import flash_attn
    except ImportError:
        return None
    return getattr(flash_attn, "__version__", "unknown")


def _hardware(c: Check, strict: bool = True):  # noqa: ANN202 - HardwareSpec | None
    """The hardware preset whose ``device_names`` hold the device's name (as the environment step
    recorded it, so that a run's results can be analysed again on a machine without it)."""
    from dflop.profile.profiler import device_name
    from dflop.specs import presets

    name = c.results.get("environment", {}).get("device", {}).get("name") or device_name(c.target.device)
    for key in presets.names("hardware"):
        spec = presets.hardware(key)
        if name in spec.device_names:
            return spec
    if strict:
        raise RuntimeError(f"no hardware preset names the device {name!r} (dflop/specs/hardware.yaml: device_names)")
    return None


def attention_shapes(dry: bool) -> dict[str, dict[str, Any]]:
    """Packed microbatches as dflop feeds them: samples of mixed lengths in one sequence, every one
    attending to itself only (causal in the LLM, whole image in the encoder)."""
    if dry:
        return {"tiny llm (causal)": {"heads": 4, "kv_heads": 2, "head_dim": 16, "causal": True, "lengths": [40, 17, 3]},
                "tiny encoder": {"heads": 4, "kv_heads": 4, "head_dim": 16, "causal": False, "lengths": [16, 16]}}
    return {"qwen2.5-7b (causal, GQA 28/4)": {"heads": 28, "kv_heads": 4, "head_dim": 128, "causal": True,
                                              "lengths": [3000, 1500, 829, 512, 64, 7]},
            "siglip-so400m (6 tiles)": {"heads": 16, "kv_heads": 16, "head_dim": 72, "causal": False,
                                        "lengths": [729] * 6},
            "internvit-6b (4 tiles)": {"heads": 25, "kv_heads": 25, "head_dim": 128, "causal": False,
                                       "lengths": [1025] * 4}}


def attention(c: Check) -> dict[str, Any]:
    import torch

    from dflop.models.attention import flash_available, reference_attention, varlen_attention

    device, dtype = torch.device(c.target.device), getattr(torch, c.target.dtype)
    tol = TOLERANCE[c.target.dtype]
    out: dict[str, Any] = {"tolerance": tol, "dtype": c.target.dtype, "shapes": {}}
    for name, s in attention_shapes(c.target.dry).items():
        gen = torch.Generator(device="cpu").manual_seed(0)
        t = sum(s["lengths"])
        q, k, v = (torch.randn(t, h, s["head_dim"], generator=gen) for h in (s["heads"], s["kv_heads"], s["kv_heads"]))
        grad = torch.randn(t, s["heads"], s["head_dim"], generator=gen)
        cu = torch.tensor(np.cumsum([0] + s["lengths"]), dtype=torch.int32, device=device)
        ref_out, ref_grads = _forward_backward(
            lambda a, b, d: reference_attention(a, b, d, cu, causal=s["causal"]),
            [x.to(device, torch.float32) for x in (q, k, v)], grad.to(device, torch.float32))
        paths: dict[str, Any] = {}
        for path in ("sdpa", "flash-attn"):
            if path == "flash-attn" and not c.target.dry and not flash_available(q.to(device, dtype)):
                paths[path] = {"status": "not installed", "why": "flash_attn does not import here (pip install "
                               "'dflop[gpu]' on the GPU machine); dflop falls back to SDPA"}
                continue
            if path == "flash-attn" and c.target.dry:
                paths[path] = {"status": NO_DEVICE, "why": "flash-attn runs on CUDA only"}
                continue
            fn = lambda a, b, d, f=(path == "flash-attn"): varlen_attention(a, b, d, cu, causal=s["causal"], use_flash=f)
            inputs = [x.to(device, dtype) for x in (q, k, v)]
            got, grads = _forward_backward(fn, inputs, grad.to(device, dtype))
            errors = {"out": _relative_error(got, ref_out)} | {
                f"d{n}": _relative_error(g, r) for n, g, r in zip("qkv", grads, ref_grads)}
            ms = _time_ms(lambda: _forward_backward(fn, inputs, grad.to(device, dtype)), c.target.device)
            paths[path] = {"status": OK if max(errors.values()) <= tol else FAILED, "relative_error": errors,
                           "fwd_bwd_ms": ms}
        out["shapes"][name] = {"tokens": t, "lengths": s["lengths"], **{k2: v2 for k2, v2 in s.items() if k2 != "lengths"},
                               "paths": paths}
        c.log(f"  {name}, {t} tokens: " + "; ".join(
            f"{p} {r['status']}" + (f", max error {max(r['relative_error'].values()):.2e}, {r['fwd_bwd_ms']:.2f} ms"
                                    if "relative_error" in r else "") for p, r in paths.items()))
    failed = [f"{n} {p}" for n, r in out["shapes"].items() for p, x in r["paths"].items() if x["status"] == FAILED]
    if failed:
        raise AssertionError(f"attention over the tolerance {tol}: {', '.join(failed)}")
    return out


def _forward_backward(fn: Callable, inputs: list, grad: Any) -> tuple[Any, list]:
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [x.grad for x in leaves]


def _relative_error(got: Any, ref: Any) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))


def _time_ms(fn: Callable[[], Any], device: str, repeats: int = 5) -> float:
    """Median of ``repeats`` calls after one warm-up, timed as the profiler times (CUDA events on a GPU)."""
    from dflop.profile.profiler import Timer

    timer = Timer(device)
    fn()
    return float(np.median([timer(fn)[0] for _ in range(repeats)]))


def profiles(c: Check) -> dict[str, Any]:
    """Each model in its own share of the step's box, so that one slow model leaves the others theirs; the
    quick ones first, so that the slowest also gets what they leave (the estimate weighs, it does not
    predict: it is several times short for a 7B's large shapes)."""
    from dflop.cost.store import FILENAME, ProfileStore
    from dflop.profile.profiler import profile_model

    from dflop.profile.estimate import profile_estimate

    out: dict[str, Any] = {"store": str(c.store), "grid": c.target.grid, "models": {}}
    budget = c.target.budgets["profiles"]
    start = time.monotonic()
    hardware = _hardware(c)
    weight = {m: SETUP_S + profile_estimate(m, hardware, device=c.target.device, grid=c.target.grid,
                                            repeats=c.target.repeats).seconds for m in c.target.models}
    order = sorted(c.target.models, key=weight.get)  # the quick ones first: the slowest gets what they leave
    for i, name in enumerate(order):
        share = (budget - (time.monotonic() - start)) * weight[name] / sum(weight[m] for m in order[i:])
        began = time.monotonic()
        try:
            with time_box(min(share, c.left())):
                report = profile_model(name, c.store, device=c.target.device, dtype=c.target.dtype,
                                       grid=c.target.grid, repeats=c.target.repeats)
            status, extra = OK, {"measured": report.measured}
        except OutOfTime:
            status, extra = OUT_OF_TIME, {"why": f"its share of the step, {share:.0f} s, ran out"}
        records = [r for r in ProfileStore(c.store / FILENAME).read() if r["model"] == name]
        out["models"][name] = {"status": status, "records": len(records),
                               "seconds": round(time.monotonic() - began, 1), **extra}
        c.log(f"  {name}: {status}, {len(records)} records in {time.monotonic() - began:.0f} s")
        _free_memory()
    late = [n for n, r in out["models"].items() if r["status"] != OK]
    if late:
        raise StepIncomplete(out, f"profiles not finished: {', '.join(late)}")
    return out


SETUP_S = 5.0
"""Seconds a model's profile takes beyond its shapes' estimate (building blocks, Python), in its share."""


class StepIncomplete(Exception):
    """A step that measured something but not all it should: its figures are kept, its status is failed."""

    def __init__(self, partial: dict[str, Any], why: str) -> None:
        super().__init__(why)
        self.partial = partial


def _free_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def block_predictions(records: list[dict[str, Any]], hardware: Any) -> list[dict[str, Any]]:
    """Every measured block (tp 1) beside the analytical model's forward and backward for it, and the
    forward's FLOPs (what the efficiency curve is read at)."""
    from dflop.cost import flops as F
    from dflop.cost.analytical import AnalyticalCostModel
    from dflop.cost.protocol import StageSpec, WorkShape
    from dflop.profile.profiler import packed_lengths
    from dflop.specs import TrainingSpec, presets
    from dflop.specs.models import MLLMSpec
    from dflop.specs.plan import Module

    rows = []
    for r in records:
        if r["phase"] != "block" or r["tp"] != 1 or r.get("tp_comm"):
            continue
        module = Module(r["module"])
        if module == Module.LLM:
            llm = presets.llm(r["model"])
            model = MLLMSpec(encoder=presets.encoder("tiny-vit"), llm=llm)
            tokens, seq = r["shape"]["tokens"], r["shape"]["seq"]
            lengths = packed_lengths(tokens, seq)
            shape = WorkShape(samples=len(lengths), tokens=tokens, sum_sq=sum(n * n for n in lengths))
            flops = float(F.llm_layer_flops(llm, tokens, shape.sum_sq).total)
        else:
            enc = presets.encoder(r["model"])
            model = MLLMSpec(encoder=enc, llm=presets.llm("tiny-llm"))
            tiles = r["shape"]["tiles"]
            shape = WorkShape(samples=tiles, tiles=tiles)
            flops = float(F.vit_layer_flops(enc, tiles, tiles).total)
        cost = AnalyticalCostModel(model, hardware, TrainingSpec(global_batch=1)).stage_cost(
            StageSpec(module, 1), shape)
        rows.append({"model": r["model"], "module": str(module), "shape": r["shape"], "holdout": r.get("holdout", False),
                     "flops": flops, "measured_fwd_ms": r["fwd_ms"], "measured_bwd_ms": r["bwd_ms"],
                     "predicted_fwd_ms": float(cost.fwd) * 1e3, "predicted_bwd_ms": float(cost.bwd) * 1e3})
    return rows


def refit_efficiency(rows: list[dict[str, Any]], peak: float,
                     knots: tuple[float, ...]) -> tuple[tuple[float, float], ...]:
    """The efficiency curve (fraction of peak at each knot's FLOPs, interpolated in log FLOPs as the
    hardware spec reads it) that best explains the measured forwards: least squares of the achieved
    fraction over hat functions on the knots the measurements span, the outer knots held at the
    nearest fitted one (a measurement says nothing beyond its range). A curve linear in log FLOPs
    cannot follow launch-bound work, whose time hardly grows with its FLOPs: where the fit rises
    faster than time may, the smaller knot is raised (small units priced short, large ones as
    measured), and the error after the refit says how much that costs."""
    x = np.log10([r["flops"] for r in rows])
    y = np.array([r["flops"] / (peak * r["measured_fwd_ms"] * 1e-3) for r in rows])
    logk = np.log10(knots)
    inside = [i for i, k in enumerate(logk) if x.min() - 1 < k < x.max() + 1]
    basis = np.stack([np.interp(x, logk[inside], np.eye(len(inside))[j]) for j in range(len(inside))], axis=1)
    fitted = np.linalg.lstsq(basis, y, rcond=None)[0]
    values = np.maximum.accumulate(np.clip(np.interp(logk, logk[inside], fitted), 1e-3, 1.0))
    for i in range(len(values) - 2, -1, -1):  # time must grow with work (HardwareSpec's rule): raise the
        growth = 1 + np.log(10) * (logk[i + 1] - logk[i])  # smaller unit's fraction where the fit rises faster
        values[i] = max(values[i], values[i + 1] / growth * (1 + 1e-6))
    return tuple((float(k), float(v)) for k, v in zip(knots, values))


def analytical(c: Check) -> dict[str, Any]:
    from dflop.cost.store import FILENAME, ProfileStore

    hardware = _hardware(c)
    records = [r for r in ProfileStore(c.store / FILENAME).read() if r["model"] in c.target.refit_models]
    rows = block_predictions(records, hardware)
    if not rows:
        raise RuntimeError(f"no measured block in {c.store}: nothing to hold the analytical model against")
    knots = tuple(k for k, _ in hardware.efficiency)
    curve = refit_efficiency(rows, hardware.peak_flops, knots)
    refit = replace(hardware, efficiency=curve)
    refit_rows = block_predictions(records, refit)

    def errors(rs: list[dict[str, Any]]) -> dict[str, float]:
        fwd = [abs(r["predicted_fwd_ms"] / r["measured_fwd_ms"] - 1) for r in rs]
        both = [abs((r["predicted_fwd_ms"] + r["predicted_bwd_ms"]) / (r["measured_fwd_ms"] + r["measured_bwd_ms"]) - 1)
                for r in rs]
        return {"fwd_median": float(np.median(fwd)), "fwd_max": float(max(fwd)), "fwd_bwd_median": float(np.median(both)),
                "fwd_bwd_max": float(max(both))}

    out = {"hardware": hardware.name, "peak_flops": hardware.peak_flops, "models": list(c.target.refit_models), "assumed_efficiency": hardware.efficiency,
           "fitted_efficiency": curve, "blocks": [r | {"refit_fwd_ms": f["predicted_fwd_ms"],
                                                        "refit_bwd_ms": f["predicted_bwd_ms"]}
                                                  for r, f in zip(rows, refit_rows)],
           "error_assumed": errors(rows), "error_refit": errors(refit_rows)}
    c.log(f"  {len(rows)} blocks; analytical |error| of fwd+bwd, median: {out['error_assumed']['fwd_bwd_median']:.0%} "
          f"with the assumed curve, {out['error_refit']['fwd_bwd_median']:.0%} refitted")
    c.log("  fitted efficiency: " + ", ".join(f"{k:.0e}: {v:.2f}" for k, v in curve))
    return out


def torch_backend(c: Check) -> dict[str, Any]:
    """One process, pp1 dp1, a real data mix's global batches split by dflop, without and with full
    recomputation; measured graph time (the step graph, the optimizer step apart) against the
    predictions of the profiled model and of the analytical one."""
    from dflop.backends import ScheduledBatch
    from dflop.backends.sim import SimBackend
    from dflop.backends.torch_runtime.backend import TorchBackend
    from dflop.backends.torch_runtime.worker import TorchOptions
    from dflop.cost import AnalyticalCostModel, System
    from dflop.cost.select import select_cost_model
    from dflop.schedule.step import bin_batch, plan_costs
    from dflop.specs import ClusterSpec, ModulePlan, Plan, TrainingSpec, presets
    from dflop.specs.models import MLLMSpec
    from dflop.timing.steps import CostedPlan
    from dflop.workload import batches, profile_mix

    hardware = _hardware(c)
    encoder, llm = presets.encoder(c.target.encoder), presets.llm(c.target.llm)
    if not c.target.dry:
        encoder, llm = replace(encoder, layers=TORCH_LAYERS["encoder"]), replace(llm, layers=TORCH_LAYERS["llm"])
    model = MLLMSpec(encoder=encoder, llm=llm)
    # the dry run tests the plumbing: the fewest samples and steps that still measure one step after a warm-up
    training = TrainingSpec(global_batch=4 if c.target.dry else 8, activation_bytes=2 if c.target.dtype != "float32" else 4)
    cluster = ClusterSpec(hardware=hardware, nodes=1, gpus_per_node=1)
    profiled, note = select_cost_model(model, hardware, training, [c.store])
    refit_curve = c.results.get("analytical", {}).get("fitted_efficiency")
    costs = {"profiled": profiled, "analytical": AnalyticalCostModel(model, hardware, training)}
    if refit_curve:
        costs["analytical refitted"] = AnalyticalCostModel(model, replace(hardware, efficiency=tuple(
            tuple(p) for p in refit_curve)), training)
    c.log(f"  {model.name}, {encoder.layers}+{llm.layers} layers, {c.target.dtype} on {c.target.device}; {note}")
    data = profile_mix("llava-ov", 2000, encoder, seed=0).samples
    out: dict[str, Any] = {"model": model.name, "layers": {"encoder": encoder.layers, "llm": llm.layers},
                           "cost_model_note": note, "runs": {}}
    options = TorchOptions(device=c.target.device, dtype=c.target.dtype, lr=1e-4, calibrate=False)
    for recompute in ("none", "full"):
        plan = Plan(encoder=ModulePlan(), llm=ModulePlan(), placement="colocated", microbatches=2, recompute=recompute)
        system = System(model, cluster, training, profiled)
        stream = batches(data, training.global_batch, seed=1)
        steps = [ScheduledBatch(b, bin_batch(b, plan, system, costs=plan_costs(b, plan, model, profiled),
                                             solver="greedy", time_limit=0.2).assignment)
                 for b in (next(stream) for _ in range(2 if c.target.dry else 4))]
        result = TorchBackend(options=options).run(CostedPlan(plan, system), steps)
        measured = [s["graph_s"] for s in result.steps[1:]]
        row = {"plan": plan.describe(), "measured_s": float(np.median(measured)), "steps_s": measured,
               "optimizer_s": float(np.median([s["optimizer_s"] for s in result.steps[1:]]))}
        for key, cost in costs.items():
            again = SimBackend(memory=False).run(CostedPlan(plan, replace(system, cost=cost)), steps)
            predicted = float(np.median([s["step_s"] for s in again.steps[1:]]))
            row[key] = {"predicted_s": predicted, "error": predicted / row["measured_s"] - 1}
        out["runs"][f"recompute {recompute}"] = row
        c.log(f"  recompute {recompute}: measured {row['measured_s'] * 1e3:.1f} ms per step (median of "
              f"{len(measured)} after a warm-up); predicted " + ", ".join(
                  f"{k} {row[k]['predicted_s'] * 1e3:.1f} ms ({row[k]['error']:+.1%})" for k in costs))
        _free_memory()
    return out


def profile_check(c: Check) -> dict[str, Any]:
    """`dflop profile check` on the store just written, as a user would run it."""
    name = c.target.encoder
    cmd = [sys.executable, "-m", "dflop", "profile", "check", "--profiles", str(c.store.resolve()), "--model", name,
           "--device", c.target.device, "--repeats", "3", "--json"]  # run from the results folder: a dflop/ source folder
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=c.out,  # in the working directory would shadow
                          timeout=max(c.left(), 1))  # the installed package
    if done.returncode != 0:
        raise RuntimeError(f"dflop profile check exited {done.returncode}: {done.stderr.strip()[-500:]}")
    data = json.loads(done.stdout)
    c.log(f"  {name}: this device runs the profile's shapes in {data['ratio']:.2f}x the time recorded")
    return {"command": " ".join(cmd[1:]), "ratio": data["ratio"], "models": data["models"]}


def two_processes(c: Check) -> dict[str, Any]:
    """Two NCCL ranks: on two GPUs where there are two, else both on the one GPU, which NCCL may refuse."""
    import torch

    if c.target.dry or not torch.cuda.is_available():
        return {"status": NO_DEVICE, "why": "NCCL needs CUDA; the CPU suite runs two-process gloo plans already"}
    gpus = torch.cuda.device_count()
    code = ("import os, sys, datetime, torch, torch.distributed as dist\n"
            "rank = int(sys.argv[1]); dev = torch.device('cuda', rank % int(sys.argv[2]))\n"
            "torch.cuda.set_device(dev)\n"
            "dist.init_process_group('nccl', rank=rank, world_size=2, init_method='file://' + sys.argv[3],"
            " timeout=datetime.timedelta(seconds=20), device_id=dev)\n"
            "x = torch.ones(1 << 20, device=dev) * (rank + 1); dist.all_reduce(x); torch.cuda.synchronize()\n"
            "print('sum', float(x[0])); dist.destroy_process_group()\n")
    rendezvous = c.out / "nccl-rendezvous"
    rendezvous.unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(gpus), str(rendezvous)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(min(c.left(), 35), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        outputs.append((p.returncode, so, se))
    rendezvous.unlink(missing_ok=True)
    worked = all(rc == 0 and "sum 3.0" in so for rc, so, _ in outputs)
    where = "two GPUs" if gpus >= 2 else "one GPU"
    why = "" if worked else _last_error([se for _, _, se in outputs])
    c.log(f"  two NCCL ranks on {where}: " + ("all-reduce correct" if worked else f"refused: {why}"))
    return {"gpus": gpus, "on": where, "nccl_two_ranks": worked, "why": why,
            "note": "" if worked or gpus >= 2 else "the torch backend runs one process per GPU; plans of two ranks "
                                                   "need two GPUs here"}


def _last_error(stderrs: list[str]) -> str:
    """NCCL's own reason where it gives one (the line after its "Last error:"), else the last error line."""
    lines = [ln.strip() for se in stderrs for ln in se.splitlines() if ln.strip()]
    after = [b for a, b in zip(lines, lines[1:]) if a.endswith("Last error:")]
    errors = [ln for ln in lines if "rror" in ln and not ln.endswith("Last error:")]
    return ((after or errors or ["no error line; exit status non-zero"])[-1])[:300]


STEPS: tuple[tuple[str, Callable[[Check], dict[str, Any]]], ...] = (
    ("environment", environment), ("attention", attention), ("profiles", profiles), ("analytical", analytical),
    ("torch_backend", torch_backend), ("two_processes", two_processes), ("profile_check", profile_check))


# ---- running and reporting ------------------------------------------------------------------------

def run_steps(c: Check, steps: tuple[tuple[str, Callable[[Check], dict[str, Any]]], ...] = STEPS) -> bool:
    """Every step in order, each in its time box; True when every one passed (``PASSING``)."""
    c.results.setdefault("steps", {})
    for i, (name, fn) in enumerate(steps):
        box = min(c.target.budgets.get(name, c.left()), c.left())
        c.log(f"[{i + 1}/{len(steps)}] {name} (at most {box:.0f} s)")
        began = time.monotonic()
        if box <= 0:
            status, data = NOT_REACHED, {"why": "the run's budget was spent before it"}
        else:
            try:
                with time_box(box):
                    data = fn(c)
                status = data.pop("status", OK) if isinstance(data, dict) else FAILED
                if not isinstance(data, dict):
                    data = {"why": f"the step returned {type(data).__name__}, not its figures"}
            except OutOfTime:
                status, data = OUT_OF_TIME, {"why": f"its time box of {box:.0f} s ran out"}
            except StepIncomplete as exc:
                status, data = FAILED, exc.partial | {"why": str(exc)}
            except Exception as exc:  # noqa: BLE001 - recorded, and the next step runs
                status, data = FAILED, {"why": f"{type(exc).__name__}: {exc}",
                                        "traceback": traceback.format_exc(limit=-4)}
        c.results[name] = data
        c.results["steps"][name] = {"status": status, "seconds": round(time.monotonic() - began, 1)}
        c.save()
        c.log(f"    {name}: {status}" + (f" ({data['why']})" if data.get("why") else "")
              + f", {time.monotonic() - began:.0f} s")
        _free_memory()
    return all(s["status"] in PASSING for s in c.results["steps"].values())


def device_slug(target: Target) -> str:
    from dflop.profile.profiler import device_name

    name = device_name(target.device).lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "device"


def report_section(results: dict[str, Any], folder: str) -> str:
    """The GPU section of benchmarks/REPORT.md, from one run's results."""
    env = results.get("environment", {})
    dev = env.get("device", {})
    lines = [f"## GPU check: {dev.get('name', 'no device')} ({results.get('date', '?')})", "",
             f"`make gpu-check`; results in `{folder}/`. torch {env.get('torch')}, CUDA {env.get('torch_cuda')}, "
             f"driver {env.get('machine', {}).get('driver')}, NCCL {env.get('nccl')}, "
             f"{dev.get('memory_gib', '?')} GiB, flash-attn {env.get('flash_attn') or 'not installed'}; "
             + (f"a {env['matmul']['n']}-square matrix product runs at {env['matmul']['tflops']:.0f} TFLOP/s."
                if env.get("matmul") else ""), "",
             "| step | status | seconds |", "| --- | --- | ---: |"]
    lines += [f"| {n} | {s['status']} | {s['seconds']:.0f} |" for n, s in results.get("steps", {}).items()]
    for again in results.get("again", []):
        lines += ["", f"Run again into this folder on the same device ({again['date']}, `--again`, "
                  f"{again['seconds']:.0f} s): {', '.join(again['steps'])}; the table gives their second run."]
    prof = results.get("profiles", {})
    if prof.get("models"):
        lines += ["", f"Profiles ({prof['grid']} grid), one layer of each model:", "",
                  "| model | status | records | seconds |", "| --- | --- | ---: | ---: |"]
        lines += [f"| {n} | {m['status']} | {m['records']} | {m['seconds']:.0f} |" for n, m in prof["models"].items()]
        if prof.get("added"):
            a = prof["added"]
            lines += ["", f"Added to the store after the check: {a['records']} records of {', '.join(a['models'])} "
                      f"from `{a['from']}` (measured on the same device by `dflop profile model`); the analytical "
                      "step below was run again on the completed store (`--reanalyse`)."]
    att = results.get("attention", {})
    if att.get("shapes"):
        lines += ["", f"Packed attention, {att['dtype']}, against the fp32 definition (tolerance {att['tolerance']:g} "
                  "of the largest reference value), forward + backward:", "",
                  "| shape | tokens | path | status | max rel. error | fwd+bwd ms |", "| --- | ---: | --- | --- | ---: | ---: |"]
        for name, s in att["shapes"].items():
            for path, p in s["paths"].items():
                err = f"{max(p['relative_error'].values()):.1e}" if "relative_error" in p else ""
                ms = f"{p['fwd_bwd_ms']:.2f}" if "fwd_bwd_ms" in p else ""
                lines.append(f"| {name} | {s['tokens']} | {path} | {p['status']} | {err} | {ms} |")
    ana = results.get("analytical", {})
    if ana.get("blocks"):
        a, r = ana["error_assumed"], ana["error_refit"]
        lines += ["", f"One layer measured against the analytical model ({ana['hardware']}, {len(ana['blocks'])} "
                  f"blocks): fwd+bwd |error| median {a['fwd_bwd_median']:.0%} (max {a['fwd_bwd_max']:.0%}) with the "
                  f"assumed efficiency curve, {r['fwd_bwd_median']:.0%} (max {r['fwd_bwd_max']:.0%}) with the curve "
                  "refitted from these measurements:", "",
                  "| FLOPs | assumed | fitted |", "| ---: | ---: | ---: |"]
        lines += [f"| {k:.0e} | {a2:.2f} | {f:.2f} |" for (k, a2), (_, f) in
                  zip(ana["assumed_efficiency"], ana["fitted_efficiency"])]
    tb = results.get("torch_backend", {})
    if tb.get("runs"):
        keys = [k for k in next(iter(tb["runs"].values())) if isinstance(next(iter(tb["runs"].values()))[k], dict)]
        lines += ["", f"The torch backend on one GPU: {tb['model']} ({tb['layers']['encoder']}+{tb['layers']['llm']} "
                  "layers), llava-ov global batches of 8 in 2 microbatches, step graph time (median after a warm-up):",
                  "", "| run | measured ms | " + " | ".join(f"{k} ms | error" for k in keys) + " |",
                  "| --- | ---: | " + " | ".join("---: | ---:" for _ in keys) + " |"]
        for name, row in tb["runs"].items():
            lines.append(f"| {name} | {row['measured_s'] * 1e3:.1f} | " + " | ".join(
                f"{row[k]['predicted_s'] * 1e3:.1f} | {row[k]['error']:+.1%}" for k in keys) + " |")
    two = results.get("two_processes", {})
    if "nccl_two_ranks" in two:
        lines += ["", f"Two NCCL ranks on {two['on']}: " + ("an all-reduce ran." if two["nccl_two_ranks"]
                                                              else f"refused ({two['why']}). {two['note']}")]
    return "\n".join(lines) + "\n"


def write_report(report: Path, section: str, folder: str) -> None:
    """Put ``section``, the run in ``folder``, among the GPU sections of ``report``: in place of that run's
    earlier section, else after the other runs' (a report keeps one section per run, as ``make bench``)."""
    text = report.read_text() if report.exists() else ""
    blocks = list(re.finditer(re.escape(REPORT_START) + r"\n(.*?)" + re.escape(REPORT_END) + r"\n*", text, re.S))
    head, tail = (text[:blocks[0].start()], text[blocks[-1].end():]) if blocks else (text.rstrip("\n") + "\n\n", "")
    mine = f"results in `{folder}/`"
    sections = [section if mine in m.group(1) else m.group(1) for m in blocks]
    if section not in sections:
        sections.append(section)
    report.write_text(head + "\n".join(f"{REPORT_START}\n{s}{REPORT_END}\n" for s in sections)
                      + ("\n" + tail if tail else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="the same steps on the CPU with tiny shapes")
    parser.add_argument("--budget-s", type=float, default=480.0, help="hard stop for the whole run")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results/gpu-<device>-<date>)")
    parser.add_argument("--reanalyse", type=Path, metavar="FOLDER",
                        help="a results folder: run its analytical step again on its store as it is now, keeping "
                             "everything measured (no device needed)")
    parser.add_argument("--add-store", type=Path, metavar="FOLDER",
                        help="with --reanalyse: first add this profile store's records (measured on the same device "
                             "after the check, e.g. a model whose profile ran out of time) to the folder's store")
    parser.add_argument("--report", type=Path, default=HERE / "REPORT.md",
                        help="report to add the GPU section to (not in a dry run unless given)")
    parser.add_argument("--again", nargs="+", choices=[name for name, _ in STEPS], metavar="STEP",
                        help="with --out: run these steps again into that folder of an earlier run, keeping the "
                             "others' figures (a step that failed or ran out of time; profiles measure only what "
                             "the store lacks)")
    args = parser.parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.reanalyse, args.add_store, args.report)
    earlier = None
    if args.again:
        try:
            earlier = json.loads((args.out / RESULTS).read_text()) if args.out is not None else None
            args.dry = earlier["dry"]
        except (OSError, ValueError, TypeError, KeyError) as exc:
            print(f"gpu-check: --again needs --out, the folder of an earlier run: no readable {RESULTS} in "
                  f"{args.out} ({type(exc).__name__})", file=sys.stderr)
            return 2
    start = time.monotonic()
    target = Target.of(args.dry)
    if not args.dry:
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); DRY=1 runs the steps on the "
                  "CPU", file=sys.stderr)
            return 2
    date = datetime.date.today().isoformat()
    out = args.out or HERE / "results" / f"gpu-{device_slug(target)}-{date}"
    out.mkdir(parents=True, exist_ok=True)
    c = Check(target, out, start + args.budget_s, log=lambda s: print(s, flush=True))
    steps = STEPS
    if earlier is None:
        c.results.update({"date": date, "dry": args.dry, "budget_s": args.budget_s,
                          "command": "make gpu-check" + (" DRY=1" if args.dry else "")})
    else:
        c.results = earlier
        steps = tuple((name, fn) for name, fn in STEPS if name in args.again)
    print(f"gpu-check{' (dry run, CPU)' if args.dry else ''}: {len(steps)} steps, at most {args.budget_s:.0f} s; "
          f"results in {out}", flush=True)
    passed = run_steps(c, steps)
    seconds = round(time.monotonic() - start, 1)
    if earlier is None:
        c.results["seconds"] = seconds
    else:
        c.results.setdefault("again", []).append({"steps": [name for name, _ in steps], "date": date,
                                                  "seconds": seconds})
    c.save()
    section = report_section(c.results, _shown(out))
    (out / "REPORT-section.md").write_text(section)
    if not args.dry or "--report" in (argv or sys.argv):
        write_report(args.report, section, _shown(out))
    summary = ", ".join(f"{n} {s['status']}" for n, s in c.results["steps"].items())
    print(f"gpu-check: {'passed' if passed else 'FAILED'} in {seconds:.0f} s: {summary}", flush=True)
    return 0 if passed else 1


def reanalyse(folder: Path, extra: Path | None, report: Path) -> int:
    """The analytical step again on ``folder``'s store (after ``extra``'s records are added to it): the
    refit needs no device, only the blocks the device measured."""
    from dflop.cost.store import FILENAME, ProfileStore

    results = json.loads((folder / RESULTS).read_text())
    c = Check(Target.of(results["dry"]), folder, math.inf, results=results)
    if extra is not None:
        added = ProfileStore(extra / FILENAME).read()
        store = ProfileStore(c.store / FILENAME)
        for record in added:
            store.append(record)
        results["profiles"]["added"] = {"from": _shown(extra), "records": len(added),
                                        "models": sorted({r["model"] for r in added})}
    results["analytical"] = analytical(c)
    results["steps"]["analytical"]["reanalysed"] = datetime.date.today().isoformat()
    c.save()
    section = report_section(results, _shown(folder))
    (folder / "REPORT-section.md").write_text(section)
    if not results["dry"]:
        write_report(report, section, _shown(folder))
    return 0


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(HERE.parent))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
