"""A Hugging Face Trainer job with DflopTrainer on a tiny LLaVA-OneVision, run by torchrun (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/hf_trainer_job.py OUT first resume

``first`` trains with a checkpoint every 2 steps and stops after step 3 (past checkpoint-2, whose
step 3 is then lost, as in a killed run); ``resume`` continues from checkpoint-2 with a new model
and a new trainer (in the same processes, which saves starting them twice). Every rank writes
the dataset indices of each microbatch as it trains it (step, rank, indices) to
``OUT/trained-<phase>-<rank>.jsonl``: at training time, not when the loader prefetches it.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # shared with bench_trainer
import tiny_llava  # noqa: E402
from dflop.integrations.collate import PaddedCollator
from dflop.integrations.transformers import DflopTrainer

SAMPLES, SAVE_EVERY, STOP_AFTER = 42, 2, 3


class Indexed(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"index": i, **self.items[i]}


class Recording:
    """The padding collator, with the microbatch's dataset indices kept aside under ``index``."""

    def __init__(self):
        self.inner = PaddedCollator()

    def __call__(self, features):
        index = torch.tensor([f["index"] for f in features])
        return {**self.inner([{k: v for k, v in f.items() if k != "index"} for f in features]), "index": index}


class StopAfter(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


class RecordingTrainer(DflopTrainer):
    def __init__(self, *args, record_to, **kwargs):
        super().__init__(*args, **kwargs)
        self.record_to = record_to

    def training_step(self, model, inputs, num_items_in_batch=None):
        record = {"step": self.state.global_step + 1, "rank": self.args.process_index,
                  "indices": inputs.pop("index").tolist()}
        with self.record_to.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return super().training_step(model, inputs, num_items_in_batch)


def main(out, phase):
    torch.set_num_threads(1)
    model = tiny_llava.tiny_llava(seed=0)  # the same initial weights in every phase: resume loads its own
    items = tiny_llava.dataset(model, SAMPLES, seed=1)
    out.mkdir(parents=True, exist_ok=True)
    profile_path = out / "profile.json"
    args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             num_train_epochs=1, save_strategy="steps", save_steps=SAVE_EVERY, learning_rate=1e-3,
                             use_cpu=True, ddp_backend="gloo", dataloader_drop_last=False, seed=3,
                             remove_unused_columns=False, report_to="none", disable_tqdm=True, logging_strategy="no")
    with args.main_process_first(desc="the data profile"):  # written before any rank reads it
        if args.process_index == 0 and phase == "first":
            tiny_llava.profile(items).save(profile_path)
    log = out / f"trained-{phase}-{args.process_index}.jsonl"
    trainer = RecordingTrainer(model=model, args=args, train_dataset=Indexed(items), data_profile=profile_path,
                               data_collator=Recording(), record_to=log,
                               callbacks=[StopAfter(STOP_AFTER)] if phase == "first" else None)
    trainer.train(resume_from_checkpoint=str(out / "run" / f"checkpoint-{SAVE_EVERY}") if phase == "resume" else None)


if __name__ == "__main__":
    for phase in sys.argv[2:]:
        main(Path(sys.argv[1]), phase)
    # Left to interpreter exit, gloo's threads may be torn down mid-use: "terminate called without
    # an active exception", SIGABRT, a failed launch after a successful run.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
