"""`dflop run` on the simulator: dflop's plan against the strongest baseline, each simulated on the
same batches, with the decomposition of the speedup into plan and balance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflop.backends.base import Backend, BackendResult
from dflop.cost.select import prediction_error
from dflop.errors import DflopError, ensure_writable_folder
from dflop.plan.report import OptimizeResult, implausible, score
from dflop.plan.search import Progress
from dflop.schedule.batching import Batching
from dflop.specs.plan_file import save_plan

from dflop.jobs.optimize import assess, optimize
from dflop.jobs.report import gpu_note, optimize_json, plan_summary, step_fields
from dflop.jobs.setup import Log, Setup, log_to_stderr
from dflop.jobs.simulate import simulate


def _simulate_arms(s: Setup, result: OptimizeResult, steps: int, out: Path,
                   backend: Backend | None) -> tuple[dict[str, BackendResult], dict[str, dict[str, Any]]]:
    """dflop's plan with its bins, the strongest baseline with its own rule and, as the
    decomposition's middle point, that baseline's plan with dflop's bins (unless that is dflop's
    plan itself), each on the same batches."""
    best, strongest = result.best, result.strongest
    runs = {"dflop": (best.plan, best.batching), "baseline": (strongest.best.plan, strongest.best.batching)}
    if strongest.balanced is not None and strongest.balanced is not best:
        runs["baseline_balanced"] = (strongest.best.plan, Batching.BALANCED)
    sims, infos = {}, {}
    for name, (plan, batching) in runs.items():
        sims[name], infos[name] = simulate(s, plan, steps=steps, solver=s.config.scheduler.solver, out=out,
                                           name=name, deadline=0.5 * best.mean, batching=batching, backend=backend)
    if strongest.balanced is best:
        sims["baseline_balanced"] = sims["dflop"]
    return sims, infos


def run(s: Setup, *, steps: int, out: Path, progress: Progress | None = None, log: Log = log_to_stderr,
        noise: float | None = None, backend: Backend | None = None) -> dict[str, Any]:
    """Optimize (with a plan in the config: that plan, against itself on arrival-order batches), then
    simulate dflop's plan with its bins, the strongest baseline with its own batching rule and that
    baseline's plan with dflop's bins, on the same batches, on ``backend`` (the simulator by default);
    compare."""
    from dflop.viz.timeline import plot_timeline

    ensure_writable_folder(out, "output")
    if s.config.plan is None:
        log("dflop: searching plans ...")
        result = optimize(s, progress=progress, noise=noise)
    else:
        result = assess(s, s.config.plan)
    strongest = result.strongest
    if strongest is None:
        raise DflopError("no baseline plan fits this cluster to compare against: "
                         + "; ".join(f"{b.name}: {b.reason}" for b in result.baselines))
    best, base = result.best, strongest.best
    log(f"dflop: plan [{best.plan.describe()}] ({best.batching}); strongest baseline {strongest.name} "
        f"[{base.plan.describe()}]")
    note = gpu_note(best.plan, s.system.cluster.gpus)
    if note:
        log(f"dflop: {note}")
    sims, infos = _simulate_arms(s, result, steps, out, backend)
    timeline = plot_timeline(sims["baseline"].trace, out / "timeline.png", compare=sims["dflop"].trace,
                             labels=(f"strongest baseline ({strongest.name})", "dflop"))
    plan_file = save_plan(best.plan, out / "plan.yaml", s.system.cluster)
    batch = s.system.training.global_batch
    fields = {name: step_fields(sim, batch) for name, sim in sims.items()}
    time_of = {name: f["step_time_s"]["mean"] for name, f in fields.items()}
    expected = optimize_json(result, s.system.hardware.usable_memory_bytes, prediction_error(s.system.cost)[1])
    return {
        "plan": plan_summary(best.plan), "batching": str(best.batching), **fields["dflop"],
        "baseline": {"space": strongest.space, "batching": str(strongest.batching), "plan": plan_summary(base.plan),
                     **fields["baseline"]},
        "baselines": expected["baselines"],
        "speedup": time_of["baseline"] / time_of["dflop"],
        "decomposition": ({"plan_gain": time_of["baseline_balanced"] / time_of["dflop"],
                           "balance_gain": time_of["baseline"] / time_of["baseline_balanced"]}
                          if "baseline_balanced" in time_of else None),
        "expected": {"step_time_s": score(best), "baseline_step_time_s": score(base), "speedup": result.speedup,
                     "decomposition": result.decomposition, "ideal_step_time_s": result.ideal_s},
        "prediction_error": expected["prediction_error"],
        "warnings": expected["warnings"] + implausible("dflop (simulated)", fields["dflop"]["mfu"], s.system.hardware),
        "steps": steps, "global_batch": batch, "gpus": s.system.cluster.gpus, "hardware": s.system.hardware.name,
        "plan_gpus": best.plan.gpus,
        "model": s.system.model.name,
        "data": s.data_source, "cost_model": s.system.cost.name, "scheduler": infos["dflop"]["scheduler"],
        "search": {"seconds": result.seconds, "pruning": expected["pruning"], "why": result.why},
        "artifacts": {"trace": infos["dflop"]["trace"], "baseline_trace": infos["baseline"]["trace"],
                      "timeline": str(timeline), "plan": str(plan_file)},
    }
