"""The JSON fields the jobs report (one spelling for every command and backend): a plan, a run's
step metrics, the optimizer's choice next to its baselines."""

from __future__ import annotations

from typing import Any

from dflop.backends.base import BackendResult
from dflop.plan.report import OptimizeResult
from dflop.specs.hardware import GIB
from dflop.specs.loading import to_mapping
from dflop.specs.plan import Plan


def gpu_note(plan: Plan, cluster_gpus: int) -> str | None:
    """A plan that leaves GPUs of the cluster idle says so, and one whose heterogeneous encoder leaves
    GPUs of the job out (a plan file's encoder dp is easily left short)."""
    notes = [f"the plan uses {plan.gpus} of {cluster_gpus} GPUs"] if plan.gpus < cluster_gpus else []
    if plan.heterogeneous and plan.encoder.tp * plan.encoder.dp < plan.llm.gpus:
        notes.append(f"its encoder runs on the first {plan.encoder.tp * plan.encoder.dp} of the job's "
                     f"{plan.llm.gpus} GPUs")
    return "; ".join(notes) or None


def plan_summary(plan: Plan) -> dict[str, Any]:
    return {"describe": plan.describe(), **to_mapping(plan)}


def optimize_json(result: OptimizeResult, usable: float, source: str = "") -> dict[str, Any]:
    out = result.to_json()
    out["plan"] = {**plan_summary(result.best.plan), **out["plan"]}
    out["expected_step_time_s"] = out["plan"]["step_time_s"]
    out["per_gpu_memory_gib"] = out["plan"]["peak_memory_gib"]
    out["usable_memory_gib"] = usable / GIB
    if out["prediction_error"] is not None:
        out["prediction_error"]["source"] = source
    b = result.strongest
    if b is not None:
        out["baseline"] = {**plan_summary(b.best.plan), **out["baseline"]}
    return out


def step_fields(sim: BackendResult, global_batch: int) -> dict[str, Any]:
    m = sim.metrics
    return {"step_time_s": {"mean": m.step_time_mean, "p50": m.step_time_p50},
            "throughput_samples_per_s": global_batch / m.step_time_mean,
            "bubble_fraction": m.bubble_fraction, "idle_fraction": m.idle_fraction,
            "idle_by_module": m.idle_by_module, "utilisation": m.utilisation, "mfu": m.mfu, "hfu": m.hfu,
            "peak_memory_gib": max(m.peak_memory_gib, default=0.0),
            "oom_events": len(m.oom)}
