"""Fidelity where the profile was not measured: the shipped profile on this machine, as a user's first run meets it.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_foreign_profile.py [--steps 3] [--rounds 3]

The shipped CPU profile (measured on the developers' machine) predicts plans it was never
tuned on (``PLANS``: held out of bench_fidelity's), on two mixes, each plan launched on
the tiny models through the torch backend. Each round is a user's run: the calibration
(``dflop.jobs.calibrate``: a few of the profile's shapes measured here just before the plan
runs, as `dflop run` measures them before its first step, each part scaled by what it ran
at), then the plan's steps. Per mix and plan it prints the measured step graph (median over
the steps after the warm-up) against the prediction as the profile records it and against
the calibrated one, each the median over the rounds (the errors: the median of the rounds'
errors, each round against its own calibration): on a shared machine one calibration
is a few seconds' snapshot of a speed that moves by tens of percent from minute to minute,
and the rounds say how far (the range of the rounds' calibrated errors). Two plans have more
ranks than this machine's 2 cores: the ranks take turns on the cores, and so do their
predictions (``TorchBackend`` predicts with ``shared_cores``: the ops
in progress share the cores as the OS time-slices processes, ``dflop.sim.sharing``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import tiny_cpu

MIXES = ("llava-ov", "video-heavy")
PLANS = {
    "pp2 1F1B": dict(encoder={}, llm={"pp": 2}, placement="colocated", microbatches=4, schedule="1F1B"),
    "pp2 x dp2 (colocated)": dict(encoder={"dp": 2}, llm={"pp": 2, "dp": 2}, placement="colocated", microbatches=4,
                                  schedule="1F1B"),
    "disaggregated encoder 1 + llm dp2": dict(encoder={}, llm={"dp": 2}, placement="disaggregated", microbatches=2),
}
"""Held out of bench_fidelity's plans; two of them with more ranks than 2 cores."""


def main() -> None:
    from dflop.backends import ScheduledBatch
    from dflop.backends.sim import SimBackend
    from dflop.backends.torch_runtime.backend import TorchBackend, cpu_cores, shared_cores
    from dflop.backends.torch_runtime.worker import TorchOptions
    from dflop.jobs.calibrate import calibrate_for, machine_note
    from dflop.schedule.step import bin_batch, plan_costs
    from dflop.specs import ClusterSpec
    from dflop.specs.execution import Device
    from dflop.timing.steps import CostedPlan
    from dflop.workload import batches

    parser = tiny_cpu.parser(__doc__.splitlines()[0], mix=None)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per plan and round (after a warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per plan: a calibration, then its steps")
    args = parser.parse_args()
    rows = []
    for mix in MIXES:
        system, cost, data, note = tiny_cpu.setup(argparse.Namespace(**vars(args), mix=mix))
        print(f"{mix}: {note}; {machine_note(cost) or 'profile measured on this machine'}")
        for name, fields in PLANS.items():
            plan = tiny_cpu.plan(fields)
            wide = replace(system, cluster=ClusterSpec(hardware=system.hardware, nodes=1, gpus_per_node=plan.gpus))
            stream = batches(data, args.batch, seed=1)
            steps = [ScheduledBatch(b, bin_batch(b, plan, wide, costs=plan_costs(b, plan, system.model, cost),
                                                 solver="auto", time_limit=0.2).assignment)
                     for b in (next(stream) for _ in range(args.steps + 1))]
            predicted = float(np.median([s["step_s"] for s in SimBackend(memory=False, cores=shared_cores(
                plan.gpus, Device.CPU)).run(CostedPlan(plan, wide), steps).steps[1:]]))
            rounds = []
            for _ in range(args.rounds):
                scaled, _ = calibrate_for(cost, [(plan, steps)], print)
                result = TorchBackend(options=TorchOptions(lr=1e-4)).run(CostedPlan(plan, replace(wide, cost=scaled)),
                                                                         steps)
                rounds.append((float(np.median([s["graph_s"] for s in result.steps[1:]])),
                               float(np.median(result.extra["predicted_step_time_s"][1:]))))
            measured, calibrated = np.array(rounds).T
            errors = calibrated / measured - 1
            rows.append({"mix": mix, "plan": name, "processes": plan.gpus, "cores": min(plan.gpus, cpu_cores()),
                         "measured_s": float(np.median(measured)), "predicted_s": predicted,
                         "predicted_error": float(np.median(predicted / measured - 1)),
                         "calibrated_s": float(np.median(calibrated)), "calibrated_error": float(np.median(errors)),
                         "calibrated_errors": errors.tolist()})
    print(f"{'mix':<12} {'plan':<34} {'ranks':>5} {'cores':>5} {'measured s':>10} {'predicted s':>11} {'error':>7} "
          f"{'calibrated s':>12} {'error':>7}  {'rounds':>15}")
    for r in rows:
        print(f"{r['mix']:<12} {r['plan']:<34} {r['processes']:>5} {r['cores']:>5} {r['measured_s']:10.3f} "
              f"{r['predicted_s']:11.3f} {r['predicted_error']:+7.1%} {r['calibrated_s']:12.3f} "
              f"{r['calibrated_error']:+7.1%}  {min(r['calibrated_errors']):+.0%} to {max(r['calibrated_errors']):+.0%}")
    for key, title in (("predicted_error", "as recorded"), ("calibrated_error", "calibrated")):
        errors = [abs(r[key]) for r in rows]
        print(f"{title}: median |error| {np.median(errors):.1%}, max {max(errors):.1%} over {len(rows)} plans x mixes "
              f"(per plan the median of {args.rounds} runs of {args.steps} steps after a warm-up; ranks beyond the "
              "cores take turns, predicted so)")
    if args.json:
        Path(args.json).write_text(json.dumps({"foreign": rows}, indent=2))


if __name__ == "__main__":
    main()
