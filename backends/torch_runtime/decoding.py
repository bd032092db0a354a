"""A step's real media decoded apart from the rest of its inputs: in DataLoader worker processes,
ahead of the step (``execution.decode_workers``), so that decoding is never on its critical path.

Decoding is a pure function of picklable data, the images and videos of the samples a rank
feeds (frozen ``ImageRef`` / ``VideoRef``), and a sample whose media fail to decode comes back
as the error's message, for every rank to skip it alike (``worker._undecodable_anywhere``),
never as an exception that would end the run. The workers are forked from the rank and run one
thread each; they decode and hand back tensors (in shared memory), nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dflop.workload.pixels import ImageRef, MediaError, VideoRef

Media = dict[str, tuple[ImageRef | VideoRef, ...]]
"""The images, or the video, of each sample a rank feeds in a step, by sample id."""

PREFETCH = 2
"""Steps each worker decodes ahead of the one the rank waits for (torch's ``prefetch_factor``)."""
START_METHOD = "fork"
"""How a rank starts its workers: a fork takes a tenth of a second, where a spawned worker (or a
forkserver) imports torch and the launching script again, seconds a rank; a worker only decodes,
touching none of the rank's threads (gloo, NCCL) nor its device."""


def decode(media: Media) -> dict[str, np.ndarray | str]:
    """Each sample's tiles, (tiles, 3, side, side) float32 in the order of its images, or the
    message of the ``MediaError`` that stopped them (the sample is then skipped, not the run)."""
    out: dict[str, np.ndarray | str] = {}
    for sample_id, refs in media.items():
        try:
            out[sample_id] = np.concatenate([ref.pixels(sample_id) for ref in refs])
        except MediaError as exc:
            out[sample_id] = str(exc)
    return out


@dataclass(frozen=True)
class Decoded:
    """One step's media as a rank feeds them."""

    step: int
    pixels: dict[str, torch.Tensor | str]
    """Sample id -> its tiles (a tensor, which crosses from a worker in shared memory) or why they do not decode."""
    seconds: float
    """What decoding them took, where it ran."""


class StepMedia(Dataset):
    """Item ``step``: the step's media this rank feeds, decoded (one item a step: ``batch_size=None``)."""

    def __init__(self, media: dict[int, Media]) -> None:
        self.media = media

    def __getitem__(self, step: int) -> Decoded:
        began = time.perf_counter()
        pixels = {k: v if isinstance(v, str) else torch.from_numpy(v) for k, v in decode(self.media[step]).items()}
        return Decoded(step, pixels, time.perf_counter() - began)


def one_thread(_: int) -> None:
    """A worker's ``worker_init_fn``: one torch thread, as a CPU rank runs (it shares the rank's cores)."""
    torch.set_num_threads(1)


def as_is(item: Decoded) -> Decoded:
    """The loader's ``collate_fn``: an item is one step's already."""
    return item


def decoded_steps(media: dict[int, Media], steps: range, workers: int) -> Iterator[tuple[Decoded, float]]:
    """``steps``' media decoded, in order, each with the seconds the caller waited for it: by
    ``workers`` processes, each up to ``PREFETCH`` steps ahead of the caller, or by the caller
    itself at each step's turn (0). The workers end with the last step."""
    extra = dict(prefetch_factor=PREFETCH, multiprocessing_context=START_METHOD, worker_init_fn=one_thread)
    loader = DataLoader(StepMedia(media), batch_size=None, sampler=steps, num_workers=workers, collate_fn=as_is,
                        **(extra if workers else {}))
    began = time.perf_counter()
    for item in loader:
        yield item, time.perf_counter() - began
        began = time.perf_counter()
