"""The plan's activation recomputation: how a stage calls each of its transformer blocks.

Each block is called through torch's non-reentrant ``torch.utils.checkpoint``
from the stage's forward, so parameter names and module structure stay as they
are, and the hooks tensor parallelism and FSDP2 put on the block run inside the
checkpointed region and again when the backward reruns it (the fp64 tests hold
the result equal to the sequential run's under TP, ZeRO-2/3 and HSDP):

- ``full``: a block keeps only its input; its backward reruns its forward
  (Megatron's ``--recompute-granularity full``, torchtitan's full AC);
- ``selective``: a block keeps the outputs of its matrix multiplications and of
  attention and reruns everything else (norms, rotary embedding, the MLP's
  activation, residual adds): torch's selective checkpointing with that policy,
  the cheap elementwise parts the cost model's selective mode recomputes.
  torch allows one backward through a selectively checkpointed region, and the
  zero-bubble schedules run two (input, then weight gradients), so under those
  schedules selective runs as full (more recomputation than the cost model
  prices, never a different result).

Recomputation reruns the same kernels on the same inputs, so results equal the
run without it bit for bit (no dropout here).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from dflop.specs.plan import Recompute

BlockRunner = Callable[..., torch.Tensor]
"""``runner(block, *inputs)``: the block's output."""


def _kept_ops() -> frozenset:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _selective_context() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept = _kept_ops()

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001, ARG001 - torch's signature
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def block_runner(recompute: Recompute, split_backward: bool) -> BlockRunner | None:
    """How a stage calls each block under ``recompute`` (None: plainly); ``split_backward`` for the
    schedules that run a block's backward in two passes (I and W)."""
    if recompute is Recompute.NONE:
        return None
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    context = _selective_context if recompute is Recompute.SELECTIVE and not split_backward else noop_context_fn

    def run(block: nn.Module, *inputs: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return block(*inputs)
        return checkpoint(block, *inputs, use_reentrant=False, preserve_rng_state=False, context_fn=context)

    return run
