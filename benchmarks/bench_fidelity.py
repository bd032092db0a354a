"""Fidelity: the simulator's predicted step time against the torch backend's measured one.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fidelity.py [--steps 2] [--rounds 5] [--profiles DIR]

Tiny SigLIP- and Qwen2.5-shaped models on 2 local CPU processes (gloo, one thread
each: the ranks never outnumber this machine's 2 cores, so the prediction need not
model sharing a core). Each plan x schedule trains the same global batches, split by
dflop's scheduler; the simulator predicts the very same steps with the profiled CPU
cost model (the shipped profile, measured with one thread per process as the backend
runs, TP in real gloo groups; or the stores in --profiles). The plans run in turn,
one launch each per round, so that a machine whose speed drifts (this VM's does, by up
to a third within minutes) slows every plan alike. It prints, per plan, the predicted
and the measured time of the step graph (median over every round's steps after its
warm-up step), the error, the spread of the rounds' medians (max - min over the
median), the optimizer step's measured time apart (it is not in the step graph), then
the median absolute error, the error every plan shares (the median signed error:
this machine's speed has drifted since the profile was measured, or the profile
misses something every plan runs) and each plan's error around it (what ranks the
plans), and the share of plan pairs the simulator orders as measured: of all pairs,
and of those that every round orders the same way. Two plans of one round ran
minutes apart, so a pair the rounds disagree on is one this machine cannot order;
with five rounds, two equally fast plans agree in every round by chance once in
sixteen.
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import numpy as np
import tiny_cpu

PLANS = {
    "dp2 (colocated)": dict(encoder={"dp": 2}, llm={"dp": 2}, placement="colocated", microbatches=2),
    "pp2 1F1B": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4, schedule="1F1B"),
    "pp2 GPipe": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4, schedule="GPipe"),
    "pp2 ZBH1": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4, schedule="ZBH1"),
    "pp2 Interleaved1F1B v2": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4,
                                   schedule="Interleaved1F1B", virtual_stages=2),
    "pp2 ZBVZeroBubble": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4,
                              schedule="ZBVZeroBubble", virtual_stages=2),
    "disaggregated encoder 1 + llm 1": dict(encoder={}, llm={}, placement="disaggregated", microbatches=2),
    "tp2 (colocated)": dict(encoder={"tp": 2}, llm={"tp": 2}, placement="colocated", microbatches=1),
}


def kendall_agreement(a: list[float], b: list[float], pairs: list[tuple[int, int]]) -> float:
    """Share of the given plan pairs that both lists order the same way."""
    same = sum(1 for i, j in pairs if (a[i] - a[j]) * (b[i] - b[j]) > 0)
    return same / len(pairs) if pairs else 1.0


def consistent_pairs(rows: list[dict], pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The plan pairs that every round orders the same way: those this machine can order at all
    (a drift slower than a round slows both plans of a pair alike, so each round is a paired
    comparison)."""
    def signs(i: int, j: int) -> set[float]:
        return set(np.sign(np.subtract(rows[i]["round_medians_s"], rows[j]["round_medians_s"])).tolist())

    return [(i, j) for i, j in pairs if signs(i, j) in ({1.0}, {-1.0})]


def main() -> None:
    from dflop.backends import ScheduledBatch
    from dflop.backends.torch_runtime.backend import TorchBackend
    from dflop.backends.torch_runtime.worker import TorchOptions
    from dflop.program.steps import StepRunner
    from dflop.schedule.step import plan_costs, schedule_batch
    from dflop.workload import batches

    parser = tiny_cpu.parser(__doc__.splitlines()[0], "llava-ov")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per plan and round (after a warm-up)")
    parser.add_argument("--rounds", type=int, default=5, help="launches per plan, the plans taken in turn")
    args = parser.parse_args()
    system, cost, data, note = tiny_cpu.setup(args)
    model = system.model
    print(f"{model.name} on 2 CPU processes, {args.mix}, global batch {args.batch}; {note}")
    plans = {name: tiny_cpu.plan(fields) for name, fields in PLANS.items()}
    scheduled = {}
    for name, plan in plans.items():
        stream = batches(data, args.batch, seed=1)
        scheduled[name] = []
        for _ in range(args.steps + 1):
            batch = next(stream)
            costs = plan_costs(batch, plan, model, cost)
            scheduled[name].append(ScheduledBatch(batch, schedule_batch(batch, plan, costs=costs, solver="auto",
                                                                        time_limit=0.2).assignment))
    runs: dict[str, list] = {name: [] for name in plans}
    for _ in range(args.rounds):  # in turn, so that a machine whose speed drifts slows every plan alike
        for name, plan in plans.items():
            runs[name].append(TorchBackend(options=TorchOptions(lr=1e-4)).run(StepRunner(plan, system),
                                                                               scheduled[name]))
    print(f"{'plan':<34} {'predicted s':>11} {'measured s':>11} {'error':>8} {'spread':>7} {'optimizer s':>11}")
    rows = []
    for name, plan in plans.items():
        graph = [[s["graph_s"] for s in result.steps[1:]] for result in runs[name]]
        measured = float(np.median(sum(graph, [])))
        rounds = [float(np.median(g)) for g in graph]
        spread = (max(rounds) - min(rounds)) / measured
        optimizer = float(np.median([s["optimizer_s"] for r in runs[name] for s in r.steps[1:]]))
        predicted = float(np.median(runs[name][0].extra["predicted_step_time_s"][1:]))
        rows.append({"plan": name, "describe": plan.describe(), "predicted_s": predicted, "measured_s": measured,
                     "round_medians_s": rounds, "spread": spread, "optimizer_s": optimizer,
                     "error": predicted / measured - 1})
        print(f"{name:<34} {predicted:11.3f} {measured:11.3f} {rows[-1]['error']:+8.1%} {spread:7.1%} "
              f"{optimizer:11.3f}")
    errors = [abs(r["error"]) for r in rows]
    offset = float(np.median([r["error"] for r in rows]))
    relative = [abs(r["error"] - offset) for r in rows]
    predicted, measured = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    pairs = list(combinations(range(len(rows)), 2))
    agreement = kendall_agreement(predicted, measured, pairs)
    resolved = consistent_pairs(rows, pairs)
    resolved_agreement = kendall_agreement(predicted, measured, resolved)
    fastest = (min(rows, key=lambda r: r["predicted_s"])["plan"], min(rows, key=lambda r: r["measured_s"])["plan"])
    print(f"median |error| {np.median(errors):.1%} (max {max(errors):.1%}) over {len(rows)} plans, "
          f"{args.rounds} rounds of {args.steps} steps each; spread: the rounds' medians, max - min over the median")
    print(f"shared by every plan: {offset:+.1%} (the median signed error); around it, plan by plan: median "
          f"{np.median(relative):.1%}, max {max(relative):.1%}")
    print(f"plan pairs ordered as measured: {agreement:.0%} of all {len(pairs)}, "
          f"{resolved_agreement:.0%} of the {len(resolved)} that every round orders alike; "
          f"fastest predicted: {fastest[0]}; fastest measured: {fastest[1]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "median_abs_error": float(np.median(errors)),
                                               "shared_error": offset,
                                               "median_plan_error": float(np.median(relative)),
                                               "pair_agreement": agreement, "resolved_pairs": len(resolved),
                                               "resolved_pair_agreement": resolved_agreement,
                                               "cost_model": cost.name}, indent=2))


if __name__ == "__main__":
    main()
