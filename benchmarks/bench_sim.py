"""Simulator speed: SimPy executor vs a bare SimPy loop, one step of a 1024-GPU plan, the fast evaluator.

Run: .venv/bin/python benchmarks/bench_sim.py
Prints figures and ratios of things measured in the same run (machines here are shared and noisy).
"""

from __future__ import annotations

import time

import numpy as np
import simpy

from dflop.cost import AnalyticalCostModel, System
from dflop.program.costing import stage_times_timing
from dflop.program.costs import graph_costs, longest_path
from dflop.program.evaluate import evaluate
from dflop.program.schedules import build
from dflop.program.stepgraph import lower
from dflop.program.steps import StepRunner
from dflop.program.template import build_template
from dflop.sim.engine import execute
from dflop.specs import ClusterSpec, ModulePlan, Plan, TrainingSpec, presets
from dflop.workload import profile_mix


def best_of(fn, repeats=3):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def bare_simpy(events: int) -> float:
    """Seconds for a bare SimPy loop to process ``events`` timeout events."""
    env = simpy.Environment()

    def proc(n):
        for _ in range(n):
            yield env.timeout(1)

    env.process(proc(events))
    start = time.perf_counter()
    env.run()
    return time.perf_counter() - start


def pipeline_rate() -> None:
    p, m, steps = 8, 64, 100
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(pp=p), placement="colocated", microbatches=m)
    template = build_template(plan, build("1F1B", p, m))
    rng = np.random.default_rng(0)
    f, b = rng.uniform(1e-3, 2e-3, (p, m)), rng.uniform(2e-3, 4e-3, (p, m))
    graph = lower(template)
    costs = graph_costs(graph, stage_times_timing(template, f, b, np.zeros_like(b), p2p=1e-4))
    start = time.perf_counter()
    events = 0
    for _ in range(steps):
        events += execute(graph, costs, track_memory=False).events
    ours = time.perf_counter() - start
    bare = min(bare_simpy(events) for _ in range(3))
    ops = steps * len(graph.compute_nodes())
    print(f"1F1B p={p} m={m}, {steps} steps: {ops} compute nodes ({steps * len(graph)} nodes with "
          f"sends and receives), {events} SimPy events in {ours:.2f} s = {ops / ours:,.0f} compute nodes/s, "
          f"{events / ours:,.0f} events/s")
    print(f"bare SimPy loop, {events} events: {bare:.2f} s = {events / bare:,.0f} events/s")
    print(f"  simulator / bare SimPy event rate: {bare / ours:.2f} (target >= 0.5)")


def big_plan() -> None:
    model = presets.model("siglip-so400m", "qwen2.5-7b")
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=128, gpus_per_node=8)
    training = TrainingSpec(global_batch=8192, recompute="full")
    cost = AnalyticalCostModel(model, cluster.hardware, training)
    plan = Plan(encoder=ModulePlan(tp=1, pp=1, dp=128), llm=ModulePlan(tp=4, pp=4, dp=56), microbatches=16)
    plan.validate(cluster, model, 8192)
    runner = StepRunner(plan, System(model, cluster, training, cost))
    batch = profile_mix("llava-ov", 20000, model.encoder).sample(8192, np.random.default_rng(0))
    assignment = np.arange(8192) % plan.bins
    t_timing, timing = best_of(lambda: runner.builder.timing(batch, assignment))
    t_lower, graph = best_of(lambda: runner.lower(batch, assignment))
    t_costs, costs = best_of(lambda: graph_costs(graph, timing))
    t_sim, ex = best_of(lambda: execute(graph, costs))
    t_fast, fast = best_of(lambda: evaluate(timing))
    t_ref, (_, end) = best_of(lambda: longest_path(graph, costs))
    exact = execute(graph, costs, contention=False).makespan
    print(f"1024-GPU plan [{plan.describe()}]: {len(graph)} nodes ({len(graph.compute_nodes())} compute), "
          f"{len(graph.workers)} workers")
    print(f"  costing {t_timing * 1e3:.0f} ms, lowering {t_lower * 1e3:.0f} ms, graph costs {t_costs * 1e3:.0f} ms, "
          f"SimPy step {t_sim:.3f} s (target < 1 s), {ex.events} events")
    print(f"  fast evaluator {t_fast * 1e3:.1f} ms, reference longest path {t_ref * 1e3:.0f} ms; "
          f"fast evaluator speed-up over SimPy: {t_sim / t_fast:.0f}x")
    print(f"  step {ex.makespan / 1e9:.3f} s with link contention, {exact / 1e9:.3f} s without "
          f"(fast evaluator {fast.step_ns / 1e9:.3f} s, equal: {fast.step_ns == exact == int(end.max())})")


if __name__ == "__main__":
    pipeline_rate()
    big_plan()
