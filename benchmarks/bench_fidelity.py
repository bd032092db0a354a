"""Fidelity: the simulator's predicted step time against the torch backend's measured one.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fidelity.py [--steps 2] [--rounds 5] [--profiles DIR]
     [--fresh DIR | --no-fresh]

Tiny SigLIP- and Qwen2.5-shaped models on 2 local CPU processes (gloo, one thread each:
the ranks never outnumber this machine's 2 cores, so the prediction need not model
sharing a core). Each plan x schedule trains the same global batches, split by dflop's
scheduler; the simulator predicts the very same steps with the profiled CPU cost model
(the shipped profile, measured with one thread per process as the backend runs, TP in
real gloo groups; or the stores in --profiles), and again with a profile measured the
same way at the start of the run (the two `dflop profile model` commands of
docs/guide/profiling.md, into
--fresh or a temporary store): a profile is this machine at one time, and the difference
between the two is how far the machine moved since. The plans run in turn, one launch
each per round, so that a machine whose speed drifts slows every plan alike. It prints, per plan, the predicted and the
measured time of the step graph (median over every round's steps after its warm-up
step), the error, the spread of the rounds' medians (max - min over the median), the
optimizer step's measured time apart (it is not in the step graph), then the median
absolute error, the error every plan shares (the median signed error: this machine's
speed has drifted since the profile was measured, or the profile misses something every
plan runs) and each plan's error around it (what ranks the plans), and the share of plan
pairs the simulator orders as measured: of all pairs, and of those that every round
orders the same way. Two plans of one round ran minutes apart, so a pair the rounds
disagree on is one this machine cannot order; with five rounds, two equally fast plans
agree in every round by chance once in sixteen. After every round, the profile's own
shapes at the steps' microbatch sizes are measured again as `dflop profile check` does:
how far this machine has moved since the profile was measured, apart from anything the
simulator gets wrong.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from itertools import combinations
from pathlib import Path

import numpy as np
import tiny_cpu

PLANS = {
    "dp2 (colocated)": dict(encoder={"dp": 2}, llm={"dp": 2}, placement="colocated", microbatches=2),
    "dp2 ZeRO-2 (FSDP2)": dict(encoder={"dp": 2}, llm={"dp": 2}, placement="colocated", microbatches=2, zero=2),
    "pp2 1F1B": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4, schedule="1F1B"),
    "pp2 GPipe": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4, schedule="GPipe"),
    "pp2 ZBH1": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4, schedule="ZBH1"),
    "pp2 Interleaved1F1B v2": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4,
                                   schedule="Interleaved1F1B", virtual_stages=2),
    "pp2 ZBVZeroBubble": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4,
                              schedule="ZBVZeroBubble", virtual_stages=2),
    "disaggregated encoder 1 + llm 1": dict(encoder={}, llm={}, placement="disaggregated", microbatches=2),
    "tp2 (colocated)": dict(encoder={"tp": 2}, llm={"tp": 2}, placement="colocated", microbatches=1),
    "pp2 heterogeneous encoder dp2": dict(encoder={"dp": 2}, llm={"pp": 2}, placement="heterogeneous",
                                          microbatches=4),
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
    from dflop.backends.sim import SimBackend
    from dflop.cost.select import select_cost_model
    from dflop.jobs.calibrate import microbatch_size
    from dflop.profile.drift import measure_drift, overall_ratio
    from dflop.profile.profiler import profile_model
    from dflop.timing.steps import CostedPlan
    from dflop.schedule.step import bin_batch, plan_costs
    from dflop.workload import batches

    parser = tiny_cpu.parser(__doc__.splitlines()[0], "llava-ov")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per plan and round (after a warm-up)")
    parser.add_argument("--rounds", type=int, default=5, help="launches per plan, the plans taken in turn")
    parser.add_argument("--fresh", type=Path, help="profile store to measure the models into first and predict "
                        "with as well (default: a temporary one)")
    parser.add_argument("--no-fresh", action="store_true", help="do not measure a profile first (6-7 minutes here)")
    args = parser.parse_args()
    system, cost, data, note = tiny_cpu.setup(args)
    model = system.model
    print(f"{model.name} on 2 CPU processes, {args.mix}, global batch {args.batch}; {note}")
    fresh = None
    if not args.no_fresh:
        with tempfile.TemporaryDirectory() as tmp:
            folder, start = args.fresh or Path(tmp), time.monotonic()
            for m in (model.llm, model.encoder):  # as docs/guide/profiling.md's two commands
                profile_model(m.name, folder, tps=(1, 2), processes=2, fsdp=True)
            fresh, fresh_note = select_cost_model(model, system.hardware, system.training, [folder])
        print(f"profiled first in {time.monotonic() - start:.0f} s; {fresh_note}")
    plans = {name: tiny_cpu.plan(fields) for name, fields in PLANS.items()}
    scheduled = {}
    for name, plan in plans.items():
        stream = batches(data, args.batch, seed=1)
        scheduled[name] = []
        for _ in range(args.steps + 1):
            batch = next(stream)
            bins = bin_batch(batch, plan, system, costs=plan_costs(batch, plan, model, cost), solver="auto",
                             time_limit=0.2)
            scheduled[name].append(ScheduledBatch(batch, bins.assignment))
    steps = [s for plan in scheduled.values() for s in plan]
    tokens, tiles = microbatch_size(steps, "llm_tokens"), microbatch_size(steps, "tiles")
    runs: dict[str, list] = {name: [] for name in plans}
    drifts: list[list] = []
    for _ in range(args.rounds):  # in turn, so that a machine whose speed drifts slows every plan alike
        for name, plan in plans.items():
            runs[name].append(TorchBackend(options=TorchOptions(lr=1e-4)).run(CostedPlan(plan, system),
                                                                               scheduled[name]))
        drifts.append([measure_drift(cost.records, m.name, tokens=tokens, tiles=tiles, repeats=3)
                       for m in (model.encoder, model.llm)])
    rows = []
    for name, plan in plans.items():
        graph = [[s["graph_s"] for s in result.steps[1:]] for result in runs[name]]
        measured = float(np.median(sum(graph, [])))
        rounds = [float(np.median(g)) for g in graph]
        rows.append({"plan": name, "describe": plan.describe(), "measured_s": measured, "round_medians_s": rounds,
                     "spread": (max(rounds) - min(rounds)) / measured,
                     "optimizer_s": float(np.median([s["optimizer_s"] for r in runs[name] for s in r.steps[1:]])),
                     "predicted_s": float(np.median(runs[name][0].extra["predicted_step_time_s"][1:]))})
        if fresh is not None:
            again = SimBackend(memory=False).run(CostedPlan(plan, replace(system, cost=fresh)), scheduled[name])
            rows[-1]["fresh_predicted_s"] = float(np.median([s["step_s"] for s in again.steps[1:]]))
    keys = ["predicted_s"] + (["fresh_predicted_s"] if fresh is not None else [])
    print(f"{'plan':<34} {'measured s':>10} {'spread':>7} {'optimizer s':>11}"
          + "".join(f" {'predicted s':>11} {'error':>7}" for _ in keys))
    for r in rows:
        print(f"{r['plan']:<34} {r['measured_s']:10.3f} {r['spread']:7.1%} {r['optimizer_s']:11.3f}"
              + "".join(f" {r[k]:11.3f} {r[k] / r['measured_s'] - 1:+7.1%}" for k in keys))
    print(f"{len(rows)} plans, {args.rounds} rounds of {args.steps} steps each; spread: the rounds' medians, max - min "
          "over the median; predicted by the profile given" + (", then by the one measured first" if fresh is not None
                                                                else ""))
    figures = {"given": summary(rows, "predicted_s", "with the profile given", cost.name)}
    ratios = [overall_ratio(d) for d in drifts]
    parts = [r for d in sum(drifts, []) for r in d.parts().values()]
    print(f"  its shapes at these steps' microbatch sizes ({tokens:.0f} LLM tokens, {tiles:.0f} tiles), measured "
          "again after each round (dflop profile check): "
          f"{' '.join(f'{m:.2f}x' for m in ratios)} the time it records (part by part {min(parts):.2f}x to "
          f"{max(parts):.2f}x); the steps: {1 / (1 + figures['given']['shared_error']):.2f}x the predicted")
    figures["given"]["machine_ratio"] = ratios
    if fresh is not None:
        figures["fresh"] = summary(rows, "fresh_predicted_s", "with the profile measured first", fresh.name)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, **figures}, indent=2))


def summary(rows: list[dict], key: str, title: str, cost_model: str) -> dict:
    """Print and return how well the predictions ``rows[i][key]`` hold against the measured steps:
    the median |error|, the error every plan shares and each plan's around it, and the plan pairs
    ordered as measured."""
    predicted, measured = [r[key] for r in rows], [r["measured_s"] for r in rows]
    errors = [p / m - 1 for p, m in zip(predicted, measured)]
    offset = float(np.median(errors))
    relative = [abs(e - offset) for e in errors]
    pairs = list(combinations(range(len(rows)), 2))
    resolved = consistent_pairs(rows, pairs)
    out = {"cost_model": cost_model, "median_abs_error": float(np.median(np.abs(errors))), "shared_error": offset,
           "median_plan_error": float(np.median(relative)),
           "pair_agreement": kendall_agreement(predicted, measured, pairs), "resolved_pairs": len(resolved),
           "resolved_pair_agreement": kendall_agreement(predicted, measured, resolved)}
    print(f"{title}:\n  median |error| {out['median_abs_error']:.1%} (max {max(np.abs(errors)):.1%}); shared by "
          f"every plan {offset:+.1%} (the median signed error); around it, plan by plan: median "
          f"{out['median_plan_error']:.1%}, max {max(relative):.1%}")
    print(f"  plan pairs ordered as measured: {out['pair_agreement']:.0%} of all {len(pairs)}, "
          f"{out['resolved_pair_agreement']:.0%} of the {len(resolved)} that every round orders alike; fastest "
          f"predicted: {rows[int(np.argmin(predicted))]['plan']}; measured: {rows[int(np.argmin(measured))]['plan']}")
    return out


if __name__ == "__main__":
    main()
