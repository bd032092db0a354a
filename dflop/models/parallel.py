"""Megatron's tensor-parallel split of a transformer block, with torch's tensor-parallel API.

One definition for everything that runs a block over a TP group: the torch
backend's stages and the profiler, which measures a block the way the backend
runs it (DTensor's dispatch and the group's collectives included).
"""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn

from dflop.errors import DflopError

COLUMN_WISE = ("q", "k", "v", "gate", "up", "fc1")
ROW_WISE = ("o", "down", "proj", "fc2")


def split_blocks(blocks: Iterable[nn.Module], mesh) -> None:  # noqa: ANN001 - a 1-D DeviceMesh
    """q, k, v and the MLP's first layers column-wise, the attention output and the MLP's last
    layer row-wise (one all-reduce each in forward); norms stay replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in blocks:
        if getattr(getattr(block, "spec", None), "qk_norm", False):
            raise DflopError("the torch backend cannot split query-key normalisation (InternViT) over tensor "
                             "parallelism; use tp 1 for this encoder")
        names = {n for n, _ in block.named_children()}
        plan = {**{n: ColwiseParallel() for n in COLUMN_WISE if n in names},
                **{n: RowwiseParallel() for n in ROW_WISE if n in names}}
        parallelize_module(block, mesh, plan)
