"""What the data-parallel collectives of a plan cost, and what they do to the compute they overlap.

Built once per plan (bytes, groups, bandwidths do not depend on the batch) and
applied to every step's op durations:

- ZeRO-0/1/2 reductions (``REDUCE_GRAD``): the gradient bytes of a pipeline rank
  (fp32 with ``fp32_grads``) all-reduced (ZeRO-0) or reduce-scattered, plus the
  updated weights' all-gather on the step's last reduction (ZeRO-1/2, the
  same volume as an all-reduce when gradients and weights have the same width),
  in buckets of ``TrainingSpec.bucket_params``, overlapping the backward that
  fills them (``overlap.bucket_lag``); that backward runs slower beside it.
- ZeRO-3 (FSDP, HSDP): each forward and backward is a chain of layer units
  (encoder layers, then LLM layers; reversed in the backward), each computing
  while the next unit's weights are gathered and, backward, the previous unit's
  gradients are reduce-scattered (and, with HSDP, all-reduced across nodes);
  the root's (embeddings, head, projector) and the first unit's gathers are the
  exposed ``UNSHARD`` before the op, the last reductions are exposed after it.

Bandwidths come from where the group's GPUs are (``comm.collective_link``).

A cost model that measured FSDP2's units over the group's shard count
(``CostModel.fsdp_unit``: lock-step CPU processes, where a unit's collectives cost
several times their bytes and, every core computing, hide behind nothing) prices
ZeRO-2/3 from that instead: per unit its measured all-gather and reduce-scatter,
run *inside* the op (FSDP2's hooks), not beside it (``inline``). ZeRO-2 then
costs every backward the rank's units' reduce-scatters and the all-gathers of
the next forward (FSDP2 reshards after each backward), as the backend runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dflop.cost.comm import allgather_time, collective_link, reduce_scatter_time, ring_allreduce_time
from dflop.cost.memory import frozen_params, grad_bytes, layer_params, stage_params
from dflop.cost.protocol import CostModel, StageSpec
from dflop.cost.overlap import bucket_lag, bucket_slowdown, unit_chain
from dflop.program.actions import Kind
from dflop.program.collectives import CollectiveSpec
from dflop.timing.perop import PerOp
from dflop.specs.hardware import ClusterSpec, TrainingSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import MODULES, Module, Plan

NS = 1e9


@dataclass(frozen=True)
class TimedCollective:
    kind: Kind
    group: int
    op: int
    """As in its ``CollectiveSpec``: the anchor of a REDUCE_GRAD, the op an UNSHARD feeds."""
    duration: int
    """ns, the same on every member."""
    lag: np.ndarray
    """Per replica: ns after its anchor starts (a REDUCE_GRAD); zeros for an UNSHARD. A collective
    of the whole job: per worker (``StepGraph.workers`` order)."""
    ops: tuple[int, ...] = ()
    """A collective of the whole job (``group`` -1): its op on every group."""


@dataclass(frozen=True)
class Units:
    """FSDP's layer units on one pipeline rank (the whole model: ZeRO-3 runs on one stage)."""

    layers: dict[str, int]
    """Units per module, in forward order."""
    gather: dict[str, float]
    """Seconds to gather one unit's weights, per unit kind ('encoder', 'llm', 'root')."""
    reduce: dict[str, float]
    """Seconds to reduce one unit's gradients (reduce-scatter, plus HSDP's all-reduce)."""
    inline: bool = False
    """Measured: the collectives run inside the op, after one another and its compute."""
    frozen: frozenset[str] = frozenset()
    """Modules with no backward (a frozen encoder): nothing of theirs is gathered for one."""


@dataclass(frozen=True)
class GroupComm:
    reduce: float
    """Seconds of one gradient reduction (the step's, or with ZeRO-2 a microbatch's; ``inline``, also
    the re-gathers of the next forward)."""
    gather: float
    """Seconds of the updated weights' all-gather (ZeRO-1/2), carried by the last reduction."""
    buckets: int
    units: Units | None
    inline: bool = False
    """Measured FSDP2 units (ZeRO-2): the reduction runs inside the backward it follows."""


def shard_degree(plan: Plan, per_node: int, dp: int, tp: int) -> int:
    """GPUs a ZeRO-3 stage is sharded over: the whole data-parallel group, or with HSDP the replicas
    inside one node (``place`` puts a stage's replicas side by side)."""
    if not plan.hsdp:
        return dp
    shards = min(dp, max(per_node // tp, 1))
    return shards if dp % shards == 0 else dp


def rank_units(plan: Plan, model: MLLMSpec, module: str, stages: tuple[int, ...]) -> tuple[tuple[str, float], ...]:
    """(kind, parameters) of every FSDP2 unit of a pipeline rank holding ``stages`` of ``module``, as
    the backend shards them: each block its own unit (kind: its module), then each stage's rest
    (embeddings, head, projector: kind 'root'), and the colocated encoder's on the LLM's first rank."""
    layers = plan.stage_layers(module, model)
    parts = [(module, StageSpec.of(module, layers, s, 1)) for s in stages]
    if plan.strategy.carries_encoder(module, stages):
        parts.append((Module.ENCODER, StageSpec(Module.ENCODER, model.encoder.layers, 1, first=True, last=True)))
    out: list[tuple[str, float]] = []
    for m, spec in parts:
        layer = layer_params(model, m)
        out += [(m, float(layer))] * spec.layers + [("root", float(stage_params(model, spec) - spec.layers * layer))]
    return tuple(out)


def _priced(measured: Callable[[float], tuple[float, float]], unit: tuple[str, float], tp: int) -> tuple[float, float]:
    """(all-gather, reduce-scatter) seconds of a ``rank_units`` unit on a TP rank, as ``measured`` at
    TP 1: a block is split over TP, a root (embeddings, head, projector) replicated."""
    kind, params = unit
    return measured(params if kind == "root" else params / tp)


def _frozen_kinds(training: TrainingSpec, module: str) -> frozenset[str]:
    """The ``rank_units`` kinds with nothing to reduce: a frozen encoder's blocks, and its roots where
    the rank holds the encoder alone (a colocated rank's roots are mostly the LLM's: priced whole)."""
    if not training.freeze_encoder:
        return frozenset()
    return frozenset({Module.ENCODER, "root"} if module == Module.ENCODER else {Module.ENCODER})


def _units(plan: Plan, model: MLLMSpec, training: TrainingSpec, cluster: ClusterSpec, params: float,
           tp: int, dp_gpus: list[int], measured: Callable[[float], tuple[float, float]] | None,
           units: tuple[tuple[str, float], ...], frozen: frozenset[str]) -> Units:
    d = len(dp_gpus)
    shards = shard_degree(plan, cluster.gpus_per_node, d, tp)
    shard_link = collective_link(cluster, dp_gpus[:shards])
    across = dp_gpus[::shards]
    across_link = collective_link(cluster, across)
    gb = grad_bytes(training, plan.fp32_grads)
    layers = {Module.ENCODER: model.encoder.layers, Module.LLM: model.llm.layers}
    sizes = {m: float(layer_params(model, m)) for m in layers}
    sizes["root"] = params - sum(layers[m] * sizes[m] for m in layers)
    gather, reduce = {}, {}
    for kind, p in sizes.items():
        across_s = float(ring_allreduce_time(p / tp * gb / shards, len(across), *across_link))
        if measured is not None:  # the roots are units of their own (the encoder's and the LLM's)
            each = [_priced(measured, u, tp) for u in units if u[0] == "root"] if kind == "root" \
                else [_priced(measured, (kind, p), tp)]
            gather[kind], reduce[kind] = sum(g for g, _ in each), sum(r for _, r in each) + across_s
        else:
            gather[kind] = float(allgather_time(p / tp * training.weight_bytes, shards, *shard_link))
            reduce[kind] = float(reduce_scatter_time(p / tp * gb, shards, *shard_link)) + across_s
        if kind in frozen:
            reduce[kind] = 0.0
    return Units(layers, gather, reduce, inline=measured is not None, frozen=frozen - {"root"})


def group_comm(plan: Plan, model: MLLMSpec, training: TrainingSpec, cluster: ClusterSpec, params: float,
               tp: int, dp_gpus: list[int], module: str, stages: tuple[int, ...],
               cost: CostModel | None = None) -> GroupComm | None:
    """The constants of the data-parallel communication of the pipeline rank holding ``stages`` of
    ``module`` (None without replicas); ZeRO-2/3 priced from ``cost``'s measurements of FSDP2's units
    (``rank_units``) where it has some for the shard count."""
    d = len(dp_gpus)
    if d < 2:
        return None
    measured = None
    strategy = plan.strategy
    if strategy.runs_as_fsdp2 and cost is not None:
        measured = cost.fsdp_unit(shard_degree(plan, cluster.gpus_per_node, d, tp) if strategy.shards_parameters else d)
    units = rank_units(plan, model, module, stages) if measured is not None else ()
    frozen = _frozen_kinds(training, module)
    if strategy.shards_parameters:
        return GroupComm(0.0, 0.0, 1, _units(plan, model, training, cluster, params, tp, dp_gpus, measured, units,
                                             frozen))
    if measured is not None:
        return GroupComm(float(sum(g + (0.0 if u[0] in frozen else r) for u in units
                                   for g, r in [_priced(measured, u, tp)])), 0.0, 1, None, inline=True)
    trains = params - frozen_params(model, training, strategy, module, plan.stage_layers(module, model), stages)
    if trains <= 0:  # a frozen encoder's own ranks: nothing to reduce, nothing updated to gather
        return None
    link = collective_link(cluster, dp_gpus)
    grads = trains / tp * grad_bytes(training, plan.fp32_grads)
    if not strategy.shards_optimizer:
        reduce, gather = float(ring_allreduce_time(grads, d, *link)), 0.0
    else:
        reduce = float(reduce_scatter_time(grads, d, *link))
        gather = float(allgather_time(trains / tp * training.weight_bytes, d, *link))
    buckets = max(1, int(np.ceil(trains / training.bucket_params)))
    return GroupComm(reduce, gather, buckets, None)


def reduction(spec: CollectiveSpec, comm: GroupComm, duration: PerOp, slowdown: float) -> TimedCollective:
    """Price a REDUCE_GRAD and slow its anchor's ``duration`` (ns, per replica) in place (an
    ``inline`` one lengthens it by its whole time, and takes none of its own after it)."""
    seconds = comm.reduce + (comm.gather if spec.last else 0.0)
    if comm.inline:
        duration[spec.op] = duration[spec.op] + to_ns(seconds)
        return TimedCollective(spec.kind, spec.group, spec.op, 0, np.zeros_like(duration[spec.op]))
    backward = duration[spec.op] / NS
    lag = bucket_lag(backward, seconds, comm.buckets)
    duration[spec.op] = duration[spec.op] + to_ns(bucket_slowdown(backward, seconds, lag, slowdown))
    return TimedCollective(spec.kind, spec.group, spec.op, int(to_ns(seconds)), to_ns(lag))


def fsdp_op(kind: Kind, units: Units, compute: dict[str, np.ndarray], slowdown: float) -> tuple[float, np.ndarray,
                                                                                                   np.ndarray]:
    """(exposed gather before the op, op seconds, communication seconds beside it) of one forward or
    backward over the units; ``compute`` is each module's seconds per replica (all its layers)."""
    order = [m for m in MODULES for _ in range(units.layers[m]) if kind is Kind.F or m not in units.frozen]
    if units.inline:  # measured: every unit's collectives after one another, inside the op; the roots
        # stay gathered from forward to backward (FSDP2 never reshards a root after its forward)
        total = sum(np.asarray(compute[m], dtype=float) for m in units.layers) + sum(units.gather[m] for m in order)
        if kind is Kind.F:
            total = total + units.gather["root"]
        else:
            total = total + units.reduce["root"] + sum(units.reduce[m] for m in order)
        return 0.0, total, np.zeros(np.shape(total))
    per_unit = {m: np.asarray(compute[m], dtype=float) / units.layers[m] for m in units.layers if units.layers[m]}
    if kind is Kind.F:
        exposed = units.gather["root"] + units.gather[order[0]]
        total, comm = unit_chain(order, per_unit, units.gather, {m: 0.0 for m in units.layers}, slowdown)
    else:
        order.reverse()
        exposed = units.gather[order[0]]
        total, comm = unit_chain(order, per_unit, units.gather, units.reduce, slowdown)
        total = total + units.reduce["root"]
    return exposed, total, np.broadcast_to(comm, np.shape(total)).copy()


def to_ns(seconds: np.ndarray | float) -> np.ndarray:
    return np.rint(np.asarray(seconds, dtype=float) * NS).astype(np.int64)


def dp_gpus(gpus: list[tuple[int, ...]]) -> list[int]:
    """The data-parallel group of tensor-parallel rank 0 (every TP rank's group is placed alike)."""
    return [replica[0] for replica in gpus]

