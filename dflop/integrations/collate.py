"""Collators for microbatches of a variable number of samples: packed (padding-free) and padded.

dflop's bins hold a different number of samples each, balanced on what a microbatch costs the
trainer; the collator decides that cost. :class:`PackedCollator` lays a microbatch's samples end to
end in one row with position ids that restart at every sample, so it computes only real tokens
(``BinCost.PACKED``); :class:`PaddedCollator` pads every sample to the longest, so it computes the
sample count times the longest (``BinCost.PADDED``).

Packing is exact only where the model keeps the samples of a row apart. In transformers 5, a model
whose attention masks come from ``transformers.masking_utils`` (Qwen2, Llama, LLaVA-OneVision's
language model, ...) builds a block-diagonal causal mask from position ids that restart, with sdpa
and eager attention on CPU too, but only when it is given no attention mask and no cache: a model
in training mode makes itself a cache when ``use_cache`` is on (its config's default), so the packed
batch carries ``use_cache=False``. LLaVA-OneVision's vision tower encodes every image on its own and
its features fill the image tokens in order, so its packed loss equals the per-sample loss too
(tests/test_integration_transformers.py checks both to 1e-5). A model whose attention reads no
position ids (absolute position embeddings without them, an encoder that attends across the row)
is not exact packed: give it the PaddedCollator.

Features are mappings with ``input_ids`` (a 1-D sequence), optionally ``labels`` (the same length;
by default the input ids, as transformers' language-modelling collators do) and ``attention_mask``
(recomputed, so it must be all ones), and for images LLaVA-OneVision's per-sample ``pixel_values``
``(images, patches, channels, height, width)`` with ``image_sizes`` ``(images, 2)``: the images of a
microbatch are stacked in sample order, their patches padded to the most any has (the model keeps
only the patches each image size needs, as with its processor's padded batches). Any other key is an
error naming it, rather than a value silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from dflop.errors import DflopError

IGNORE = -100
"""The label the loss skips: padding, and the first token of every packed sample (no sample
predicts the next one's first token)."""
KEYS = ("input_ids", "labels", "attention_mask", "pixel_values", "image_sizes")


def _tensor(value: Any, key: str, i: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    try:
        return torch.as_tensor(value, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DflopError(f"microbatch sample {i}: '{key}' is not a tensor of numbers ({exc})") from None


def _sequences(features: Sequence[Mapping[str, Any]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(input ids, labels) of every sample, checked."""
    if not features:
        raise DflopError("microbatch: no samples to collate")
    ids, labels = [], []
    for i, feature in enumerate(features):
        unknown = [k for k in feature if k not in KEYS]
        if unknown:
            raise DflopError(f"microbatch sample {i}: key '{unknown[0]}' is not one the collator batches "
                             f"({', '.join(KEYS)}); drop it from the dataset's items")
        if "input_ids" not in feature:
            raise DflopError(f"microbatch sample {i}: no 'input_ids'")
        x = _tensor(feature["input_ids"], "input_ids", i, torch.long)
        y = _tensor(feature.get("labels", x), "labels", i, torch.long)
        if x.ndim != 1 or len(x) == 0 or y.shape != x.shape:
            raise DflopError(f"microbatch sample {i}: 'input_ids' must be a non-empty 1-D sequence and 'labels' "
                             f"as long, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
        mask = feature.get("attention_mask")
        if mask is not None and not bool((_tensor(mask, "attention_mask", i) == 1).all()):
            raise DflopError(f"microbatch sample {i}: 'attention_mask' has zeros; give the samples unpadded")
        ids.append(x)
        labels.append(y)
    return ids, labels


def _images(features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """LLaVA-OneVision's image inputs of the microbatch, in sample order (none without images)."""
    pixels, sizes, counts = [], [], []
    for i, feature in enumerate(features):
        if ("pixel_values" in feature) != ("image_sizes" in feature):
            raise DflopError(f"microbatch sample {i}: 'pixel_values' and 'image_sizes' go together")
        if "pixel_values" not in feature:
            counts.append(0)
            continue
        p = _tensor(feature["pixel_values"], "pixel_values", i)
        s = _tensor(feature["image_sizes"], "image_sizes", i, torch.long)
        if p.ndim != 5 or s.shape != (len(p), 2):
            raise DflopError(f"microbatch sample {i}: expected 'pixel_values' (images, patches, channels, height, "
                             f"width) and 'image_sizes' (images, 2), got {tuple(p.shape)} and {tuple(s.shape)}")
        pixels.append(p)
        sizes.append(s)
        counts.append(len(p))
    if not pixels:
        return {}
    most = max(p.shape[1] for p in pixels)
    padded = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in pixels]
    out = {"pixel_values": torch.cat(padded), "image_sizes": torch.cat(sizes)}
    if max(counts) > 1:  # LLaVA-OneVision gives each image of a multi-image sample one tile, if told
        out["batch_num_images"] = torch.tensor(counts)
    return out


@dataclass(frozen=True)
class PackedCollator:
    """A microbatch as one row of its samples end to end, position ids restarting at each: no padding
    (see the module notes for the models where that is exact)."""

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        ids, labels = _sequences(features)
        first = torch.tensor([IGNORE])
        labels = [torch.cat([first, y[1:]]) for y in labels]
        return {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None],
                "position_ids": torch.cat([torch.arange(len(x)) for x in ids])[None],
                "use_cache": False, **_images(features)}


@dataclass(frozen=True)
class PaddedCollator:
    """A microbatch padded on the right to its longest sample, with an attention mask."""

    pad_token_id: int = 0

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        ids, labels = _sequences(features)
        longest = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), longest), self.pad_token_id, dtype=torch.long)
        label_rows = torch.full((len(ids), longest), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(ids), longest), dtype=torch.long)
        for row, (x, y) in enumerate(zip(ids, labels)):
            input_ids[row, :len(x)], label_rows[row, :len(y)], mask[row, :len(x)] = x, y, 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": label_rows, **_images(features)}
