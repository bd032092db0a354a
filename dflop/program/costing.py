"""Per-batch numbers of a step: durations, transfers, all-reduces and memory.

Given a template and one global batch partitioned into (LLM replica x
microbatch) bins, every template op gets an array (one value per replica) of
integer nanoseconds from the cost model, and every dependency its transfer
time over the link between the two GPUs groups. Time is kept in integer
nanoseconds so that every evaluator of the same step (the vectorised one, the
reference one, SimPy) computes exactly the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.cost.comm import allgather_time, p2p_time, ring_allreduce_time
from dflop.cost.memory import stage_params, state_bytes
from dflop.cost.protocol import StageCost, StageSpec, WorkShape
from dflop.cost.system import System
from dflop.errors import DflopError
from dflop.program.actions import Kind
from dflop.program.routing import encoder_replicas
from dflop.program.template import Template
from dflop.specs.hardware import ClusterSpec, TrainingSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Plan, place
from dflop.workload.sample import SampleTable

NS = 1e9


def to_ns(seconds: np.ndarray | float) -> np.ndarray:
    return np.rint(np.asarray(seconds, dtype=float) * NS).astype(np.int64)


@dataclass
class StepTiming:
    """Everything an evaluator needs about one step (arrays are per replica of the op's group)."""

    template: Template
    duration: list[np.ndarray]
    dep_comm: list[list[np.ndarray]]
    bridge: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None]
    """Per op: (source replicas, destination replicas, ns) of its bridge transfers."""
    allreduce: np.ndarray
    """Per group: gradient all-reduce over data parallelism, ns."""
    alloc: list[np.ndarray]
    """Per op: activation bytes allocated when it starts (forwards)."""
    free: list[np.ndarray]
    """Per op: activation bytes released when it ends (B, or W when backward is split)."""
    static_bytes: np.ndarray
    """Per group: weights, gradients and optimizer state per GPU."""
    capacity: float
    """Usable memory per GPU."""
    flops: list[np.ndarray]
    info: list[dict[str, np.ndarray]]
    gpus: list[list[tuple[int, ...]]]
    """Per group, per replica: GPU ids."""


def stage_times_timing(template: Template, fwd: np.ndarray, bwd_input: np.ndarray, bwd_weight: np.ndarray,
                       p2p: float = 0.0) -> StepTiming:
    """A StepTiming from per-(stage, microbatch) seconds of a single pipeline (one replica,
    no memory model): the input of ``simulate_pipeline``."""
    fields = {Kind.F: to_ns(fwd), Kind.B: to_ns(bwd_input + bwd_weight), Kind.I: to_ns(bwd_input),
              Kind.W: to_ns(bwd_weight)}
    link = int(to_ns(p2p))
    ones = np.ones(1, dtype=np.int64)
    duration, dep_comm, zeros = [], [], np.zeros(1)
    for op in template.ops:
        a = op.action
        duration.append(fields[a.kind][a.stage, a.microbatch] * ones)
        dep_comm.append([(0 if template.ops[d].group == op.group or a.kind is Kind.W else link) * ones
                         for d in op.deps])
    n, groups = len(template.ops), len(template.groups)
    return StepTiming(template, duration, dep_comm, [None] * n, np.zeros(groups, dtype=np.int64),
                      [zeros] * n, [zeros] * n, np.zeros(groups), float("inf"), [zeros] * n,
                      [{} for _ in range(n)], [[(g.rank,)] for g in template.groups])


@dataclass(frozen=True)
class BinShapes:
    """Per-bin totals, arrays of shape (replicas, microbatches)."""

    samples: np.ndarray
    tiles: np.ndarray
    tokens: np.ndarray
    sum_sq: np.ndarray

    def shape(self) -> WorkShape:
        return WorkShape(self.samples, self.tiles, self.tokens, self.sum_sq)


def bin_shapes(batch: SampleTable, assignment: np.ndarray, replicas: int, microbatches: int) -> BinShapes:
    """Totals per bin; bin ``r * microbatches + k`` is replica r's microbatch k."""
    n = replicas * microbatches
    tokens = batch.llm_tokens.astype(float)

    def total(weights: np.ndarray | None) -> np.ndarray:
        return np.bincount(assignment, weights=weights, minlength=n).reshape(replicas, microbatches)

    return BinShapes(total(None), total(batch.tiles.astype(float)), total(tokens), total(tokens * tokens))


def stage_param_count(model: MLLMSpec, layers: tuple[int, ...], module: str, stage: int,
                      colocated: bool) -> float:
    """Parameters of a module-local stage; a colocated LLM stage 0 also holds the encoder."""
    n = stage_params(model, StageSpec.of(module, layers, stage, 1))
    if module == "llm" and stage == 0 and colocated:
        n += stage_params(model, StageSpec("encoder", model.encoder.layers, 1, first=True, last=True))
    return float(n)


def group_state(plan: Plan, model: MLLMSpec, training: TrainingSpec, layers: dict[str, tuple[int, ...]],
                module: str, stages: tuple[int, ...], tp: int) -> tuple[float, float]:
    """(parameters, model-state bytes per GPU) of one pipeline rank holding ``stages``."""
    colocated = plan.colocated
    params = sum(stage_param_count(model, layers[module], module, s, colocated) for s in stages)
    layer = max(stage_params(model, StageSpec(module, 1)), 1)
    dp = plan.module(module).dp
    return params, float(sum(state_bytes(params, tp, dp, plan.zero, training, layer)))


def _link(cluster: ClusterSpec, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[float, float]:
    """(bandwidth per GPU, latency) between two GPU groups."""
    hw = cluster.hardware
    if {cluster.node_of(g) for g in a + b} == {cluster.node_of(a[0])}:
        return hw.intra_node_bandwidth, hw.intra_node_latency
    return hw.inter_node_bandwidth, hw.inter_node_latency


class StepBuilder:
    """Turns batches into StepTimings for one plan.

    Everything that does not depend on the batch (placement, links, layer
    split, model state, gradient all-reduce) is computed once here, because the
    optimizer times each plan on many batches.
    """

    def __init__(self, template: Template, system: System) -> None:
        self.t, self.system = template, system
        self.model, self.cluster, self.training, self.cost = system.model, system.cluster, system.training, system.cost
        plan = template.plan
        self.plan, self.m = plan, plan.microbatches
        gpu_map = place(plan)
        self.gpus = [[gpu_map.gpus(g.module, g.rank, x) for x in range(g.replicas)] for g in template.groups]
        self.layers = {"encoder": plan.stage_layers("encoder", self.model),
                       "llm": plan.stage_layers("llm", self.model)}
        self.links: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        for op in template.ops:
            for d in op.deps:
                a, b = template.ops[d].group, op.group
                if a != b and (a, b) not in self.links:
                    self.links[(a, b)] = self._links(a, b, np.arange(template.groups[b].replicas),
                                                     np.arange(template.groups[b].replicas))
        if not template.colocated:
            enc, llm = template.encoder_stages - 1, template.encoder_stages
            j, r = np.meshgrid(np.arange(plan.encoder.dp), np.arange(plan.llm.dp), indexing="ij")
            bw, lat = self._links(enc, llm, j.ravel(), r.ravel())
            self.bridge_links = (bw.reshape(j.shape), lat.reshape(j.shape))
        self.static_bytes, self.allreduce = self._state()

    def _links(self, a: int, b: int, xa: np.ndarray, xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per pair of replicas: bandwidth of a TP group's parallel links, and latency."""
        tp = min(self.t.groups[a].tp, self.t.groups[b].tp)
        pairs = [_link(self.cluster, self.gpus[a][i], self.gpus[b][k]) for i, k in zip(xa, xb)]
        return np.array([p[0] * tp for p in pairs]), np.array([p[1] for p in pairs])

    def stage_spec(self, module: str, stage: int, tp: int) -> StageSpec:
        return StageSpec.of(module, self.layers[module], stage, tp)

    def _state(self) -> tuple[np.ndarray, np.ndarray]:
        plan = self.plan
        static = np.zeros(len(self.t.groups))
        allreduce = np.zeros(len(self.t.groups), dtype=np.int64)
        for g in self.t.groups:
            params, static[g.index] = group_state(plan, self.model, self.training, self.layers, g.module,
                                                  g.stages, g.tp)
            dp = plan.module(g.module).dp
            if plan.zero == 3 or dp == 1:
                continue
            everyone = tuple(x for reps in self.gpus[g.index] for x in reps)
            bw, lat = _link(self.cluster, everyone, everyone)
            nbytes = params / g.tp * self.training.grad_bytes
            allreduce[g.index] = to_ns(ring_allreduce_time(nbytes, dp, bw, lat))
        return static, allreduce

    def timing(self, batch: SampleTable, assignment: np.ndarray) -> StepTiming:
        """Numbers of one step on ``batch``; ``assignment[i]`` is sample i's bin."""
        return _Costing(self, batch, np.asarray(assignment, dtype=np.int64)).build()



class _Costing:
    """The batch-dependent half: bins, encoder chunks, stage costs, transfers."""

    def __init__(self, builder: StepBuilder, batch: SampleTable, assignment: np.ndarray) -> None:
        self.b = builder
        plan, m = builder.plan, builder.m
        if len(assignment) != len(batch) or (len(batch) and (assignment.min() < 0
                                                              or assignment.max() >= plan.bins)):
            raise DflopError(f"every sample of the batch needs a bin in 0..{plan.bins - 1}")
        self.bins = bin_shapes(batch, assignment, plan.llm.dp, m)
        self.batch, self.assignment = batch, assignment
        if not builder.t.colocated:
            self.chunk = encoder_replicas(batch.tiles, assignment, m, plan.encoder.dp)
            n = plan.encoder.dp * m
            key = self.chunk * m + assignment % m
            enc_tiles = np.bincount(key, weights=batch.tiles.astype(float), minlength=n)
            enc_samples = np.bincount(key, weights=(batch.tiles > 0).astype(float), minlength=n)
            self.enc_shape = WorkShape(samples=enc_samples.reshape(plan.encoder.dp, m),
                                       tiles=enc_tiles.reshape(plan.encoder.dp, m))

    def stage_cost(self, module: str, stage: int, tp: int) -> StageCost:
        """Cost of a module-local stage on every (replica, microbatch)."""
        b = self.b
        if module == "encoder":
            return b.cost.stage_cost(b.stage_spec("encoder", stage, tp), self.enc_shape)
        cost = b.cost.stage_cost(b.stage_spec("llm", stage, tp), self.bins.shape())
        if stage == 0 and b.t.colocated:
            enc = StageSpec("encoder", b.model.encoder.layers, tp, first=True, last=True)
            cost = cost + b.cost.stage_cost(enc, WorkShape(self.bins.samples, self.bins.tiles))
        if b.plan.zero == 3:
            cost = self._fsdp(cost, stage, tp)
        return cost

    def _fsdp(self, cost: StageCost, stage: int, tp: int) -> StageCost:
        """FSDP gathers the weights before forward and again before backward and reduce-scatters
        gradients after; prefetching hides it behind compute when compute is longer."""
        b = self.b
        hw, dp = b.cluster.hardware, b.plan.llm.dp
        params = stage_param_count(b.model, b.layers["llm"], "llm", stage, b.t.colocated)
        gather = float(allgather_time(params / tp * b.training.weight_bytes,
                                      dp, hw.inter_node_bandwidth, hw.inter_node_latency))
        nonempty = np.asarray(cost.fwd) > 0
        fwd = np.where(nonempty, np.maximum(cost.fwd, gather), 0.0)
        bwd = np.where(nonempty, np.maximum(cost.bwd_input + cost.bwd_weight, 2 * gather), 0.0)
        return StageCost(fwd, bwd * 0.5, bwd * 0.5, cost.act_bytes, cost.flops)

    def boundary_bytes(self, module: str, k: int) -> np.ndarray:
        """Activation (or gradient) bytes between two stages of a module, per replica."""
        b = self.b.training.activation_bytes
        if module == "encoder":
            enc = self.b.model.encoder
            return self.enc_shape.tiles[:, k] * enc.patches_per_tile * enc.hidden * b
        return self.bins.tokens[:, k] * self.b.model.llm.hidden * b

    def build(self) -> StepTiming:
        t, m = self.b.t, self.b.m
        costs = {(g.index, s): self.stage_cost(g.module, s, g.tp) for g in t.groups for s in g.stages}
        duration, alloc, free, flops, info, dep_comm, bridge = [], [], [], [], [], [], []
        for op in t.ops:
            g = t.groups[op.group]
            c, k, kind = costs[(g.index, op.stage)], op.action.microbatch, op.action.kind
            seconds = {Kind.F: c.fwd, Kind.B: c.bwd_input + c.bwd_weight, Kind.I: c.bwd_input,
                       Kind.W: c.bwd_weight}[kind]
            duration.append(to_ns(np.broadcast_to(seconds, (g.replicas, m))[:, k]))
            act = np.broadcast_to(c.act_bytes, (g.replicas, m))[:, k]
            alloc.append(act if kind is Kind.F else np.zeros(g.replicas))
            free.append(act if kind in (Kind.B, Kind.W) else np.zeros(g.replicas))
            fl = np.broadcast_to(c.flops, (g.replicas, m))[:, k]
            flops.append(fl if kind is Kind.F else fl * (2.0 if kind is Kind.B else 1.0))
            info.append(self._info(g.module, k))
            dep_comm.append([self._dep_comm(op, t.ops[d]) for d in op.deps])
            bridge.append(self._bridge(op) if op.bridge >= 0 else None)
        return StepTiming(t, duration, dep_comm, bridge, self.b.allreduce, alloc, free, self.b.static_bytes,
                          self.b.cluster.hardware.usable_memory_bytes, flops, info, self.b.gpus)

    def _info(self, module: str, k: int) -> dict[str, np.ndarray]:
        if module == "encoder":
            return {"samples": self.enc_shape.samples[:, k], "tiles": self.enc_shape.tiles[:, k]}
        return {"samples": self.bins.samples[:, k], "tokens": self.bins.tokens[:, k],
                "tiles": self.bins.tiles[:, k]}

    def _dep_comm(self, op, dep) -> np.ndarray:
        if dep.group == op.group or op.action.kind is Kind.W:
            return np.zeros(self.b.t.groups[op.group].replicas, dtype=np.int64)
        bw, lat = self.b.links[(dep.group, op.group)]
        module = self.b.t.groups[op.group].module
        return to_ns(p2p_time(self.boundary_bytes(module, op.action.microbatch), bw, lat))

    def _bridge(self, op) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Image embeddings from encoder replica j to LLM replica r (and gradients back)."""
        plan, m, k = self.b.plan, self.b.m, op.action.microbatch
        enc_dp, llm_dp = plan.encoder.dp, plan.llm.dp
        mask = (self.assignment % m) == k
        key = self.chunk[mask] * llm_dp + self.assignment[mask] // m
        tokens = np.bincount(key, weights=self.batch.image_tokens[mask].astype(float),
                             minlength=enc_dp * llm_dp).reshape(enc_dp, llm_dp)
        j, r = np.nonzero(tokens)
        nbytes = tokens[j, r] * self.b.model.llm.hidden * self.b.training.activation_bytes
        bw, lat = self.b.bridge_links
        ns = to_ns(p2p_time(nbytes, bw[j, r], lat[j, r]))
        src, dst = (j, r) if op.action.kind is Kind.F else (r, j)
        return src.astype(np.int64), dst.astype(np.int64), ns
