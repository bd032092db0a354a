"""Process groups from the plan, and the parallelism torch provides, applied to a worker's modules.

A worker of the step graph is one tensor-parallel group; its GPUs are torch
ranks (``place(plan)`` numbers them: GPU g is rank g). The encoder and the LLM
each get a DeviceMesh of shape (pp, dp, tp) over their ranks (a colocated
encoder lives on the LLM's first-stage ranks, so it uses the LLM's mesh):
tensor parallelism is torch's ``parallelize_module`` with column- and row-wise
linear layers over the mesh's ``tp`` dimension, ZeRO-2/3 FSDP2's
``fully_shard`` over ``dp`` (HSDP: over ``dp`` split into replicate x shard),
ZeRO-1 torch's ZeroRedundancyOptimizer, and the gradient reduction of ZeRO-0/1 a
bucketed all-reduce over ``dp``.

Point-to-point between two workers pairs their TP ranks: receiver rank i of a
worker hears from sender rank ``i mod tp_sender`` (every TP rank holds the whole
activation after a row-parallel layer, so each needs one copy), which covers
encoder and LLM of different TP degrees alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from dflop.errors import DflopError
from dflop.specs.execution import ExecutionSpec
from dflop.models.parallel import shard_unit, split_blocks
from dflop.program.stepgraph import Worker
from dflop.specs.plan import Module, Plan, Strategy, place

BUCKET_BYTES = 25 * 2**20
"""Gradient bucket size, as DDP's default."""


@dataclass(frozen=True)
class RankLayout:
    """Where a torch rank sits: its worker (a TP group) and its index within it."""

    rank: int
    worker: int
    tp_index: int
    ranks: tuple[tuple[int, ...], ...]
    """Per worker: its torch ranks."""

    @classmethod
    def of(cls, workers: Iterable[Worker], rank: int) -> "RankLayout":
        workers = list(workers)
        ranks = tuple(w.gpus for w in workers)
        for w in workers:
            if rank in w.gpus:
                return cls(rank, w.index, w.gpus.index(rank), ranks)
        raise DflopError(f"rank {rank} has no worker in a plan of {sum(len(r) for r in ranks)} GPUs")

    def send_to(self, peer: int) -> list[int]:
        mine, theirs = len(self.ranks[self.worker]), self.ranks[peer]
        return [theirs[i] for i in range(len(theirs)) if i % mine == self.tp_index]

    def recv_from(self, peer: int) -> int:
        theirs = self.ranks[peer]
        return theirs[self.tp_index % len(theirs)]


def _mesh(plan: Plan, module: Module, device: str):  # noqa: ANN202 - DeviceMesh
    from torch.distributed.device_mesh import DeviceMesh

    mp = plan.module(module)
    gpus = place(plan)
    ranks = [[list(gpus.gpus(module, s, x)) for x in range(mp.dp)] for s in range(mp.pp)]
    return DeviceMesh(device, torch.tensor(ranks), mesh_dim_names=("pp", "dp", "tp"))


@dataclass
class Groups:
    """The meshes of a plan and this rank's groups in them. Every rank builds every group, in the
    same order, because creating a group is collective over all ranks."""

    plan: Plan
    layout: RankLayout
    device: str
    meshes: dict[Module, object] = field(default_factory=dict)
    tied: dict[tuple[int, int], object] = field(default_factory=dict)
    hybrid: dict[Module, object] = field(default_factory=dict)
    """Per mesh owner: the HSDP mesh (replicate, shard) made from its ``dp`` dimension."""

    def __post_init__(self) -> None:
        self.meshes[Module.LLM] = _mesh(self.plan, Module.LLM, self.device)
        if not self.plan.colocated:
            self.meshes[Module.ENCODER] = _mesh(self.plan, Module.ENCODER, self.device)

    def mesh_of(self, module: Module):  # noqa: ANN201 - DeviceMesh
        return self.meshes[self.plan.strategy.mesh_owner(module)]

    def fsdp_mesh(self, module: Module, shards: int):  # noqa: ANN201 - DeviceMesh
        """The data-parallel mesh FSDP2 shards over: ``dp``; with HSDP ``dp`` unflattened into
        (replicate, shard), ``shards`` consecutive replicas (one node's: ``place`` puts a stage's
        replicas side by side) sharding and the nodes replicating. Made once per mesh (collective)."""
        owner = self.plan.strategy.mesh_owner(module)
        mesh = self.meshes[owner]
        dp = mesh["dp"].size()
        if not self.plan.hsdp or shards >= dp:
            return mesh["dp"]
        if owner not in self.hybrid:
            self.hybrid[owner] = mesh._unflatten("dp", (dp // shards, shards), ("replicate", "shard"))
        return self.hybrid[owner]["replicate", "shard"]

    def tied_embedding_groups(self, first: list[tuple[int, ...]], last: list[tuple[int, ...]]) -> None:
        """One group per (replica, TP index) joining the first and the last LLM stage, whose
        embedding and head are one (tied) matrix."""
        for x, (a, b) in enumerate(zip(first, last)):
            for t, pair in enumerate(zip(a, b)):
                self.tied[(x, t)] = dist.new_group(list(pair))


def tensor_parallel(module: nn.Module, mesh, tp: int) -> None:  # noqa: ANN001 - DeviceMesh
    """Megatron's split of every transformer block of a stage (``dflop.models.parallel``); embeddings,
    norms and the head stay replicated."""
    if tp > 1:
        blocks = getattr(module, "blocks", None)
        split_blocks(blocks.values() if blocks is not None else (), mesh)


def fully_shard_stage(module: nn.Module, mesh, reshard_after_forward: bool = True) -> None:  # noqa: ANN001
    """FSDP2 over data parallelism: each block its own unit (gathered just before use), then the rest.
    Without resharding after forward the gathered weights stay until the backward (ZeRO-2's memory)."""
    blocks = getattr(module, "blocks", None)
    for unit in (list(blocks.values()) if blocks is not None else []) + [module]:
        shard_unit(unit, mesh, reshard_after_forward)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_reduce_grads(params: list[nn.Parameter], group, bucket_bytes: int = BUCKET_BYTES) -> None:  # noqa: ANN001
    """Sum gradients over ``group`` in buckets (one flat buffer each), as DDP does.

    Every replica must reduce the same buffers, but a parameter may get no gradient on some replica
    (an image-only part on a replica with no images): it reduces zeros there, and keeps no gradient
    where no replica had one, so the optimizer treats it as the sequential run would."""
    had = torch.tensor([float(p.grad is not None) for p in params],  # on the group's device (NCCL: CUDA only)
                       device=params[0].device if params else None)
    dist.all_reduce(had, group=group)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [local(p.grad) for p in params]
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads + [None]:
        if g is not None:
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket and (g is None or size >= bucket_bytes):
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=group)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, size = [], 0
    for p, count in zip(params, had.tolist()):
        if not count:
            p.grad = None


def adamw_options(spec: ExecutionSpec) -> dict[str, float]:
    """AdamW's settings from the run's execution spec: every rank and the sequential reference use these."""
    return {"lr": spec.lr, "weight_decay": spec.weight_decay, "eps": spec.adam_eps}


def make_optimizer(params: list[nn.Parameter], strategy: Strategy, dp_group, spec: ExecutionSpec,  # noqa: ANN001
                   ) -> torch.optim.Optimizer:
    """AdamW; with ZeRO-1 its state sharded over data parallelism (torch's ZeroRedundancyOptimizer);
    with ZeRO-2/3 FSDP2 has sharded the parameters, and with them the state. A rank with nothing to
    train (a frozen encoder's own) gets one that steps nothing."""
    if not params:
        return torch.optim.AdamW([{"params": []}], **adamw_options(spec))
    if strategy.optimizer_shards_itself and dist.get_world_size(dp_group) > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=dp_group,
                                       **adamw_options(spec))
    return torch.optim.AdamW(params, **adamw_options(spec))
