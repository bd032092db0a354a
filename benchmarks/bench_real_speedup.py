"""Real speedup: dflop's balanced bins against the data-blind rules, measured on the torch backend.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_real_speedup.py [--rounds 7] [--mix video-heavy]

Tiny SigLIP- and Qwen2.5-shaped models on 2 local CPU processes (gloo, one thread
each). For each plan, every global batch is cut four ways: dflop's scheduler
(balanced on predicted costs), arrival order (Megatron's sampler, "sequential"),
LLaVA's modality-length grouping and token-budget packing. All arms run in ONE
launch on the same processes, interleaved batch by batch (batch 1 under every rule,
then batch 2, ...), so that the machine's drift hits every arm alike; the first
round is a warm-up and is not counted. It prints each arm's measured step time
(the step graph plus the optimizer step, which is the same work in every arm), the
measured speedup of dflop's bins over the arm (total time over the measured
batches), the range of the per-batch ratios (each batch under the arm against the
same batch balanced, run seconds apart: the comparison drift disturbs least), and
the simulator's predicted speedup for the same steps (step graphs only).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tiny_cpu

PLANS = {
    "dp2 (colocated)": dict(encoder={"dp": 2}, llm={"dp": 2}, placement="colocated", microbatches=2),
    "pp2 1F1B": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4, schedule="1F1B"),
}
ARMS = ("balanced", "arrival", "modality-length", "token-budget")


def main() -> None:
    from dflop.backends import ScheduledBatch
    from dflop.backends.torch_runtime.backend import TorchBackend
    from dflop.backends.torch_runtime.worker import TorchOptions
    from dflop.timing.steps import CostedPlan
    from dflop.schedule.step import bin_batch
    from dflop.schedule.batching import Batching
    from dflop.workload import batches

    parser = tiny_cpu.parser(__doc__.splitlines()[0], "video-heavy")
    parser.add_argument("--rounds", type=int, default=7, help="global batches per plan (the first is a warm-up)")
    args = parser.parse_args()
    system, cost, data, note = tiny_cpu.setup(args)
    model = system.model
    print(f"{model.name} on 2 CPU processes, {args.mix}, global batch {args.batch}, {args.rounds - 1} measured "
          f"batches per arm; {note}")
    print(f"{'plan':<18} {'bins':<16} {'measured step s':>15} {'dflop speedup':>13} {'per batch':>11} "
          f"{'predicted':>9}")
    rows = []
    for name, fields in PLANS.items():
        plan = tiny_cpu.plan(fields)
        stream = batches(data, args.batch, seed=1)
        steps = []
        for _ in range(args.rounds):
            batch = next(stream)
            for arm in ARMS:  # the bins `dflop run` trains: dflop's (solver "auto"), or a baseline's rule
                bins = bin_batch(batch, plan, system, Batching(arm), solver="auto", time_limit=0.2).assignment
                steps.append(ScheduledBatch(batch, bins))
        result = TorchBackend(options=TorchOptions(lr=1e-4)).run(CostedPlan(plan, system), steps)
        per_batch = np.array([s["step_s"] for s in result.steps]).reshape(args.rounds, len(ARMS))[1:]
        measured = per_batch.sum(axis=0)
        predicted = np.array(result.extra["predicted_step_time_s"]).reshape(args.rounds, len(ARMS))[1:].sum(axis=0)
        for a, arm in enumerate(ARMS):
            paired = per_batch[:, a] / per_batch[:, 0]
            row = {"plan": name, "bins": arm, "measured_step_s": measured[a] / (args.rounds - 1),
                   "speedup": measured[a] / measured[0], "per_batch": [float(paired.min()), float(paired.max())],
                   "predicted_speedup": predicted[a] / predicted[0]}
            rows.append(row)
            print(f"{name:<18} {arm:<16} {row['measured_step_s']:15.3f} {row['speedup']:12.2f}x "
                  f"{paired.min():5.2f}-{paired.max():4.2f}x {row['predicted_speedup']:8.2f}x", flush=True)
        strongest = min(rows[-len(ARMS) + 1:], key=lambda r: r["measured_step_s"])
        print(f"{name:<18} over the strongest data-blind rule ({strongest['bins']}): {strongest['speedup']:.2f}x "
              f"measured, {strongest['predicted_speedup']:.2f}x predicted")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "cost_model": cost.name}, indent=2))


if __name__ == "__main__":
    main()
