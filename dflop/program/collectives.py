"""Which data-parallel collectives a step has, where they sit, and what they overlap: cost-free.

Every pipeline rank with more than one data-parallel replica synchronises its
replicas; how depends on the plan's ZeRO stage (what is sharded):

- ZeRO-0 and ZeRO-1: one ``REDUCE_GRAD`` per step (the gradients' all-reduce, or
  their reduce-scatter plus the updated weights' all-gather), *overlapping* the
  rank's last compute op: gradient accumulation defers the reduction to the
  last microbatch, whose backward fills the buckets it reduces.
- ZeRO-2: one ``REDUCE_GRAD`` per backward op, overlapping it (each microbatch's
  gradients are reduce-scattered into their shards as they are produced); the
  last one also carries the weights' all-gather.
- ZeRO-3 (FSDP): one ``UNSHARD`` before every forward and backward op: the
  exposed gather of its first layer (the rest are gathered beside compute,
  inside the op). A collective over the replicas, so every forward and
  backward starts on all replicas together: FSDP's per-layer synchronisation.

A heterogeneous encoder adds three collectives of the whole job, one member per
rank (``group`` -1, ``ops`` one per pipeline rank): ``ALL_TO_ALL_F`` before each
rank's first LLM op (the embeddings reach stage 0; every rank takes part, as in
one ``all_to_all_single``), ``ALL_TO_ALL_B`` before each rank's ``ENCODE_B``
(their gradients back), and with encoder replicas ``REDUCE_ENCODER_GRAD`` after
it (the encoder's gradients over its own data-parallel group). A frozen encoder
(``Template.frozen_encoder``) has neither of the last two, and its own ranks of a
disaggregated plan reduce nothing (with ZeRO-3 they still gather before each forward).

The lowering places these nodes and the costing prices them from the same list
(``group_collectives``), so nodes and costs line up by index.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflop.program.actions import Kind
from dflop.program.template import Template
from dflop.specs.plan import Module


@dataclass(frozen=True)
class CollectiveSpec:
    kind: Kind
    """REDUCE_GRAD (overlaps the start of ``op``) or UNSHARD (precedes ``op``)."""
    group: int
    op: int
    """Template op: the compute a REDUCE_GRAD overlaps (its anchor), or the one an UNSHARD feeds."""
    last: bool
    """The group's last reduction of the step (it carries ZeRO-1/2's weight all-gather)."""
    ops: tuple[int, ...] = ()
    """A collective of the whole job (``group`` -1): its op on every group, in group order."""

    def op_of(self, group: int) -> int:
        """Its op on ``group``."""
        return self.ops[group] if self.group < 0 else self.op


def group_collectives(template: Template) -> tuple[CollectiveSpec, ...]:
    """Every collective of the step, group by group, each group's in program order."""
    plan = template.plan
    out: list[CollectiveSpec] = []
    for g in template.groups:
        if g.replicas < 2:
            continue
        if template.frozen_encoder and g.module is Module.ENCODER and not plan.strategy.shards_parameters:
            continue  # nothing trains there: nothing to reduce (ZeRO-3 still gathers its weights)
        ops = [template.ops[i] for i in template.llm_ops[g.index]]
        if plan.strategy.reduces_once_per_step:
            out.append(CollectiveSpec(Kind.REDUCE_GRAD, g.index, ops[-1].index, True))
        elif plan.strategy.reduces_every_backward:
            weights = [op for op in ops if op.action.kind in (Kind.B, Kind.W)]
            out.extend(CollectiveSpec(Kind.REDUCE_GRAD, g.index, op.index, op is weights[-1]) for op in weights)
        else:
            out.extend(CollectiveSpec(Kind.UNSHARD, g.index, op.index, False) for op in ops)
    if plan.heterogeneous:
        firsts = tuple(int(ops[0]) for ops in template.llm_ops)
        out.append(CollectiveSpec(Kind.ALL_TO_ALL_F, -1, firsts[0], False, firsts))
        if template.frozen_encoder:  # no gradients go back, the encoder has none to reduce
            return tuple(out)
        ends = tuple(int(ops[-1]) for ops in template.group_ops)  # each group's ENCODE_B
        out.append(CollectiveSpec(Kind.ALL_TO_ALL_B, -1, ends[0], False, ends))
        if plan.encoder.dp > 1:
            out.append(CollectiveSpec(Kind.REDUCE_ENCODER_GRAD, -1, ends[0], True, ends))
    return tuple(out)
