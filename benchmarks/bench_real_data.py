"""What training on real samples costs next to synthetic inputs of the same shapes (torch, CPU).

Run: .venv/bin/python benchmarks/bench_real_data.py
The README's tiny LLaVA-OneVision (examples/llava_checkpoint.py: PNG and JPEG images, an MPEG-4
video, text) trains on 2 CPU processes under one plan and the same scheduled steps in three
arms, interleaved round by round: its real samples (images and video decoded, tokenized by its
chat template), synthetic inputs of exactly those shapes (token ids and pixels drawn from each
sample's id), and the real samples decoded ahead (``execution.decode_workers: 1``: each step's
images and video decoded by a DataLoader worker process of each rank while the steps before
run). Each step's time is the measured step (step graph and optimizer); the inputs' time is what
the rank spent making them before the step (decoding included, or waiting for the worker's);
the decoding's time is what it took where it ran. Ratios are of two arms measured in this run.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

ARMS = ("synthetic", "real", "real, decode_workers 1")


def main() -> None:
    from report import Results, arguments

    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of every arm (the first a warm-up)")
    parser.add_argument("--steps", type=int, default=12, help="steps a run (its first not counted)")
    args = parser.parse_args()
    rounds, steps = (2, 3) if args.quick else (args.rounds, args.steps)
    command = "python benchmarks/bench_real_data.py" + (" --quick" if args.quick else "")
    results = Results("bench_real_data", command)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        measured = measure(Path(folder), rounds, steps)
    counted = range(1 if rounds > 1 else 0, rounds)
    rows = []
    for arm in ARMS:
        step = np.array([[s["step_s"] for s in measured[arm][r][1:]] for r in counted])
        inputs = np.array([[s["inputs_s"] for s in measured[arm][r][1:]] for r in counted])
        decode = np.array([[s["decode_s"] for s in measured[arm][r][1:]] for r in counted])
        ratio = [np.median(step[k]) / np.median(np.array([s["step_s"] for s in measured["synthetic"][r][1:]]))
                 for k, r in enumerate(counted)]
        rows.append([arm, round(1e3 * float(np.median(step)), 2), round(1e3 * float(np.median(inputs)), 2),
                     round(1e3 * float(np.median(decode)), 2),
                     "-" if arm == "synthetic" else f"{np.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}]"])
    results.table(["arm", "step ms (median)", "inputs ms a step (median)", "decoding ms a step (median)",
                   "step vs synthetic [range over rounds]"],
                  rows, title=f"tiny LLaVA-OneVision, colocated dp2 on 2 CPU processes, global batch 4, {steps} steps "
                              f"a run, {len(counted)} counted round(s)")
    results.note("Same plan, same scheduled steps and same shapes in every arm: the inputs' content differs, and "
                 "with it the image layout the encoder computes (real samples: LLaVA-OneVision's pack_image_features "
                 "and video pooling, a few small ops per image; synthetic: one gather), work the step graph's cost "
                 "model does not price. Making the inputs is outside the measured step; with decode_workers the "
                 "decoding moves off the rank's critical path into a worker process (without, it runs in the rank, "
                 "within the inputs' time), which on CPU shares the cores with the ranks: it can take the step's "
                 "time, and its own decoding takes longer (decode_workers is 2 by default on GPUs, 0 on CPU).")
    results.note(f"Whole run {time.perf_counter() - start:.0f} s, building the checkpoint and launching every run "
                 "included.")
    results.save(args.json)


def measure(folder: Path, rounds: int, steps: int) -> dict[str, list[list[dict]]]:
    """Per arm, per round: the run's per-step records (step_s, inputs_s, ...)."""
    import llava_checkpoint
    import yaml

    from dflop.backends import ScheduledBatch
    from dflop.backends.torch_runtime.backend import TorchBackend
    from dflop.backends.torch_runtime.worker import TorchOptions
    from dflop.jobs.setup import setup
    from dflop.schedule.step import bin_batch, plan_costs
    from dflop.specs import ModulePlan, Plan
    from dflop.timing.steps import CostedPlan
    from dflop.workload import batches

    llava_checkpoint.build(folder)
    config = folder / "run.yaml"
    config.write_text(yaml.safe_dump({**llava_checkpoint.RUN, "steps": steps}))
    s = setup(config, backend="torch", log=lambda _: None)
    plan = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated", microbatches=1)
    stream = batches(s.data, s.system.training.global_batch, seed=1)
    scheduled = [ScheduledBatch(b, bin_batch(b, plan, s.system, costs=plan_costs(b, plan, s.system.model,
                                                                               s.system.cost)).assignment)
                 for b in (next(stream) for _ in range(steps))]
    options = TorchOptions(weights=str(folder), lr=1e-3, calibrate=False)
    backends = {"synthetic": TorchBackend(options=options, predict=False),
                "real": TorchBackend(options=options, predict=False, dataset=str(folder / "data.jsonl")),
                "real, decode_workers 1": TorchBackend(options=replace(options, decode_workers=1), predict=False,
                                                       dataset=str(folder / "data.jsonl"))}
    out: dict[str, list[list[dict]]] = {arm: [] for arm in ARMS}
    for _ in range(rounds):
        for arm in ARMS:
            out[arm].append(backends[arm].run(CostedPlan(plan, s.system), scheduled).steps)
    return out


if __name__ == "__main__":
    main()
