"""A heterogeneous encoder phase against the encoder inside LLM stage 0, measured on the torch backend.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_real_heterogeneous.py [--blocks 4] [--mix video-heavy]

The tiny models on 2 local CPU processes, the video-heavy mix (the tiny encoder's share of a step
is largest on video). For two LLM layouts (pp2: the encoder in stage 0 unbalances the pipeline;
dp2: it does not), the same global batches run under both placements, each with dflop's bins for
its plan, interleaved in blocks (block i under the colocated plan, then under the heterogeneous
one, then block i+1, ...), so that the machine's drift hits both alike; each launch warms up
first. The predictions are calibrated to this machine as `dflop run` calibrates them (the
shipped profile's shapes measured here at the plans' microbatch sizes before each block). It
prints per layout and placement the measured step graph (mean over the measured batches) and its
prediction, and the heterogeneous plan's speedup measured (total time) and predicted, with the
range of the per-batch ratios.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import tiny_cpu

LAYOUTS = {
    "pp2 1F1B": (dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4),
                 dict(encoder={"dp": 2}, llm={"pp": 2}, placement="heterogeneous", microbatches=4)),
    "dp2": (dict(encoder={"dp": 2}, llm={"dp": 2}, placement="colocated", microbatches=2),
            dict(encoder={"dp": 2}, llm={"dp": 2}, placement="heterogeneous", microbatches=2)),
}
PLACEMENTS = ("colocated", "heterogeneous")


def main() -> None:
    from dflop.backends import ScheduledBatch
    from dflop.backends.torch_runtime.backend import TorchBackend
    from dflop.backends.torch_runtime.worker import TorchOptions
    from dflop.jobs.calibrate import calibrate_for
    from dflop.schedule.batching import Batching
    from dflop.schedule.step import bin_batch
    from dflop.timing.steps import CostedPlan
    from dflop.workload import batches

    parser = tiny_cpu.parser(__doc__.splitlines()[0], "video-heavy")
    parser.add_argument("--blocks", type=int, default=4, help="blocks of batches per layout")
    parser.add_argument("--per-block", type=int, default=2, help="measured batches per block and launch")
    args = parser.parse_args()
    system, cost, data, note = tiny_cpu.setup(args)
    print(f"{system.model.name} on 2 CPU processes, {args.mix}, global batch {args.batch}, {args.blocks} blocks of "
          f"{args.per_block} batches; {note}")
    rows = []
    for name, fields in LAYOUTS.items():
        plans = [tiny_cpu.plan(f) for f in fields]
        stream = batches(data, args.batch, seed=2)
        graph = {p: [] for p in PLACEMENTS}
        predicted = {p: [] for p in PLACEMENTS}
        for _ in range(args.blocks):
            block = [next(stream) for _ in range(args.per_block)]
            steps = [[ScheduledBatch(b, bin_batch(b, plan, system, Batching.BALANCED, solver="auto",
                                                  time_limit=0.2).assignment) for b in block] for plan in plans]
            scaled, _ = calibrate_for(cost, list(zip(plans, steps)), lambda line: None)
            here = replace(system, cost=scaled)
            for placement, plan, planned in zip(PLACEMENTS, plans, steps):
                result = TorchBackend(options=TorchOptions(lr=1e-4)).run(CostedPlan(plan, here), planned)
                graph[placement] += [s.get("graph_s", s["step_s"]) for s in result.steps]
                predicted[placement] += list(result.extra["predicted_step_time_s"])
        measured = {p: np.array(graph[p]) for p in PLACEMENTS}
        guess = {p: np.array(predicted[p]) for p in PLACEMENTS}
        paired = measured["colocated"] / measured["heterogeneous"]
        row = {"layout": name, "plans": [p.describe() for p in plans],
               **{f"{p}_measured_s": float(measured[p].mean()) for p in PLACEMENTS},
               **{f"{p}_predicted_s": float(guess[p].mean()) for p in PLACEMENTS},
               "speedup": float(measured["colocated"].sum() / measured["heterogeneous"].sum()),
               "predicted_speedup": float(guess["colocated"].sum() / guess["heterogeneous"].sum()),
               "per_batch": [float(paired.min()), float(paired.max())]}
        rows.append(row)
        for p in PLACEMENTS:
            error = guess[p].mean() / measured[p].mean() - 1
            print(f"{name:<9} {p:<14} measured {measured[p].mean():.3f} s, predicted {guess[p].mean():.3f} s "
                  f"({error:+.1%})", flush=True)
        print(f"{name:<9} heterogeneous over colocated: {row['speedup']:.2f}x measured (per batch "
              f"{paired.min():.2f}-{paired.max():.2f}x), {row['predicted_speedup']:.2f}x predicted", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "cost_model": cost.name}, indent=2))


if __name__ == "__main__":
    main()
