"""dflop's bins inside the Hugging Face Trainer: the padded cost, the collators, DflopTrainer and a
2-process Trainer job that trains every sample of an epoch exactly once across a mid-epoch resume."""

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Sampler
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # tiny_llava, shared with the bench
import hf_trainer_job  # noqa: E402
import tiny_llava  # noqa: E402
from dflop.errors import DflopError
from dflop.integrations.collate import PackedCollator, PaddedCollator
from dflop.integrations.transformers import (CHECKPOINT_FILE, DflopLoaderMixin, DflopTrainer, bin_cost_of,
                                             save_sampler_state,
                                             trainer_sampler)
from dflop.schedule.padded import BinCost, padded_loads, padded_partition
from dflop.schedule.sampler import BalancedBatchSampler
from dflop.specs import presets
from dflop.workload import profile_mix
from dflop.workload.data_profile import DataProfile

SHAPES = profile_mix("llava-ov", 160, presets.encoder("siglip-so400m"), seed=2)
JOB = Path(__file__).parent / "hf_trainer_job.py"
BENCH = Path(__file__).parents[1] / "benchmarks" / "bench_trainer.py"


def profile_of(size):
    return DataProfile(SHAPES.samples.take(np.arange(size)))


# ---- the padded cost ----

def equal_count_max(lengths, bins):
    """group_by_length's microbatches: the longest-first order cut into equal counts."""
    ordered = np.sort(np.asarray(lengths))[::-1]
    return max(len(chunk) * int(chunk[0]) for chunk in np.array_split(ordered, bins))


@settings(max_examples=80)
@given(lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=200), data=st.data())
def test_padded_bins_hold_every_sample_once_and_beat_equal_count_chunks(lengths, data):
    bins = data.draw(st.integers(1, len(lengths)))
    assignment = padded_partition(np.array(lengths), bins)
    assert assignment.shape == (len(lengths),) and set(assignment.tolist()) == set(range(bins))  # none empty
    loads = padded_loads(np.array(lengths), assignment, bins)
    assert loads.max() <= equal_count_max(lengths, bins)
    assert loads.max() >= max(max(lengths), -(-sum(lengths) // bins))  # no split does better than either
    assert np.array_equal(padded_partition(np.array(lengths), bins), assignment)  # deterministic


@settings(max_examples=60)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=8), data=st.data())
def test_padded_bins_are_the_best_contiguous_runs_of_the_sorted_order(lengths, data):
    bins = data.draw(st.integers(1, len(lengths)))
    ordered = sorted(lengths, reverse=True)
    best = min(max((b - a) * ordered[a] for a, b in zip((0, *cuts), (*cuts, len(ordered))))
               for cuts in combinations(range(1, len(ordered)), bins - 1))
    assert padded_loads(np.array(lengths), padded_partition(np.array(lengths), bins), bins).max() == best


@pytest.mark.parametrize("lengths,bins,message", [
    ([3, 1], 3, "bins: expected a whole number from 1 to the 2 samples, got 3"),
    ([3, 1], 0, "bins: expected a whole number from 1 to the 2 samples, got 0"),
    ([3.5, 1], 1, "lengths: expected a flat list of whole token counts >= 0"),
    ([3, -1], 1, "lengths: expected a flat list of whole token counts >= 0"),
])
def test_padded_partition_bad_input(lengths, bins, message):
    with pytest.raises(DflopError, match=message):
        padded_partition(np.array(lengths), bins)


def test_the_sampler_balances_padded_cost_when_told():
    table = SHAPES.samples
    make = lambda cost: BalancedBatchSampler(SHAPES, global_batch=64, dp_size=2, dp_rank=0, microbatches=4,
                                             bin_cost=cost)
    padded, packed = make("PADDED"), make(BinCost.PACKED)
    indices = next(padded.global_batches())
    worst = lambda sampler: max(len(m) * int(table.llm_tokens[m].max())
                                for rank in sampler.bins(indices) for m in rank)
    expected = padded_loads(table.llm_tokens[indices], padded_partition(table.llm_tokens[indices], 8), 8).max()
    assert worst(padded) == expected < worst(packed)
    with pytest.raises(DflopError, match=r"bin_cost: unknown bin cost 'tokens' \(valid: packed, padded\)"):
        make("tokens")


# ---- the sampler as the Trainer drives it ----

@settings(max_examples=40)
@given(world=st.integers(1, 8), accumulation=st.integers(1, 4), per_device=st.integers(1, 4),
       drop_last=st.booleans(), size=st.integers(1, 150), epoch=st.integers(0, 1),
       cost=st.sampled_from(list(BinCost)), data=st.data())
def test_every_sample_once_per_epoch_across_ranks_and_a_resume(world, accumulation, per_device, drop_last, size,
                                                               epoch, cost, data):
    profile, batch = profile_of(size), world * accumulation * per_device

    def samplers():
        out = [trainer_sampler(profile, world_size=world, rank=r, accumulation=accumulation,
                               per_device_batch=per_device, drop_last=drop_last, seed=5, bin_cost=cost)
               for r in range(world)]
        for s in out:
            s.set_epoch(epoch)
        return out

    tail = 0 if drop_last else size % batch
    if drop_last and size < batch or 0 < tail < world:
        with pytest.raises(DflopError, match="fewer than one global batch|fewer than the"):
            samplers()
        return
    streams = [list(s) for s in samplers()]
    length = len(streams[0])
    assert all(len(stream) == length for stream in streams)  # every rank steps alike
    steps = length // accumulation + (length % accumulation > 0)  # as the Trainer counts optimizer steps
    for step in range(steps):
        per_rank = [stream[step * accumulation:(step + 1) * accumulation] for stream in streams]
        expected = accumulation if step < size // batch else min(accumulation, tail // world)
        assert all(len(mine) == expected and all(mine) for mine in per_rank)  # no rank idles a microbatch
    # A resume after k optimizer steps: new samplers; the Trainer skips k x accumulation microbatches.
    k = data.draw(st.integers(0, steps))
    resumed = [list(s)[k * accumulation:] for s in samplers()]
    assert resumed == [stream[k * accumulation:] for stream in streams]  # the same sequence: the skip is right
    trained = [i for stream, after in zip(streams, resumed) for m in stream[:k * accumulation] + after for i in m]
    order = np.random.default_rng((5, epoch)).permutation(size)
    assert sorted(trained) == sorted(order[:size - (size % batch if drop_last else 0)].tolist())


def test_sampler_state_names_what_changed():
    a = trainer_sampler(profile_of(40), world_size=2, rank=0, accumulation=2, per_device_batch=2, drop_last=True,
                        seed=1)
    b = trainer_sampler(profile_of(40), world_size=2, rank=1, accumulation=2, per_device_batch=2, drop_last=True,
                        seed=1)
    c = trainer_sampler(profile_of(39), world_size=1, rank=0, accumulation=2, per_device_batch=4, drop_last=True,
                        seed=1)
    a.set_epoch(3)
    assert b.differences(a.state()) == {}  # the rank and the epoch are not what fixes the bins
    assert set(c.differences(a.state())) == {"dp_size", "samples", "shapes"}


# ---- the collators ----

def weighted_loss(model, features):
    """The loss of each sample alone, weighted by its predicted tokens: what one batch should give."""
    total = count = 0
    for f in features:
        extra = {k: f[k] for k in ("pixel_values", "image_sizes") if k in f}
        if len(f.get("image_sizes", [])) > 1:
            extra["batch_num_images"] = torch.tensor([len(f["image_sizes"])])
        out = model(input_ids=f["input_ids"][None], labels=f["labels"][None], use_cache=False, **extra)
        n = int((f["labels"][1:] != -100).sum())
        total, count = total + out.loss.item() * n, count + n
    return total / count


@pytest.mark.parametrize("collator", [PackedCollator(), PaddedCollator(pad_token_id=5)])
def test_a_collated_microbatch_has_the_per_sample_loss_on_qwen2(collator):
    model = tiny_llava.tiny_qwen2().train()  # training mode: where a model would make itself a cache
    rng = np.random.default_rng(0)
    features = [{"input_ids": torch.as_tensor(rng.integers(0, 60, n))} for n in (5, 17, 2, 9)]
    features = [{**f, "labels": f["input_ids"].clone()} for f in features]
    loss = model(**collator(features)).loss.item()
    assert loss == pytest.approx(weighted_loss(model, features), abs=1e-5)


@pytest.mark.parametrize("collator", [PackedCollator(), PaddedCollator()])
def test_a_collated_llava_onevision_microbatch_has_the_per_sample_loss(collator):
    model = tiny_llava.tiny_llava().train()
    rng, per_image = np.random.default_rng(1), tiny_llava.image_tokens(model)
    features = [tiny_llava.sample(rng, 7, 1, per_image), tiny_llava.sample(rng, 4, 0, per_image),
                tiny_llava.sample(rng, 5, 2, tiny_llava.image_tokens(model, 2)),
                tiny_llava.sample(rng, 9, 1, per_image)]
    batch = collator(features)
    assert batch["pixel_values"].shape[:2] == (4, tiny_llava.TILES)  # images in order, tiles padded to the most
    assert batch["batch_num_images"].tolist() == [1, 0, 2, 1]
    assert model(**batch).loss.item() == pytest.approx(weighted_loss(model, features), abs=1e-5)


def test_collators_leave_the_dataset_items_alone():
    item = {"input_ids": torch.tensor([4, 5, 6])}
    PackedCollator()([item])
    assert item["input_ids"].tolist() == [4, 5, 6] and "labels" not in item


@pytest.mark.parametrize("features,message", [
    ([], "microbatch: no samples to collate"),
    ([{"input_ids": [1, 2], "index": 3}], "microbatch sample 0: key 'index' is not one the collator batches"),
    ([{"labels": [1, 2]}], "microbatch sample 0: no 'input_ids'"),
    ([{"input_ids": [1, 2], "labels": [1]}], r"'labels' as long, got shapes \(2,\) and \(1,\)"),
    ([{"input_ids": []}], "'input_ids' must be a non-empty 1-D sequence"),
    ([{"input_ids": ["a"]}], "microbatch sample 0: 'input_ids' is not a tensor of numbers"),
    ([{"input_ids": [1, 2], "attention_mask": [1, 0]}], "'attention_mask' has zeros"),
    ([{"input_ids": [1], "pixel_values": torch.zeros(1, 1, 3, 2, 2)}], "'pixel_values' and 'image_sizes' go together"),
    ([{"input_ids": [1], "pixel_values": torch.zeros(1, 3, 2, 2), "image_sizes": [[2, 2]]}],
     r"expected 'pixel_values' \(images, patches, channels, height, width\)"),
])
@pytest.mark.parametrize("collator", [PackedCollator(), PaddedCollator()])
def test_collators_name_what_is_wrong(collator, features, message):
    with pytest.raises(DflopError, match=message):
        collator(features)


def test_the_collator_decides_the_bin_cost():
    assert bin_cost_of(PackedCollator()) is bin_cost_of(DataCollatorWithFlattening()) is BinCost.PACKED
    assert bin_cost_of(PaddedCollator()) is bin_cost_of(lambda features: features) is BinCost.PADDED


# ---- DflopTrainer in this process (one rank) ----

@pytest.fixture(scope="module")
def llava():
    model = tiny_llava.tiny_llava()
    return model, tiny_llava.dataset(model, 24, seed=3)


def trainer(tmp_path, llava, **kwargs):
    model, items = llava
    options = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "use_cpu": True,
               "report_to": "none", "seed": 4, **kwargs.pop("args", {})}
    args = TrainingArguments(output_dir=str(tmp_path / "run"), **options)
    return DflopTrainer(model=model, args=args, train_dataset=items,
                        data_profile=kwargs.pop("data_profile", tiny_llava.profile(items)), **kwargs)


def test_the_train_loader_yields_the_samplers_microbatches_as_batches(tmp_path, llava):
    t = trainer(tmp_path, llava, args={"per_device_train_batch_size": 4})
    assert isinstance(t.data_collator, PaddedCollator) and t.bin_cost is BinCost.PADDED
    loader = t.get_train_dataloader()
    bins = list(t.sampler_checkpoint.sampler)
    assert len(loader) == len(bins) == 6 and len({len(b) for b in bins}) > 1  # a variable number of samples
    assert [int(batch["attention_mask"].sum()) for batch in loader] == [
        sum(len(llava[1][i]["input_ids"]) for i in b) for b in bins]
    assert trainer(tmp_path, llava, data_collator=PackedCollator()).bin_cost is BinCost.PACKED


def test_a_checkpoint_of_other_bins_is_refused_before_training(tmp_path, llava):
    model, items = llava
    folder = tmp_path / "run" / "checkpoint-2"
    folder.mkdir(parents=True)
    t = trainer(tmp_path, llava)
    with pytest.raises(DflopError, match=f"{folder}: has no {CHECKPOINT_FILE}"):
        t.train(resume_from_checkpoint=True)  # the last checkpoint, as the Trainer finds it
    save_sampler_state(trainer_sampler(tiny_llava.profile(items), world_size=2, rank=0, accumulation=2,
                                       per_device_batch=1, drop_last=False, seed=4, bin_cost="packed"), folder)
    with pytest.raises(DflopError, match=f"{folder}: saved by a run with other bins \\(world size 2 -> 1, "
                                         "bin cost packed -> padded\\)"):
        t.train(resume_from_checkpoint=str(folder))
    (folder / CHECKPOINT_FILE).write_text("[1, 2]")
    with pytest.raises(DflopError, match=f"{folder / CHECKPOINT_FILE}: not a dflop sampler state"):
        t.train(resume_from_checkpoint=str(folder))
    assert t.state.global_step == 0 and not (tmp_path / "run" / "checkpoint-1").exists()


def test_a_resume_in_the_second_epoch_continues_that_epochs_order(tmp_path, llava):
    model, items = llava
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, num_train_epochs=2, save_strategy="steps", save_steps=8,
                             use_cpu=True, report_to="none", disable_tqdm=True, seed=4, remove_unused_columns=False)

    def run(log, **kwargs):
        torch.manual_seed(0)
        t = hf_trainer_job.RecordingTrainer(model=tiny_llava.tiny_llava(), args=args,
                                            train_dataset=hf_trainer_job.Indexed(items),
                                            data_profile=tiny_llava.profile(items),
                                            data_collator=hf_trainer_job.Recording(), record_to=tmp_path / log,
                                            callbacks=kwargs.pop("callbacks", None))
        t.train(**kwargs)
        return [json.loads(line) for line in (tmp_path / log).read_text().splitlines()]

    first = run("first.jsonl", callbacks=[hf_trainer_job.StopAfter(9)])  # 6 steps an epoch: stops in the second
    resumed = run("resumed.jsonl", resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-8"))
    epoch = lambda records, steps: sorted(i for r in records if r["step"] in steps for i in r["indices"])
    assert [r for r in first if r["step"] == 9] == [r for r in resumed if r["step"] == 9]
    assert sorted(epoch(first, {7, 8}) + epoch(resumed, range(9, 13))) == list(range(24))
    firsts = [r["indices"] for r in first if r["step"] == 1], [r["indices"] for r in first if r["step"] == 7]
    assert firsts[0] != firsts[1]  # the second epoch has an order of its own


def test_bad_trainer_input_is_named(tmp_path, llava):
    model, items = llava
    missing = tmp_path / "nowhere.json"
    with pytest.raises(DflopError, match=f"{missing}: file not found"):
        trainer(tmp_path, llava, data_profile=str(missing))
    short = tmp_path / "short.json"
    tiny_llava.profile(items[:20]).save(short)
    with pytest.raises(DflopError, match=f"{short}: describes 20 samples but train_dataset has 24"):
        trainer(tmp_path, llava, data_profile=short)
    with pytest.raises(DflopError, match="data_profile: expected a DataProfile or its path, got list"):
        trainer(tmp_path, llava, data_profile=[1])
    with pytest.raises(DflopError, match="accelerator_config.dispatch_batches: dflop's sampler gives every rank"):
        trainer(tmp_path, llava, args={"accelerator_config": {"dispatch_batches": True}})
    with pytest.raises(DflopError, match="bin_cost: unknown bin cost 'sum'"):
        trainer(tmp_path, llava, bin_cost="sum")
    with pytest.raises(DflopError, match="has 24 samples, fewer than one global batch"):
        trainer(tmp_path, llava, args={"per_device_train_batch_size": 16, "dataloader_drop_last": True})


# ---- the LLaVA-NeXT recipe ----

@dataclass
class LLaVAArguments(TrainingArguments):
    """LLaVA-NeXT's training arguments, the fields its trainer's hooks read."""
    group_by_modality_length: bool = False
    mm_projector_lr: float | None = None
    save_only_adapter: bool = False  # stands for their should_only_save_mm_adapter(args)


class LLaVADataset(torch.utils.data.Dataset):
    """LLaVA-NeXT's LazySupervisedDataset as its trainer sees it: items and ``modality_lengths``
    (the length, negative for a text-only sample)."""

    def __init__(self, items):
        self.items = items
        self.modality_lengths = [len(i["input_ids"]) * (1 if "pixel_values" in i else -1) for i in items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class ModalityGrouped(Sampler):
    """What LLaVA-NeXT's LengthGroupedSampler(group_by_modality=True) gives: indices in which every
    run of ``batch_size`` holds one modality (here without its length sorting)."""

    def __init__(self, batch_size, world_size, lengths):
        self.batch_size, self.world_size, self.lengths = batch_size, world_size, lengths

    def __len__(self):
        return len(self.lengths)

    def __iter__(self):
        chunks = [c for sign in (1, -1) for group in [[i for i, n in enumerate(self.lengths) if n * sign > 0]]
                  for c in np.array_split(group, max(1, len(group) // self.batch_size))]
        return iter(int(i) for c in chunks for i in c)


class LLaVATrainer(Trainer):
    """A stand-in for LLaVA-NeXT's LLaVATrainer (llava/train/llava_trainer.py at df17966) with the
    hooks the recipe meets: the same `_get_train_sampler` branch, its own `get_train_dataloader`,
    `create_optimizer` with a projector learning rate and the adapter-only `_save_checkpoint`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def _get_train_sampler(self, train_dataset=None):
        if self.args.group_by_modality_length:
            return ModalityGrouped(self.args.train_batch_size,
                                   self.args.world_size * self.args.gradient_accumulation_steps,
                                   self.train_dataset.modality_lengths)
        return super()._get_train_sampler(train_dataset)

    def get_train_dataloader(self):
        collator = self._get_collator_with_removed_columns(self.data_collator, description="training")
        return self.accelerator.prepare(DataLoader(self.train_dataset, batch_size=self._train_batch_size,
                                                   collate_fn=collator, sampler=self._get_train_sampler(),
                                                   drop_last=self.args.dataloader_drop_last))

    def create_optimizer(self):
        if self.optimizer is None:
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if "projector" not in n]},
                      {"params": [p for n, p in named if "projector" in n], "lr": self.args.mm_projector_lr}]
            self.optimizer = torch.optim.AdamW(groups, lr=self.args.learning_rate)
        return self.optimizer

    def _save_checkpoint(self, model, trial):
        if not self.args.save_only_adapter:
            return super()._save_checkpoint(model, trial)
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        projector = {n: p for n, p in self.model.named_parameters() if "projector" in n}
        torch.save(projector, folder / "mm_projector.bin")


class DflopLLaVATrainer(DflopLoaderMixin, LLaVATrainer):  # the recipe (docs/guide/trainers.md, LLaVA-NeXT)
    """LLaVATrainer with dflop's bins in place of group_by_modality_length."""


def llava_args(tmp_path, **options):
    return LLaVAArguments(output_dir=str(tmp_path / "run"), **{
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "use_cpu": True, "report_to": "none",
        "seed": 4, "group_by_modality_length": True, "remove_unused_columns": False, "disable_tqdm": True,
        "mm_projector_lr": 1e-2, **options})


def test_the_llava_next_recipe_trains_dflops_bins_in_place_of_group_by_modality_length(tmp_path, llava):
    model, items = llava
    data, args = LLaVADataset(items), llava_args(tmp_path)
    ids = lambda loader: [batch["input_ids"].tolist() for batch in loader]
    theirs = LLaVATrainer(model=model, args=args, train_dataset=data, data_collator=PaddedCollator())
    assert {len(b) for b in ids(theirs.get_train_dataloader())} == {4}  # the stand-in's own path: fixed size
    recipe = DflopLLaVATrainer(model=model, args=args, train_dataset=data, data_collator=PaddedCollator(),
                               data_profile=tiny_llava.profile(items))
    dflop = DflopTrainer(model=model, args=args, train_dataset=data, data_profile=tiny_llava.profile(items))
    bins = ids(recipe.get_train_dataloader())
    assert bins == ids(dflop.get_train_dataloader())  # dflop's bins, as DflopTrainer gives them
    assert len({len(b) for b in bins}) > 1  # a variable number of samples: no sampler alone could give that


def test_the_llava_next_recipe_keeps_their_optimizer_and_checkpoints_the_bins(tmp_path, llava):
    model, items = llava
    args = llava_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, save_only_adapter=True,
                      logging_strategy="no")
    recipe = DflopLLaVATrainer(model=tiny_llava.tiny_llava(), args=args, train_dataset=LLaVADataset(items),
                               data_collator=PaddedCollator(), data_profile=tiny_llava.profile(items))
    recipe.train()
    assert recipe.optimizer.param_groups[1]["initial_lr"] == 1e-2  # their optimizer, with its projector group
    folder = tmp_path / "run" / "checkpoint-2"
    assert sorted(p.name for p in folder.iterdir()) == [CHECKPOINT_FILE, "mm_projector.bin"]
    other = DflopLLaVATrainer(model=tiny_llava.tiny_llava(), args=llava_args(tmp_path, gradient_accumulation_steps=1),
                              train_dataset=LLaVADataset(items), data_collator=PaddedCollator(),
                              data_profile=tiny_llava.profile(items))
    with pytest.raises(DflopError, match=f"{folder}: saved by a run with other bins \\(gradient_accumulation_steps"):
        other.train(resume_from_checkpoint=True)


# ---- a real 2-process Trainer job ----

@pytest.mark.processes
def test_two_ranks_train_every_sample_once_across_a_mid_epoch_resume(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(JOB), str(tmp_path), "first", "resume"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def records(phase):
        return [json.loads(line) for rank in (0, 1)
                for line in (tmp_path / f"trained-{phase}-{rank}.jsonl").read_text().splitlines()]

    first, resumed = records("first"), records("resume")
    saved = json.loads((tmp_path / "run" / "checkpoint-2" / CHECKPOINT_FILE).read_text())
    assert (saved["dp_size"], saved["microbatches"], saved["global_batch"]) == (2, 2, 8)
    assert {r["step"] for r in first} == {1, 2, 3} and {r["step"] for r in resumed} == {3, 4, 5, 6}
    lost = [r for r in first if r["step"] == 3]  # trained after checkpoint-2, before the stop: not saved
    assert lost == [r for r in resumed if r["step"] == 3]  # the resumed run trains those same microbatches
    trained = [i for r in first if r["step"] <= 2 for i in r["indices"]] + [i for r in resumed for i in r["indices"]]
    assert sorted(trained) == list(range(42))  # 42 samples: 5 steps of 8, then a last step of 2
    per_step = {(r["step"], r["rank"]): 0 for r in resumed}
    for r in resumed:
        per_step[r["step"], r["rank"]] += 1
    assert per_step == {**{(s, k): 2 for s in (3, 4, 5) for k in (0, 1)}, (6, 0): 1, (6, 1): 1}


@pytest.mark.processes
def test_the_trainer_bench_measures_every_arm_and_dflops_ratio_to_it(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (table,) = json.loads(out.read_text())["tables"]
    assert table["columns"][-2:] == ["dflop padded vs arm", "dflop packed vs arm"]
    rows = {row[0]: row for row in table["rows"]}
    assert list(rows) == ["default", "group_by_length", "token-budget", "dflop padded", "dflop packed"]
    for arm, (_, steps, per_s, samples_per_s, *ratios) in rows.items():
        assert steps >= 2 and per_s > 0 and samples_per_s > 0, arm
        for column, ratio in zip(("dflop padded", "dflop packed"), ratios):
            assert ratio == "-" if arm == column else re.fullmatch(r"\d+\.\d\dx \[[\d.]+-[\d.]+\]( \(none\)| \(slower\))?",
                                                                    ratio), (arm, ratio)
