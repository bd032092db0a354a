"""Simulator speed: SimPy executor vs a bare SimPy loop, one step of a 1024-GPU plan, the fast evaluator
alone on a 16384-GPU plan.

Run: .venv/bin/python benchmarks/bench_sim.py [--quick] [--json PATH]
(--quick: 10 steps of the pipeline, and 128- and 256-GPU plans instead)
Prints figures and ratios of things measured in the same run (machines here are shared and noisy).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import simpy
from report import Results, arguments

from dflop.cost import AnalyticalCostModel, System
from dflop.timing.costing import stage_times_timing
from dflop.timing.costs import graph_costs, longest_path
from dflop.timing.evaluate import evaluate
from dflop.program.schedules import build
from dflop.program.lowering import lower
from dflop.timing.steps import CostedPlan
from dflop.program.template import build_template
from dflop.sim.engine import execute
from dflop.specs import ClusterSpec, ModulePlan, Plan, TrainingSpec, presets
from dflop.workload import profile_mix
from dflop.workload.sample import SampleTable


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


def pipeline_rate(results: Results, steps: int) -> None:
    p, m = 8, 64
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(pp=p), placement="colocated", microbatches=m)
    template = build_template(plan, build("1F1B", p, m))
    rng = np.random.default_rng(0)
    f, b = rng.uniform(1e-3, 2e-3, (p, m)), rng.uniform(2e-3, 4e-3, (p, m))
    graph = lower(template)
    costs = graph_costs(graph, stage_times_timing(template, f, b, np.zeros_like(b), p2p=1e-4))
    # best of three for both sides: a shared machine's load slows single passes at random
    ours, events = best_of(lambda: sum(execute(graph, costs, track_memory=False).events for _ in range(steps)))
    bare = min(bare_simpy(events) for _ in range(3))
    ops = steps * len(graph.compute_nodes)
    results.table(["executor", "SimPy events", "seconds", "events/s", "compute nodes/s"],
                  [["dflop simulator", events, round(ours, 2), round(events / ours), round(ops / ours)],
                   ["bare SimPy loop", events, round(bare, 2), round(events / bare), ""]],
                  f"1F1B p={p} m={m}, {steps} steps: {ops} compute nodes ({steps * len(graph)} nodes with sends "
                  "and receives)")
    results.note(f"simulator / bare SimPy event rate: {bare / ours:.2f} (target >= 0.5); each SimPy event carries "
                 f"{len(graph) / len(graph.compute_nodes):.2f} step-graph nodes (sends and receives have no "
                 "events of their own)")


def disaggregated(nodes: int) -> tuple[Plan, ClusterSpec, Callable[[], CostedPlan], SampleTable]:
    """SigLIP + Qwen2.5-7B on ``nodes`` x 8 H100, the encoder on an eighth of them; 8 samples per GPU."""
    model = presets.model("siglip-so400m", "qwen2.5-7b")
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=nodes, gpus_per_node=8)
    batch = 8 * cluster.gpus
    training = TrainingSpec(global_batch=batch, recompute="full")
    cost = AnalyticalCostModel(model, cluster.hardware, training)
    encoder_dp = cluster.gpus // 8
    plan = Plan(encoder=ModulePlan(tp=1, pp=1, dp=encoder_dp),
                llm=ModulePlan(tp=4, pp=4, dp=(cluster.gpus - encoder_dp) // 16), microbatches=16)
    plan.validate(cluster, model, batch)
    sample = profile_mix("llava-ov", 20000, model.encoder).sample(batch, np.random.default_rng(0))
    return plan, cluster, lambda: CostedPlan(plan, System(model, cluster, training, cost)), sample


def big_plan(results: Results, nodes: int) -> None:
    plan, cluster, costed, sample = disaggregated(nodes)
    runner = costed()
    assignment = np.arange(len(sample)) % plan.bins
    t_timing, timing = best_of(lambda: runner.builder.timing(sample, assignment))
    t_lower, graph = best_of(lambda: runner.lower(sample, assignment))
    t_costs, costs = best_of(lambda: graph_costs(graph, timing))
    fresh = runner.lower(sample, assignment)
    t_first, _ = best_of(lambda: execute(fresh, costs), repeats=1)  # builds the views of the graph it reads
    t_sim, ex = best_of(lambda: execute(graph, costs))
    t_fast, fast = best_of(lambda: evaluate(timing))
    t_ref, (_, end) = best_of(lambda: longest_path(graph, costs))
    exact = execute(graph, costs, contention=False).makespan
    results.table(["stage", "ms"], [["costing", round(t_timing * 1e3)], ["lowering", round(t_lower * 1e3)],
                                    ["graph costs", round(t_costs * 1e3)], ["SimPy step", round(t_sim * 1e3)],
                                    ["SimPy step, first on its graph", round(t_first * 1e3)],
                                    ["fast evaluator", round(t_fast * 1e3, 1)],
                                    ["reference longest path", round(t_ref * 1e3)]],
                  f"{cluster.gpus}-GPU plan [{plan.describe()}]: {len(graph)} nodes "
                  f"({len(graph.compute_nodes)} compute), {len(graph.workers)} workers, {ex.events} SimPy events")
    results.note(f"{cluster.gpus} GPUs: SimPy step {t_sim:.3f} s (target < 1 s at 1024 GPUs); fast evaluator "
                 f"speed-up over SimPy {t_sim / t_fast:.0f}x")
    results.note(f"{cluster.gpus} GPUs: step {ex.makespan / 1e9:.3f} s with link contention, {exact / 1e9:.3f} s "
                 f"without (fast evaluator {fast.step_ns / 1e9:.3f} s, equal: "
                 f"{fast.step_ns == exact == int(end.max())})")


def huge_plan(results: Results, nodes: int) -> None:
    """The search's path alone (no step graph) at a size where lowering the graph is out of reach."""
    plan, cluster, costed, sample = disaggregated(nodes)
    t_setup, runner = best_of(costed)
    assignment = np.arange(len(sample)) % plan.bins
    t_timing, timing = best_of(lambda: runner.builder.timing(sample, assignment))
    t_fast, fast = best_of(lambda: evaluate(timing))
    results.table(["stage", "ms"], [["set-up (once per plan)", round(t_setup * 1e3)],
                                    ["costing the batch", round(t_timing * 1e3)],
                                    ["fast evaluator", round(t_fast * 1e3, 1)]],
                  f"{cluster.gpus}-GPU plan [{plan.describe()}], {len(sample)} samples: the fast evaluator's step")
    results.note(f"{cluster.gpus} GPUs: a step with the fast evaluator (costing + evaluation) "
                 f"{t_timing + t_fast:.2f} s (target < 1 s at 16384 GPUs); predicted step {fast.step_ns / 1e9:.3f} s")


def main() -> None:
    args = arguments(__doc__.splitlines()[0]).parse_args()
    results = Results("Simulator speed", "python benchmarks/bench_sim.py" + (" --quick" if args.quick else ""))
    pipeline_rate(results, 10 if args.quick else 100)
    big_plan(results, 16 if args.quick else 128)
    huge_plan(results, 32 if args.quick else 2048)
    results.save(args.json)


if __name__ == "__main__":
    main()
