"""Partitioners on llava-ov batches and on instances with a known optimum: gap and time.

Run: .venv/bin/python benchmarks/bench_scheduler.py [--time-limit S] [--seeds N] [--skip-llava]

1. llava-ov batches: the two-dimensional (encoder, LLM) per-sample stage times
   the scheduler uses for a SigLIP + Qwen2.5-7B plan on H100s; gap to the
   lower bound (the optimum is unknown), one batch per size. The ILP and the
   one-boolean-per-(sample, bin) reference model get the same time limit.
2. Known optimum: K bins of per-bin items whose sums are exactly equal in both
   dimensions, shuffled; the gap is to that optimum (here also the lower bound).
   - ``split``: each bin's target cut at uniform random points, independently
     per dimension (Dirichlet(1)); the target is a realistic bin time (the mean
     llava-ov LLM cost times items per bin) in both dimensions, as for the two
     LLM stages of a colocated plan. The hard case.
   - ``even``: the same with Dirichlet(4): items of similar size, fewer small ones.
   - ``llava``: each bin's items drawn from llava-ov costs, rescaled per dimension
     so every bin sums to the same target.
   Per family, size and solver: the largest gap over the seeds, and the largest
   wall and CPU seconds (CPU includes the ILP's child process). Wall time is what
   the limit bounds; CPU time is what one core spends, whatever else runs.
"""

from __future__ import annotations

import argparse
import os
import time

import mip
import numpy as np

from dflop.cost import AnalyticalCostModel
from dflop.schedule.problem import PartitionProblem
from dflop.schedule.solve import partition
from dflop.schedule.step import plan_costs
from dflop.specs import ModulePlan, Plan, TrainingSpec, presets
from dflop.workload import profile_mix

SIZES = ((64, 8), (256, 16), (1024, 32), (4096, 64))
HARD_SIZES = ((256, 16), (1024, 32), (4096, 64))
SOLVERS = (("auto", "cbc"), ("ilp", "cbc"), ("ilp", "highs"), ("greedy", "cbc"), ("lpt", "cbc"), ("kk", "cbc"),
           ("sequential", "cbc"))


def costs_for(n: int, k: int, seed: int) -> np.ndarray:
    model = presets.model("siglip-so400m", "qwen2.5-7b")
    training = TrainingSpec(global_batch=n, recompute="full")
    cost = AnalyticalCostModel(model, presets.hardware("h100"), training)
    dp = 4
    plan = Plan(encoder=ModulePlan(dp=dp), llm=ModulePlan(tp=2, pp=2, dp=dp), microbatches=k // dp)
    batch = profile_mix("llava-ov", 20000, model.encoder, seed=11).sample(n, np.random.default_rng(seed))
    return plan_costs(batch, plan, model, cost)


def perfect(rng: np.random.Generator, k: int, per_bin: int, family: str,
            pool: np.ndarray) -> tuple[np.ndarray, float]:
    """(shuffled costs, optimum) of k bins whose sums are equal in every dimension."""
    if family == "llava":
        target = pool.mean(axis=0) * per_bin
        parts = []
        while len(parts) < k:
            part = pool[rng.integers(0, len(pool), per_bin)]
            if (part.sum(axis=0) > 0).all():
                parts.append(part * (target / part.sum(axis=0)))
    else:
        alpha = {"split": 1.0, "even": 4.0}[family]
        target = pool[:, 1].mean() * per_bin
        parts = [target * rng.dirichlet(np.full(per_bin, alpha), size=2).T for _ in range(k)]
    optimum = max(float(part.sum(axis=0).max()) for part in parts)
    return np.vstack(parts)[rng.permutation(k * per_bin)], optimum


def reference(problem: PartitionProblem, time_limit: float) -> np.ndarray | None:
    """The textbook model, one boolean per (item, bin), that the class ILP is compared to."""
    k = problem.bins
    model = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    model.verbose, model.threads = 0, 1
    x = [[model.add_var(var_type=mip.BINARY) for _ in range(k)] for _ in range(problem.n)]
    z = model.add_var(lb=0.0)
    model.objective = z
    for i in range(problem.n):
        model += mip.xsum(x[i]) == 1
    for b in range(k):
        for d in range(problem.dims):
            model += mip.xsum(float(problem.costs[i, d]) * x[i][b] for i in range(problem.n)) <= z
    status = model.optimize(max_seconds=time_limit)
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        return None
    return np.array([int(np.argmax([v.x for v in row])) for row in x], dtype=np.int64)


def measured(fn, repeats: int = 1):
    """(best wall seconds, CPU seconds of that run including child processes, result)."""
    best = (float("inf"), 0.0, None)
    for _ in range(repeats):
        before, start = os.times(), time.perf_counter()
        out = fn()
        wall, after = time.perf_counter() - start, os.times()
        cpu = sum(after[:4]) - sum(before[:4])
        if wall < best[0]:
            best = (wall, cpu, out)
    return best


def llava_table(limit: float) -> None:
    print(f"llava-ov batches: gap to the lower bound (%) and wall time (ms); time limit {limit:g} s\n")
    names = [f"{s}" if s != "ilp" else f"ilp {b}" for s, b in SOLVERS] + ["reference cbc"]
    print(f"{'N':>5} {'K':>3}  " + "  ".join(f"{name:>19}" for name in names))
    for n, k in SIZES:
        problem = PartitionProblem(costs_for(n, k, seed=n), k)
        cells = []
        for solver, backend in SOLVERS:
            repeats = 5 if solver in ("lpt", "sequential", "greedy") else 1
            wall, _, result = measured(lambda: partition(problem, solver, time_limit=limit, backend=backend), repeats)
            cells.append(f"{result.gap * 100:9.4f} {wall * 1e3:7.1f}ms")
        if n * k > 40_000:
            cells.append(f"{'(skipped)':>19}")
        else:
            wall, _, assignment = measured(lambda: reference(problem, limit))
            gap = ("no solution" if assignment is None or len(np.unique(assignment)) < k
                   else f"{(problem.makespan(assignment) / problem.lower_bound() - 1) * 100:9.4f}")
            cells.append(f"{gap:>9} {wall * 1e3:7.1f}ms")
        print(f"{n:>5} {k:>3}  " + "  ".join(cells))


def known_optimum_table(limit: float, seeds: int) -> None:
    pool = costs_for(4096, 64, seed=99)
    print(f"\nknown optimum: largest gap to the optimum (%) over {seeds} seeds, largest wall / CPU seconds; "
          f"time limit {limit:g} s\n")
    names = [f"{s}" if s != "ilp" else f"ilp {b}" for s, b in SOLVERS]
    print(f"{'family':>6} {'N':>5} {'K':>3}  " + "  ".join(f"{name:>22}" for name in names))
    for family in ("split", "even", "llava"):
        for n, k in HARD_SIZES:
            gaps = {name: [] for name in names}
            walls = {name: [] for name in names}
            cpus = {name: [] for name in names}
            for seed in range(seeds):
                costs, optimum = perfect(np.random.default_rng(1000 * seed + n), k, n // k, family, pool)
                problem = PartitionProblem(costs, k)
                for name, (solver, backend) in zip(names, SOLVERS):
                    wall, cpu, result = measured(lambda: partition(problem, solver, time_limit=limit,
                                                                   backend=backend))
                    gaps[name].append((result.makespan / optimum - 1) * 100)
                    walls[name].append(wall)
                    cpus[name].append(cpu)
            cells = [f"{max(gaps[m]):9.4f} {max(walls[m]):5.2f}/{max(cpus[m]):5.2f}s" for m in names]
            print(f"{family:>6} {n:>5} {k:>3}  " + "  ".join(cells), flush=True)


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--time-limit", type=float, default=1.0)
    args.add_argument("--seeds", type=int, default=3)
    args.add_argument("--skip-llava", action="store_true", help="Only the known-optimum instances.")
    options = args.parse_args()
    if not options.skip_llava:
        llava_table(options.time_limit)
    known_optimum_table(options.time_limit, options.seeds)
    print("\ntargets: auto within 0.1% of the optimum in 1 s at every known-optimum size; "
          "ilp highs wall time near its limit; at (4096, 64) on llava-ov, lpt under 5 ms")


if __name__ == "__main__":
    main()
