"""What scheduling buys in simulation: data-aware vs data-blind bins, microbatch order, correction.

The correction study runs twice: against a systematic error (videos 30% slower than predicted, which
a correction by bucket can learn) and against per-sample prediction error alone (lognormal, 20%, which
it cannot: every sample is off by its own factor).

Run: .venv/bin/python benchmarks/bench_step.py
Every comparison runs the same plan on the same batches in the SimPy simulator (link
contention on); ratios are of two things measured in this run.
"""

from __future__ import annotations

import numpy as np

from dflop.cost import AnalyticalCostModel, System
from dflop.jobs.experiments import correction_study
from dflop.timing.evaluate import evaluate
from dflop.timing.steps import CostedPlan
from dflop.schedule.slots import ORDERS
from dflop.schedule.step import plan_costs, schedule_batch
from dflop.sim.engine import execute
from dflop.specs import ClusterSpec, ModulePlan, Plan, TrainingSpec, presets
from dflop.workload import batches, profile_mix

MODEL = presets.model("siglip-so400m", "qwen2.5-7b")
CLUSTER = ClusterSpec(hardware=presets.hardware("h100"), nodes=4, gpus_per_node=8)
TRAINING = TrainingSpec(global_batch=256)
COST = AnalyticalCostModel(MODEL, CLUSTER.hardware, TRAINING)
SYSTEM = System(MODEL, CLUSTER, TRAINING, COST)
PLANS = {
    "disaggregated enc dp8 | llm tp4 pp2 dp3, m=8": Plan(
        encoder=ModulePlan(dp=8), llm=ModulePlan(tp=4, pp=2, dp=3), microbatches=8, recompute="full"),
    "colocated tp2 pp4 dp4, m=8": Plan(
        encoder=ModulePlan(tp=2, dp=4), llm=ModulePlan(tp=2, pp=4, dp=4), microbatches=8, placement="colocated",
        recompute="full"),
    "colocated tp2 pp1 dp16, m=1 (data parallel)": Plan(
        encoder=ModulePlan(tp=2, dp=16), llm=ModulePlan(tp=2, dp=16), microbatches=1, placement="colocated",
        recompute="full"),
}
STEPS = 6


def simulated(runner: CostedPlan, batch, assignment) -> float:
    step = runner.step(0, batch, assignment)
    return execute(step.graph, step.costs, track_memory=False).makespan / 1e9


def mixes() -> None:
    print("step time (s), data-blind arrival-order bins vs dflop's scheduler (auto), same plan and batches")
    for mix in ("llava-ov", "image-heavy", "video-heavy"):
        data = profile_mix(mix, 20000, MODEL.encoder, seed=1).samples
        for name, plan in PLANS.items():
            runner = CostedPlan(plan, SYSTEM)
            stream = batches(data, TRAINING.global_batch, seed=2)
            blind, aware = [], []
            for _ in range(STEPS):
                batch = next(stream)
                costs = plan_costs(batch, plan, MODEL, COST)
                for solver, out in (("sequential", blind), ("auto", aware)):
                    schedule = schedule_batch(batch, plan, costs=costs, solver=solver, time_limit=0.3)
                    out.append(simulated(runner, batch, schedule.assignment))
            print(f"  {mix:<12} {name:<46} sequential {np.mean(blind):7.3f}  dflop {np.mean(aware):7.3f}  "
                  f"speedup {np.mean(blind) / np.mean(aware):5.3f}")


def orders() -> None:
    print("\nmicrobatch order: step time (s) with each fixed order, and with the order chosen per step by the "
          "fast evaluator")
    data = profile_mix("llava-ov", 20000, MODEL.encoder, seed=1).samples
    for name, plan in list(PLANS.items())[:2]:
        runner = CostedPlan(plan, SYSTEM)
        stream = batches(data, TRAINING.global_batch, seed=3)
        times: dict[str, list[float]] = {how: [] for how in (*ORDERS, "evaluated")}
        chosen = []
        for _ in range(STEPS):
            batch = next(stream)
            costs = plan_costs(batch, plan, MODEL, COST)
            for how in ORDERS:
                schedule = schedule_batch(batch, plan, costs=costs, solver="greedy", order=how)
                times[how].append(simulated(runner, batch, schedule.assignment))
            schedule = schedule_batch(batch, plan, costs=costs, solver="greedy",
                                      evaluate=lambda a: evaluate(runner.step(0, batch, a).timing).step_ns)
            chosen.append(schedule.order)
            times["evaluated"].append(simulated(runner, batch, schedule.assignment))
        cells = "  ".join(f"{how} {np.mean(t):.3f}" for how, t in times.items())
        worst = max(np.mean(t) for how, t in times.items() if how != "evaluated")
        print(f"  {name}: {cells}; evaluated vs worst fixed order {worst / np.mean(times['evaluated']):.3f}x; "
              f"chosen: {', '.join(sorted(set(chosen)))}")


def correction() -> None:
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=2, gpus_per_node=8)
    training = TrainingSpec(global_batch=128)
    plan = Plan(encoder=ModulePlan(dp=4), llm=ModulePlan(tp=4, pp=1, dp=3), microbatches=8, recompute="full")
    data = profile_mix("llava-ov", 20000, MODEL.encoder, seed=0).samples
    system = System(MODEL, cluster, training, AnalyticalCostModel(MODEL, cluster.hardware, training))
    for title, slowdown, noise in (("videos run 30% slower than the cost model predicts", {"video": 1.3}, 0.0),
                                   ("videos 30% slower, and 20% per-sample prediction error", {"video": 1.3}, 0.2),
                                   ("20% per-sample prediction error alone", {}, 0.2)):
        print(f"\nadaptive correction: {title}")
        study = correction_study(plan=plan, system=system, batches=batches(data, 128, seed=3), steps=20,
                                 slowdown=slowdown, noise=noise)
        skip = 8
        p, c, o = (study.mean(m, skip) for m in ("predicted", "corrected", "oracle"))
        print(f"  mean step over steps {skip}-19: trusting predictions {p:.3f} s, with correction {c:.3f} s, "
              f"knowing the true costs {o:.3f} s")
        recovered = f"{(p - c) / (p - o):.0%}" if p - o > 1e-9 else "nothing to recover"
        print(f"  correction recovers {recovered} of the gap to the oracle; switched on at step "
              f"{study.enabled.index(True) if any(study.enabled) else 'never'}")
        if slowdown:
            print(f"  learned LLM ratios of the video buckets: {np.round(study.ratios['llm'][-3:], 2).tolist()}, "
                  f"of the image buckets: {np.round(study.ratios['llm'][3:6], 2).tolist()}")


if __name__ == "__main__":
    mixes()
    orders()
    correction()
