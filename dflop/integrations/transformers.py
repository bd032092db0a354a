"""dflop's bins inside the Hugging Face Trainer: ``DflopTrainer(..., data_profile=...)``.

``DflopTrainer`` is a ``transformers.Trainer`` whose training loader yields, on every rank, that
rank's microbatches of :class:`dflop.schedule.sampler.BalancedBatchSampler`; everything else is
the Trainer's. It is :class:`DflopLoaderMixin` over the Trainer; the mixin alone gives a Trainer
subclass of one's own the same bins (LLaVA-NeXT's ``LLaVATrainer``: docs/guide/trainers.md). Why
each piece sits where it does:

- **One optimizer step is one global batch.** ``world x gradient_accumulation_steps`` microbatches
  hold ``world x accumulation x per_device_train_batch_size`` samples in all, so the optimizer sees
  the number of samples the user configured, while each microbatch holds a balanced, variable
  number of them. World size and rank are the Trainer's (``args.world_size``,
  ``args.process_index``); every rank computes the same bins from the same seed (``data_seed``, else
  ``seed``), without communication.
- **The loader is already per rank**, so it goes through accelerate's ``prepare_data_loader`` as a
  one-process loader: accelerate places batches on the device as usual but neither re-shards it
  (``BatchSamplerShard`` would hand each rank every world-th microbatch of its own) nor re-batches
  it (``dispatch_batches``/``split_batches`` would load on rank 0 and slice evenly; both are refused).
  ``even_batches`` does not arise: every rank has as many microbatches as the others.
- **Resume.** Each checkpoint gets the sampler's state (``dflop_sampler.json``: seed, epoch, world
  size, accumulation, global batch, data fingerprint). On resume the Trainer skips the microbatches
  the epoch already trained (its steps so far x accumulation), which is right because the sampler
  yields the same sequence again (the Trainer's ``set_epoch`` reaches it, as the loader's batch
  sampler, also under the skip's wrapper) and every global batch is ``accumulation`` microbatches
  per rank; ``train(resume_from_checkpoint=...)`` first checks the saved state and refuses a run whose
  ranks would cut other bins (another world size, accumulation, batch size, data or seed).
- **Cost.** The collator decides what a microbatch costs: :class:`~dflop.integrations.collate.PackedCollator`
  (or transformers' ``DataCollatorWithFlattening``) packs, so bins balance summed costs; any other
  collator pads, so bins balance ``count x longest`` (:mod:`dflop.schedule.padded`).
  Without a collator, DflopTrainer pads (:class:`~dflop.integrations.collate.PaddedCollator`).

Data parallelism only: ranks are data-parallel replicas (DDP, FSDP's sharded data parallelism); a
run with tensor or context parallelism inside the Trainer would need the data-parallel rank instead.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, IterableDataset
from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, seed_worker

from dflop.errors import DflopError
from dflop.integrations.collate import PackedCollator, PaddedCollator
from dflop.schedule import padded
from dflop.schedule.padded import BinCost
from dflop.schedule.sampler import BalancedBatchSampler
from dflop.specs.loading import load_json, save_json
from dflop.workload.data_profile import DataProfile

CHECKPOINT_FILE = "dflop_sampler.json"
LABELS = {"dp_size": "world size", "microbatches": "gradient_accumulation_steps",
          "global_batch": "global batch (world x accumulation x per_device_train_batch_size)",
          "samples": "data profile samples", "shapes": "data profile shapes", "seed": "seed (data_seed, else seed)",
          "shuffle": "shuffle", "drop_last": "dataloader_drop_last", "bin_cost": "bin cost", "solver": "solver"}
"""The sampler's state keys as a Trainer user knows them."""


def load_profile(data_profile: DataProfile | str | os.PathLike, dataset: Any) -> DataProfile:
    """The profile (loaded from its path), which must describe ``dataset`` sample by sample."""
    if isinstance(data_profile, (str, os.PathLike)):
        profile = DataProfile.load(data_profile)
    elif isinstance(data_profile, DataProfile):
        profile = data_profile
    else:
        raise DflopError(f"data_profile: expected a DataProfile or its path, got {type(data_profile).__name__}")
    if dataset is None:
        return profile
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise DflopError("train_dataset: dflop's sampler picks samples by index; give a map-style dataset "
                         f"(with __len__ and __getitem__), not a {type(dataset).__name__}")
    if len(profile) != len(dataset):
        name = data_profile if isinstance(data_profile, (str, os.PathLike)) else "data_profile"
        raise DflopError(f"{name}: describes {len(profile)} samples but train_dataset has {len(dataset)}; "
                         "sample i of the profile must describe train_dataset[i]")
    return profile


def trainer_sampler(profile: DataProfile, *, world_size: int, rank: int, accumulation: int,
                    per_device_batch: int, drop_last: bool, seed: int,
                    bin_cost: BinCost | str = BinCost.PADDED, solver: str = "lpt") -> BalancedBatchSampler:
    """Rank ``rank``'s sampler: global batches of ``world x accumulation x per_device_batch``
    samples, each cut into ``world x accumulation`` bins, ``accumulation`` per rank and step.

    Without ``drop_last`` the epoch's tail is a last, shorter step; a tail of fewer samples than
    ranks is refused, since a rank with nothing to train would leave the others waiting for it in
    the gradient all-reduce."""
    sampler = BalancedBatchSampler(profile, global_batch=world_size * accumulation * per_device_batch,
                                   dp_size=world_size, dp_rank=rank, microbatches=accumulation, seed=seed,
                                   drop_last=drop_last, bin_cost=bin_cost, solver=solver)
    tail = 0 if drop_last else len(profile) % sampler.global_batch
    if 0 < tail < world_size:
        raise DflopError(f"dataloader_drop_last: off, and the epoch's last global batch would hold {tail} of "
                         f"{len(profile)} samples, fewer than the {world_size} ranks, so a rank would have none to "
                         "train; turn dataloader_drop_last on or change the batch size")
    return sampler


def sampler_for(args: TrainingArguments, profile: DataProfile, bin_cost: BinCost | str) -> BalancedBatchSampler:
    """:func:`trainer_sampler` for this process, as the Trainer's arguments configure it."""
    seed = args.data_seed if args.data_seed is not None else args.seed
    return trainer_sampler(profile, world_size=max(1, args.world_size), rank=args.process_index,
                           accumulation=args.gradient_accumulation_steps,
                           per_device_batch=args.per_device_train_batch_size,
                           drop_last=args.dataloader_drop_last, seed=seed, bin_cost=bin_cost)


def bin_cost_of(collator: Any) -> BinCost:
    """PACKED for a collator that packs without padding, PADDED for any other (they pad)."""
    return BinCost.PACKED if isinstance(collator, (PackedCollator, DataCollatorWithFlattening)) else BinCost.PADDED


def per_rank_loader(dataset: Any, sampler: BalancedBatchSampler, collator: Any, args: TrainingArguments,
                    accelerator: Accelerator) -> DataLoader:
    """A loader of this rank's microbatches, prepared by accelerate as a one-process loader (placed
    on the device, never re-sharded or re-batched); the other loader settings are the Trainer's."""
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collator, num_workers=args.dataloader_num_workers,
                        pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers,
                        prefetch_factor=args.dataloader_prefetch_factor,
                        multiprocessing_context=args.dataloader_multiprocessing_context,
                        worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers,
                                               rank=args.process_index))
    return prepare_data_loader(loader, accelerator.device, num_processes=1, process_index=0, split_batches=False,
                               put_on_device=accelerator.device_placement, dispatch_batches=False,
                               non_blocking=accelerator.non_blocking)


def save_sampler_state(sampler: BalancedBatchSampler, folder: str | os.PathLike) -> Path:
    """Write the sampler's state into a checkpoint folder, whole or not at all."""
    return save_json(Path(folder) / CHECKPOINT_FILE, sampler.state())


def check_sampler_state(sampler: BalancedBatchSampler, folder: str | os.PathLike) -> None:
    """Refuse to continue the epoch of checkpoint ``folder`` with a sampler that cuts other bins
    than the one that trained it: the Trainer would skip microbatches this run never gave."""
    path = Path(folder) / CHECKPOINT_FILE
    if not Path(folder).is_dir():
        raise DflopError(f"{folder}: resume_from_checkpoint: not a checkpoint folder")
    if not path.is_file():
        raise DflopError(f"{folder}: has no {CHECKPOINT_FILE} (not saved by DflopTrainer), so which samples its "
                         "epoch already trained is unknown; resume it with the trainer that saved it, or set "
                         "ignore_data_skip=True to start its epoch over")
    saved = load_json(path)
    if not isinstance(saved, dict):
        raise DflopError(f"{path}: not a dflop sampler state (expected a JSON object)")
    differ = sampler.differences(saved)
    if differ:
        what = ", ".join(f"{LABELS.get(k, k)} {was} -> {now}" for k, (was, now) in differ.items())
        raise DflopError(f"{folder}: saved by a run with other bins ({what}); the resumed ranks would skip "
                         "microbatches they never trained; resume with the settings it was saved with")


class SamplerCheckpoint(TrainerCallback):
    """Writes ``sampler``'s state into every checkpoint the Trainer saves (by the process that saves).

    The folder is the Trainer's ``output_dir/checkpoint-<step>``; a checkpoint saved elsewhere (a
    hyperparameter search's run folder) gets none, and resuming from it says so."""

    def __init__(self, sampler: BalancedBatchSampler | None = None) -> None:
        self.sampler = sampler

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if self.sampler is not None and args.should_save and folder.is_dir():
            save_sampler_state(self.sampler, folder)


def _pad_id(processing_class: Any) -> int:
    for owner in (processing_class, getattr(processing_class, "tokenizer", None)):
        pad = getattr(owner, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0


class DflopLoaderMixin:
    """dflop's bins for any ``transformers.Trainer`` subclass: put it first among the bases,
    ``class MyTrainer(DflopLoaderMixin, TheirTrainer)``, and pass ``data_profile=`` (and optionally
    ``bin_cost=``) to the constructor; see :class:`DflopTrainer` for what they mean.

    It replaces the training loader (``get_train_dataloader``, so the trainer's own sampler, e.g.
    LLaVA-NeXT's ``group_by_modality_length``, is no longer asked) and checks a checkpoint before
    ``train`` resumes it; because it comes first in the method order, it wins over a
    ``get_train_dataloader`` the trainer defines itself, which a sampler alone could not: the
    microbatches hold a variable number of samples. The trainer's optimizer, saving and loop stay.
    """

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, *,
                 data_profile: DataProfile | str | os.PathLike, bin_cost: BinCost | str | None = None,
                 data_collator: Any = None, **kwargs: Any) -> None:
        if data_collator is None:
            data_collator = PaddedCollator(pad_token_id=_pad_id(kwargs.get("processing_class")))
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        self.data_profile = load_profile(data_profile, self.train_dataset)
        self.bin_cost = bin_cost_of(self.data_collator) if bin_cost is None else padded.bin_cost(bin_cost)
        config = self.args.accelerator_config
        for option in ("dispatch_batches", "split_batches"):
            if getattr(config, option, None):
                raise DflopError(f"accelerator_config.{option}: dflop's sampler gives every rank its own "
                                 "microbatches, which accelerate must not re-batch; leave it off")
        if self.args.n_gpu > 1:
            raise DflopError(f"n_gpu {self.args.n_gpu}: one process over several GPUs splits every microbatch "
                             "evenly across them; launch one process per GPU (torchrun)")
        if self.train_dataset is not None:
            sampler_for(self.args, self.data_profile, self.bin_cost)  # bad settings fail here, before any work
        self.sampler_checkpoint = SamplerCheckpoint()
        self.add_callback(self.sampler_checkpoint)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            return super().get_train_dataloader()  # the Trainer's own error
        sampler = sampler_for(self.args, self.data_profile, self.bin_cost)
        self.sampler_checkpoint.sampler = sampler
        collator = self._get_collator_with_removed_columns(self.data_collator, description="training")
        return per_rank_loader(self.train_dataset, sampler, collator, self.args, self.accelerator)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's train, after checking that a checkpoint to resume continues with the same bins."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True and os.path.isdir(self.args.output_dir):
            checkpoint = get_last_checkpoint(self.args.output_dir) or True  # none: the Trainer says so
        if isinstance(checkpoint, (str, os.PathLike)) and not self.args.ignore_data_skip:
            check_sampler_state(sampler_for(self.args, self.data_profile, self.bin_cost), checkpoint)
        return super().train(checkpoint, *args, **kwargs)


class DflopTrainer(DflopLoaderMixin, Trainer):
    """The Hugging Face Trainer with dflop's balanced microbatches (see the module notes).

    ``data_profile``: a DataProfile, or its path, whose sample i describes ``train_dataset[i]``.
    ``bin_cost``: what a microbatch costs; by default from the collator (packed for
    PackedCollator / DataCollatorWithFlattening, else padded). ``data_collator`` defaults to a
    PaddedCollator with the processing class's pad token. Everything else as the Trainer.
    """
