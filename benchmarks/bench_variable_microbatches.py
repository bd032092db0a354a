"""A variable number of microbatches per data-parallel rank in dflop's bins, against the fixed count.

Run: .venv/bin/python benchmarks/bench_variable_microbatches.py
Each setting as bench_optimizer makes it (8 samples per GPU, H100 nodes of 8, the analytical cost
model). On the plan the optimizer picks with every microbatch filled, and on a wide plan of few
samples per bin, dflop's bins of the optimizer's first 8 batches are cut twice: every microbatch
filled (``scheduler.variable_microbatches: false``), and with a rank free to run fewer (the default).
Both ways as the optimizer cuts them (its quick partitioner within its per-bin memory caps, the
pipeline estimate choosing) and as a run does (the greedy solver, no caps, the fast evaluator
choosing). Times: the fast evaluator's step; the gain is
the fixed count's mean over the variable one's, measured on the same batches in the same run.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from bench_optimizer import SHORT, problem
from dflop.errors import InfeasibleError
from dflop.plan.evaluate import BatchPool, Evaluator
from dflop.plan.search import optimize
from dflop.schedule.batching import Batching
from dflop.schedule.step import bin_batch, plan_costs
from dflop.specs import ModulePlan, Plan
from dflop.timing.evaluate import evaluate
from dflop.timing.steps import CostedPlan

BATCHES = 8
SETTINGS = (
    ("siglip-so400m", "qwen2.5-7b", "llava-ov", 32, (32, 8, 1, 1)),
    ("siglip-so400m", "qwen2.5-7b", "llava-ov", 64, (64, 8, 1, 1)),
    ("siglip-so400m", "qwen2.5-7b", "video-heavy", 256, (64, 16, 2, 2)),
    ("internvit-6b", "qwen2.5-7b", "video-heavy", 64, None),
)
"""(encoder, LLM, mix, GPUs, a wide plan's (dp, microbatches, tp, pp) or None)."""


def wide(dp: int, m: int, tp: int, pp: int) -> Plan:
    return Plan(encoder=ModulePlan(tp=tp, dp=dp), llm=ModulePlan(tp=tp, pp=pp, dp=dp), placement="colocated",
                microbatches=m, recompute="full")


def compare(p, global_batch: int, plan: Plan, within: Batching | None = None) -> tuple[dict[str, float], int]:
    """Mean step s per (path, fixed or variable), and the batches where a rank ran fewer microbatches;
    the optimizer's bins within its caps, or, as it cuts a baseline's plan, ``within`` that rule's bins."""
    runner = CostedPlan(plan, p.system)
    pool = BatchPool(p.data, global_batch, p.seed)  # the optimizer's batches
    evaluators = {v: Evaluator(replace(p, variable_microbatches=v), pool) for v in (False, True)}
    steps = {(path, v): [] for path in ("optimizer", "run") for v in (False, True)}
    fewer = 0
    for i in range(BATCHES):
        batch = pool[i]
        costs = plan_costs(batch, plan, p.model, p.cost)

        def timed(a: np.ndarray) -> float:
            return evaluate(runner.step(0, batch, a).timing).step_ns / 1e9

        for v in (False, True):  # the optimizer's bins within its memory caps (nan: none fit); a run's without
            try:
                steps[("optimizer", v)].append(timed(evaluators[v].assignment(plan, i, Batching.BALANCED, within)[0]))
            except InfeasibleError:
                steps[("optimizer", v)].append(float("nan"))
            run_bins = bin_batch(batch, plan, p.system, costs=costs, solver="greedy", evaluate=timed, variable=v)
            steps[("run", v)].append(timed(run_bins.assignment))
            fewer += v and min(run_bins.per_rank()) < plan.microbatches
    return {f"{path} {'variable' if v else 'fixed'}": float(np.mean(t)) for (path, v), t in steps.items()}, fewer


def main() -> None:
    rows = []
    for encoder, llm, mix, gpus, shape in SETTINGS:
        p, batch = problem(encoder, llm, gpus, mix)
        name = f"{SHORT[encoder]} + {SHORT[llm]}, {mix}, {gpus}"
        start = time.perf_counter()
        fixed = optimize(replace(p, variable_microbatches=False), batch)
        middle = time.perf_counter()
        free = optimize(p, batch)
        end = time.perf_counter()
        print(f"{name}: searched in {middle - start:.1f} s filled, {end - middle:.1f} s free; best "
              f"{fixed.best.mean:.3f} -> {free.best.mean:.3f} s ({fixed.best.mean / free.best.mean:.3f}x)", flush=True)
        for label, plan, within in (("optimizer's", fixed.best.plan, fixed.best.within),
                                    ("wide", wide(*shape) if shape else None, None)):
            if plan is None:
                continue
            t, fewer = compare(p, batch, plan, within)
            cut = (f"{t['optimizer fixed']:.3f} / {t['optimizer variable']:.3f} "
                   f"({t['optimizer fixed'] / t['optimizer variable']:.3f}x)" if np.isfinite(t["optimizer fixed"])
                   else "no bins within its memory caps")
            rows.append(f"| {name} | {label}: {plan.describe().replace(' | ', '; ')} | {cut} | "
                        f"{t['run fixed']:.3f} / {t['run variable']:.3f} ({t['run fixed'] / t['run variable']:.3f}x) | "
                        f"{fewer}/{BATCHES} |")
        rows.append(f"| {name} | the optimizer's best, searched each way | {fixed.best.mean:.3f} / {free.best.mean:.3f} "
                    f"({fixed.best.mean / free.best.mean:.3f}x) | | |")
    print(f"\nstep s, mean of {BATCHES} batches, fast evaluator, H100: every microbatch filled / a rank free to run "
          "fewer (gain)\n")
    print("| setting | plan | as the optimizer cuts | as a run cuts | batches where a rank ran fewer |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
