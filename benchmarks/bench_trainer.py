"""bench_trainer: dflop's bins inside the Hugging Face Trainer, against the samplers its users run today.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_trainer.py [--rounds 5] [--quick] [--json PATH]

The Hugging Face Trainer on 2 CPU processes (torchrun, gloo, one thread each) trains a tiny
LLaVA-OneVision built by transformers (tiny_llava.py, the model the tests check) on samples shaped
by the video-heavy mix, scaled down: every length divided by ``SCALE`` (text tokens, and image
tokens as a number of the tiny model's images; relative lengths kept). Each arm trains one epoch
of the same samples, with the same initial weights, global batch and accumulation:

- ``default``: the Trainer's random sampler, padded microbatches of per_device_train_batch_size;
- ``group_by_length``: the Trainer's LengthGroupedSampler, padded;
- ``token-budget``: the epoch in arrival order cut into microbatches of up to a token budget
  (per_device_train_batch_size x the mean sample length; a longer sample alone), dealt to the
  ranks in turn, packed (PackedCollator); a last partial step is dropped;
- ``dflop padded`` / ``dflop packed``: DflopTrainer with the PaddedCollator / the PackedCollator.

All arms run in ONE launch on the same processes, interleaved: round r trains every arm once,
then round r+1, so that drift hits every arm alike; the first round is a warm-up when there are
several, and within a run the first optimizer step is not counted. Steps/s and samples/s are over
the counted steps; the ratios compare dflop's samples/s with each arm's, over all counted rounds,
with the range of the per-round ratios: "(none)" where that range holds 1 (no gain measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ARMS = ("default", "group_by_length", "token-budget", "dflop padded", "dflop packed")
DFLOP = ("dflop padded", "dflop packed")
SCALE = 32
"""Real tokens per tiny token: a 32-frame video (6720 image tokens) becomes 42 tiny images."""
WORLD, PER_DEVICE, ACCUMULATION = 2, 4, 2


# ---- the workload (in the ranks) ----------------------------------------------------------------

def scaled_items(model, samples: int, seed: int):
    """Items shaped by the video-heavy mix with lengths / SCALE: text tokens, and image tokens as
    the tiny model's images (one tile each; a frame group of a video is an image too)."""
    import tiny_llava
    from dflop.specs import presets
    from dflop.workload import profile_mix

    table = profile_mix("video-heavy", samples, presets.encoder("siglip-so400m"), seed=seed).samples
    per_image = {k: tiny_llava.image_tokens(model, k) for k in (1, 2)}
    rng = np.random.default_rng(seed)
    items = []
    for text, image in zip(table.text_tokens, table.image_tokens):
        images = int(round(image / SCALE / per_image[2])) if image else 0
        images = max(images, 1) if image else 0
        items.append(tiny_llava.sample(rng, max(2, int(round(text / SCALE))), images, per_image[min(max(images, 1), 2)]))
    return items


def token_budget_bins(lengths, *, budget: int, world: int, rank: int, accumulation: int, seed: int):
    """Rank ``rank``'s microbatches: a seeded random arrival order cut into runs of up to
    ``budget`` tokens (a longer sample alone), the runs dealt to the ranks in turn, whole steps only."""
    runs, run, total = [], [], 0
    for i in np.random.default_rng(seed).permutation(len(lengths)).tolist():
        if run and total + lengths[i] > budget:
            runs.append(run)
            run, total = [], 0
        run.append(i)
        total += lengths[i]
    runs.append(run)
    keep = len(runs) - len(runs) % (world * accumulation)
    return runs[:keep][rank::world]


def samples_in(inputs) -> int:
    """Samples in a collated microbatch: rows when padded, restarts of the position ids when packed."""
    if "position_ids" in inputs:
        return int((inputs["position_ids"] == 0).sum())
    return int(inputs["input_ids"].shape[0])


def run_arm(arm: str, items, profile, out: Path, seed: int):
    """Train one epoch of ``items`` under ``arm``; (time, samples) at the end of every step."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import tiny_llava
    from dflop.integrations.collate import PackedCollator, PaddedCollator
    from dflop.integrations.transformers import DflopTrainer, per_rank_loader

    marks, pending = [], [0]

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.perf_counter(), pending[0]))
            pending[0] = 0

    class Counted:
        def training_step(self, model, inputs, num_items_in_batch=None):
            pending[0] += samples_in(inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    class TokenBudget(Counted, Trainer):
        def get_train_dataloader(self):
            lengths = [len(item["input_ids"]) for item in items]
            bins = token_budget_bins(lengths, budget=PER_DEVICE * int(np.mean(lengths)), world=self.args.world_size,
                                     rank=self.args.process_index, accumulation=self.args.gradient_accumulation_steps,
                                     seed=self.args.seed)
            return per_rank_loader(items, bins, self.data_collator, self.args, self.accelerator)

    class Dflop(Counted, DflopTrainer):
        pass

    class Plain(Counted, Trainer):
        pass

    args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=PER_DEVICE,
                             gradient_accumulation_steps=ACCUMULATION, num_train_epochs=1, learning_rate=1e-4,
                             use_cpu=True, ddp_backend="gloo", seed=seed, save_strategy="no", report_to="none",
                             disable_tqdm=True, logging_strategy="no", remove_unused_columns=False,
                             train_sampling_strategy="group_by_length" if arm == "group_by_length" else "random")
    common = dict(model=tiny_llava.tiny_llava(seed=0), args=args, train_dataset=items, callbacks=[Clock()])
    if arm in DFLOP:
        trainer = Dflop(**common, data_profile=profile,
                        data_collator=PackedCollator() if arm == "dflop packed" else PaddedCollator())
    elif arm == "token-budget":
        trainer = TokenBudget(**common, data_collator=PackedCollator())
    else:
        trainer = Plain(**common, data_collator=PaddedCollator())
    torch.distributed.barrier()  # every arm starts with both ranks ready
    trainer.train()
    return marks


def worker(out: Path, rounds: int, samples: int) -> None:
    """One rank: every round trains every arm; this rank's step marks go to ``out/rank-<r>.json``."""
    import torch

    import tiny_llava

    torch.set_num_threads(1)
    items = scaled_items(tiny_llava.tiny_llava(seed=0), samples, seed=0)
    profile = tiny_llava.profile(items)
    marks = {arm: [] for arm in ARMS}
    for r in range(rounds):
        for arm in ARMS:
            marks[arm].append(run_arm(arm, items, profile, out, seed=r))
    rank = torch.distributed.get_rank()
    lengths = [len(item["input_ids"]) for item in items]
    (out / f"rank-{rank}.json").write_text(json.dumps({"marks": marks, "lengths": lengths,
                                                       "images": [len(i.get("image_sizes", [])) for i in items]}))
    torch.distributed.barrier()  # gloo torn down at interpreter exit instead may abort a finished rank
    torch.distributed.destroy_process_group()


# ---- the driver -----------------------------------------------------------------------------------

def launch(out: Path, rounds: int, samples: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
               str(Path(__file__).resolve()), "--worker", str(out), "--rounds", str(rounds), "--samples", str(samples)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode:
        sys.exit(f"bench_trainer: the 2-process Trainer run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]


def rates(ranks: list[dict], arm: str, counted: range) -> tuple[np.ndarray, np.ndarray, int]:
    """Per counted round: steps/s and samples/s after the first step (rank 0's clock, both ranks'
    samples); and the steps an epoch took."""
    steps, samples = [], []
    for r in counted:
        clock = ranks[0]["marks"][arm][r]
        per_step = np.sum([[n for _, n in rank["marks"][arm][r]] for rank in ranks], axis=0)
        seconds = clock[-1][0] - clock[0][0]
        steps.append((len(clock) - 1) / seconds)
        samples.append(per_step[1:].sum() / seconds)
    return np.array(steps), np.array(samples), len(ranks[0]["marks"][arm][counted[0]])


def verdict(per_round: np.ndarray, total: float) -> str:
    lo, hi = per_round.min(), per_round.max()
    word = " (none)" if lo <= 1.0 <= hi else " (slower)" if hi < 1.0 else ""
    return f"{total:.2f}x [{lo:.2f}-{hi:.2f}]{word}"


def main() -> None:
    from report import Results, arguments

    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every arm (the first a warm-up)")
    parser.add_argument("--samples", type=int, default=160, help="samples in the epoch every arm trains")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a rank of the launch
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.rounds, args.samples)
    rounds, samples = (1, 3 * WORLD * PER_DEVICE * ACCUMULATION) if args.quick else (args.rounds, args.samples)
    command = "python benchmarks/bench_trainer.py" + (" --quick" if args.quick else "")
    results = Results("bench_trainer", command)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        ranks = launch(Path(folder), rounds, samples)
    counted = range(1 if rounds > 1 else 0, rounds)
    measured = {arm: rates(ranks, arm, counted) for arm in ARMS}
    lengths, images = np.array(ranks[0]["lengths"]), np.array(ranks[0]["images"])
    rows = []
    for arm in ARMS:
        steps, per_s, epoch = measured[arm]
        ratios = [("-" if arm == d else verdict(measured[d][1] / per_s, measured[d][1].mean() / per_s.mean()))
                  for d in DFLOP]
        rows.append([arm, epoch, round(float(steps.mean()), 3), round(float(per_s.mean()), 2), *ratios])
    results.table(["arm", "steps/epoch", "steps/s", "samples/s", "dflop padded vs arm", "dflop packed vs arm"], rows,
                  title=f"Hugging Face Trainer, tiny LLaVA-OneVision, 2 CPU processes, {samples} samples an epoch, "
                        f"{len(counted)} counted round(s)")
    results.note(f"Samples: the video-heavy mix (dflop.workload.profile_mix) scaled by 1/{SCALE}: LLM tokens "
                 f"{int(lengths.min())}-{int(lengths.max())} (mean {lengths.mean():.0f}), {int((images == 0).sum())} "
                 f"text-only, {int((images > 0).sum())} with 1-{int(images.max())} images. Videos are given as "
                 "images standing in for frame groups (one 1-tile image each), not as LLaVA-OneVision video input: "
                 "dflop's collators batch images only.")
    results.note(f"Global batch {WORLD} ranks x {ACCUMULATION} accumulation x {PER_DEVICE} per device; "
                 "token-budget's microbatches hold up to per_device x the mean length in tokens, so its steps "
                 "hold a varying number of samples: compare samples/s. The ratios are dflop's samples/s over the "
                 "arm's (equal to the steps/s ratio where steps hold the same samples), over the counted rounds, "
                 "with the per-round range; (none): the range holds 1, no gain measured; (slower): dflop lost.")
    results.note(f"Whole run {time.perf_counter() - start:.0f} s, including the launch and building every "
                 "arm's Trainer; the figures count training steps only.")
    results.save(args.json)


if __name__ == "__main__":
    main()
