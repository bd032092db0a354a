"""Megatron's tensor-parallel split of a transformer block, with torch's tensor-parallel API, and
FSDP2's unit over data parallelism.

One definition for everything that runs a block over a TP group, or a unit over
a sharded data-parallel group: the torch backend's stages and the profiler,
which measures them the way the backend runs them (DTensor's dispatch, FSDP2's
hooks and the group's collectives included).
"""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn

from dflop.errors import DflopError
from dflop.specs.models import EncoderSpec

COLUMN_WISE = ("q", "k", "v", "gate", "up", "fc1")
ROW_WISE = ("o", "down", "proj", "fc2")


def split_blocks(blocks: Iterable[nn.Module], mesh) -> None:  # noqa: ANN001 - a 1-D DeviceMesh
    """q, k, v and the MLP's first layers column-wise, the attention output and the MLP's last
    layer row-wise (one all-reduce each in forward); norms stay replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in blocks:
        if isinstance(getattr(block, "spec", None), EncoderSpec) and block.spec.qk_norm:  # LLMs' is per head
            raise DflopError("the torch backend cannot split query-key normalisation (InternViT) over tensor "
                             "parallelism; use tp 1 for this encoder")
        names = {n for n, _ in block.named_children()}
        plan = {**{n: ColwiseParallel() for n in COLUMN_WISE if n in names},
                **{n: RowwiseParallel() for n in ROW_WISE if n in names}}
        parallelize_module(block, mesh, plan)


def shard_unit(module: nn.Module, mesh, reshard_after_forward: bool = True) -> None:  # noqa: ANN001 - DeviceMesh
    """``module`` one FSDP2 unit over ``mesh``, its gradients summed, not averaged (the loss is
    normalised over the global batch already), and reduced with SUM: fp32 and bf16 would otherwise
    use PREMUL_SUM, which gloo lacks."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)
