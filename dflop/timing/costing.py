"""Per-batch numbers of a step: durations, transfers, collectives and memory.

Given a template and one global batch partitioned into (LLM replica x
microbatch) bins, every template op gets an array (one value per replica) of
integer nanoseconds from the cost model, every dependency its transfer time
over the link between the two GPU groups, and every data-parallel collective
(``collectives.py``) its time and overlap (``dpcomm.py``). Time is kept in
integer nanoseconds so that every evaluator of the same step (the vectorised
one, the reference one, SimPy) computes exactly the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dflop.cost.comm import p2p_time
from dflop.cost.memory import frozen_params, layer_params, stage_params, state_bytes
from dflop.cost.protocol import StageCost, StageSpec, WorkShape
from dflop.cost.system import System
from dflop.errors import DflopError
from dflop.program.actions import Kind
from dflop.program.collectives import group_collectives
from dflop.program.routing import encoder_replicas
from dflop.program.template import Template
from dflop.specs.hardware import TrainingSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module, Plan, Strategy, place
from dflop.timing.encoder_phase import EncoderPhase
from dflop.timing.dpcomm import NS, TimedCollective, dp_gpus, fsdp_op, group_comm, reduction, shard_degree, to_ns
from dflop.timing.perop import PerOp
from dflop.workload.sample import SampleTable

__all__ = ["NS", "to_ns", "StepTiming", "TimingBuilder", "bin_shapes", "group_state",
           "stage_times_timing", "stage_param_count"]


@dataclass
class StepTiming:
    """Everything an evaluator needs about one step (arrays are per replica of the op's group)."""

    template: Template
    duration: PerOp
    """Per op, ns."""
    dep_comm: PerOp
    """Per op and dependency slot (``op.deps`` order), ns of the transfer."""
    bridge: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None]
    """Per op: (source replicas, destination replicas, ns) of its bridge transfers."""
    collectives: list[TimedCollective]
    """Per data-parallel collective, in ``group_collectives`` order: its ns and lag."""
    alloc: PerOp
    """Per op: activation bytes allocated when it starts (forwards)."""
    free: PerOp
    """Per op: activation bytes released when it ends (B, or W when backward is split)."""
    transient: PerOp
    """Per op: bytes held only while it runs (the logits' gradient, a recomputed layer)."""
    static_bytes: np.ndarray
    """Per group: weights, gradients and optimizer state per GPU."""
    capacity: float
    """Usable memory per GPU."""
    flops: PerOp
    """Per op: model FLOPs per GPU (for MFU)."""
    hw_flops: PerOp
    """Per op: FLOPs executed per GPU, recomputation included (for HFU)."""
    overlap: PerOp
    """Per op: ns of communication running beside it inside the op (FSDP's gathers and reductions)."""
    info: Sequence[dict[str, np.ndarray]]
    gpus: list[list[tuple[int, ...]]]
    """Per group, per replica: GPU ids."""


def stage_times_timing(template: Template, fwd: np.ndarray, bwd_input: np.ndarray, bwd_weight: np.ndarray,
                       p2p: float = 0.0) -> StepTiming:
    """A StepTiming from per-(stage, microbatch) seconds of a single pipeline (one replica,
    no memory model): the input of ``simulate_pipeline``."""
    fields = {Kind.F: to_ns(fwd), Kind.B: to_ns(bwd_input + bwd_weight), Kind.I: to_ns(bwd_input),
              Kind.W: to_ns(bwd_weight)}
    link = int(to_ns(p2p))
    n, groups = len(template.ops), len(template.groups)
    width = [1] * n
    duration = PerOp.zeros(width, np.int64)
    dep_comm = PerOp.zeros(width, np.int64, (template.dep_slots,))
    for op in template.ops:
        a = op.action
        duration[op.index] = fields[a.kind][a.stage, a.microbatch]
        for slot, d in enumerate(op.deps):
            dep_comm.table[op.index, slot] = 0 if template.ops[d].group == op.group or a.kind is Kind.W else link
    zeros = PerOp.zeros(width)
    return StepTiming(template, duration, dep_comm, [None] * n, [], zeros, zeros, zeros,
                      np.zeros(groups), float("inf"), zeros, zeros, PerOp.zeros(width, np.int64),
                      [{} for _ in range(n)], [[(g.rank,)] for g in template.groups])


def bin_shapes(batch: SampleTable, assignment: np.ndarray, replicas: int, microbatches: int) -> WorkShape:
    """The shape of every bin, arrays of shape (replicas, microbatches); bin ``r * microbatches + k``
    is replica r's microbatch k."""
    n = replicas * microbatches
    tokens = batch.llm_tokens.astype(float)

    def total(weights: np.ndarray | None) -> np.ndarray:
        return np.bincount(assignment, weights=weights, minlength=n).reshape(replicas, microbatches)

    return WorkShape(total(None), total(batch.tiles.astype(float)), total(tokens), total(tokens * tokens),
                     total(batch.targets.astype(float)))


def stage_param_count(model: MLLMSpec, layers: tuple[int, ...], module: str, stage: int,
                      strategy: Strategy) -> float:
    """Parameters of a module-local stage; a colocated LLM stage 0 also holds the encoder."""
    n = stage_params(model, StageSpec.of(module, layers, stage, 1))
    if strategy.carries_encoder(module, (stage,)):
        n += stage_params(model, StageSpec(Module.ENCODER, model.encoder.layers, 1, first=True, last=True))
    return float(n)


def group_state(plan: Plan, model: MLLMSpec, training: TrainingSpec, layers: dict[str, tuple[int, ...]],
                module: str, stages: tuple[int, ...], tp: int, per_node: int) -> tuple[float, float]:
    """(parameters, model-state bytes per GPU) of one pipeline rank holding ``stages``."""
    strategy = plan.strategy
    params = sum(stage_param_count(model, layers[module], module, s, strategy) for s in stages)
    held = sum(layers[module][s] for s in stages) * layer_params(model, module)
    modules = strategy.modules_of(module, stages)
    if strategy.carries_encoder(module, stages):
        held += model.encoder.layers * layer_params(model, Module.ENCODER)
    largest = max(layer_params(model, m) for m in modules)
    dp = plan.module(module).dp
    shards = shard_degree(plan, per_node, dp, tp) if strategy.shards_parameters else dp
    frozen = frozen_params(model, training, strategy, module, layers[module], stages)
    return params, float(sum(state_bytes(params, tp, shards, plan.zero, training, largest,
                                         fp32_grads=plan.fp32_grads, root_params=params - held, frozen=frozen)))


class TimingBuilder:
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
        node = self.cluster.node_of  # per group, the first and the last node of each replica's GPUs
        self.nodes = [(np.array([node(min(r)) for r in group]), np.array([node(max(r)) for r in group]))
                      for group in self.gpus]
        self.layers = {Module.ENCODER: plan.stage_layers(Module.ENCODER, self.model),
                       Module.LLM: plan.stage_layers(Module.LLM, self.model)}
        self.links: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        edges: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for op in template.ops:
            for slot, d in enumerate(op.deps):
                a, b = template.ops[d].group, op.group
                if a != b and (a, b) not in self.links:
                    self.links[(a, b)] = self._links(a, b, np.arange(template.groups[b].replicas),
                                                     np.arange(template.groups[b].replicas))
                if a != b and op.action.kind is not Kind.W:
                    edges.setdefault((a, b), []).append((op.index, slot, op.action.microbatch))
        self.transfers = {key: tuple(np.array(column, dtype=np.int64) for column in zip(*rows))
                          for key, rows in edges.items()}
        """Per (group sending, group receiving): (op, dependency slot, microbatch) of every transfer."""
        self.width = [template.groups[op.group].replicas for op in template.ops]
        self.columns = [(np.array([template.ops[i].stage for i in ops]),
                         np.array([template.ops[i].action.kind.value for i in ops]),
                         np.array([template.ops[i].action.microbatch for i in ops], dtype=np.int64))
                        for ops in template.group_ops]
        """Per group, per op in program order: its stage, kind and microbatch."""
        self.bridged = [op.index for op in template.ops if op.bridge >= 0]
        if not template.colocated:
            enc, llm = template.encoder_stages - 1, template.encoder_stages
            j, r = np.meshgrid(np.arange(plan.encoder.dp), np.arange(plan.llm.dp), indexing="ij")
            bw, lat = self._links(enc, llm, j.ravel(), r.ravel())
            self.bridge_links = (bw.reshape(j.shape), lat.reshape(j.shape))
        self.static_bytes, self.comm = self._state()
        self.specs = group_collectives(template)
        self.phase = EncoderPhase(self) if plan.heterogeneous else None
        if self.phase is not None:  # a GPU of the encoder's also holds its replica's share
            self.static_bytes = self.static_bytes + self.phase.static_bytes

    def _links(self, a: int, b: int, xa: np.ndarray, xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per pair of replicas: bandwidth of a TP group's parallel links, and latency (a pair's link is
        within a node when all of both replicas' GPUs are on one node)."""
        tp = min(self.t.groups[a].tp, self.t.groups[b].tp)
        (lo_a, hi_a), (lo_b, hi_b) = self.nodes[a], self.nodes[b]
        within = np.minimum(lo_a[xa], lo_b[xb]) == np.maximum(hi_a[xa], hi_b[xb])
        hw = self.cluster.hardware
        return (np.where(within, hw.intra_node_bandwidth, hw.inter_node_bandwidth) * tp,
                np.where(within, hw.intra_node_latency, hw.inter_node_latency).astype(float))

    def stage_spec(self, module: str, stage: int, tp: int) -> StageSpec:
        return StageSpec.of(module, self.layers[module], stage, tp, self.plan.recompute)

    def _state(self) -> tuple[np.ndarray, list]:
        """Model state per GPU and the data-parallel communication of every group."""
        static = np.zeros(len(self.t.groups))
        comm = []
        for g in self.t.groups:
            params, static[g.index] = group_state(self.plan, self.model, self.training, self.layers, g.module,
                                                  g.stages, g.tp, self.cluster.gpus_per_node)
            comm.append(group_comm(self.plan, self.model, self.training, self.cluster, params, g.tp,
                                   dp_gpus(self.gpus[g.index]), g.module, g.stages, self.cost))
        return static, comm

    def timing(self, batch: SampleTable, assignment: np.ndarray) -> StepTiming:
        """Numbers of one step on ``batch``; ``assignment[i]`` is sample i's bin."""
        return _Costing(self, batch, np.asarray(assignment, dtype=np.int64)).build()


class _Costing:
    """The batch-dependent half: bins, encoder chunks, stage costs, transfers."""

    def __init__(self, builder: TimingBuilder, batch: SampleTable, assignment: np.ndarray) -> None:
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

    def stage_parts(self, module: str, stage: int, tp: int) -> dict[str, StageCost]:
        """Cost of a module-local stage on every (replica, microbatch), by module (a colocated LLM
        stage 0 also runs the encoder)."""
        b = self.b
        if module == Module.ENCODER:
            return {Module.ENCODER: b.cost.stage_cost(b.stage_spec(Module.ENCODER, stage, tp), self.enc_shape)}
        parts = {Module.LLM: b.cost.stage_cost(b.stage_spec(Module.LLM, stage, tp), self.bins)}
        if b.plan.strategy.carries_encoder(module, (stage,)):
            enc = StageSpec(Module.ENCODER, b.model.encoder.layers, tp, first=True, last=True, recompute=b.plan.recompute)
            parts["encoder"] = b.cost.stage_cost(enc, WorkShape(self.bins.samples, self.bins.tiles))
        return parts

    def needs_no_input_grad(self, module: str, stage: int) -> np.ndarray | bool:
        """Where a module-local stage's inputs need no gradient, per (replica, microbatch): the
        pipeline's first stage (pixels in: the encoder's, or a colocated LLM's with the encoder
        inside), an LLM's first stage whose image tokens come from a frozen encoder, and else on
        bins without images (the bridge or the all-to-all brings it nothing to train). The runtime
        then runs that stage's whole backward in its W step."""
        if stage != 0:
            return False
        if module == Module.ENCODER or self.b.plan.strategy.carries_encoder(module, (stage,)) \
                or self.b.t.frozen_encoder:
            return True
        return self.bins.tiles == 0

    def boundary_bytes(self, module: str) -> np.ndarray:
        """Activation (or gradient) bytes between two stages of a module, per (replica, microbatch)."""
        b = self.b.training.activation_bytes
        if module == Module.ENCODER:
            enc = self.b.model.encoder
            return self.enc_shape.tiles * enc.patches_per_tile * enc.hidden * b
        return self.bins.tokens * self.b.model.llm.hidden * b

    def _tables(self, g) -> dict[int, dict[str, dict[str, np.ndarray]]]:
        """Per stage of group ``g``: every cost field as a (replicas, microbatches) table, for the
        whole stage ('all') and, where FSDP needs them apart, by module."""
        fields = ("fwd", "bwd", "bwd_input", "bwd_weight", "act_bytes", "transient_bytes", "forward_transient_bytes",
                  "flops", "backward_flops", "recompute_flops")
        shape = (g.replicas, self.b.m)
        out = {}
        for s in g.stages:
            deferred = self.needs_no_input_grad(g.module, s)
            parts = {key: c.backward_in_weight_step(deferred) for key, c in self.stage_parts(g.module, s, g.tp).items()}
            whole = sum(parts.values(), StageCost(0.0, 0.0, 0.0, 0.0, 0.0))
            named = {"all": whole, **(parts if self.b.comm[g.index] and self.b.comm[g.index].units else {})}
            out[s] = {key: {f: np.broadcast_to(np.asarray(getattr(c, f), dtype=float), shape) for f in fields}
                      for key, c in named.items()}
            out[s]["all"]["deferred"] = np.broadcast_to(np.asarray(deferred, dtype=float), shape)
        return out

    def _group(self, g, slowdown: float) -> dict[str, np.ndarray]:
        """Per-op fields of one group's ops (program order), as (ops, replicas) arrays, filled stage
        by stage and kind by kind (the op's microbatch picks the table's column)."""
        tables = self._tables(g)
        stage, kind, mb = self.b.columns[g.index]
        n = len(stage)
        out = {f: np.zeros((n, g.replicas)) for f in ("seconds", "act", "transient", "flops", "recompute", "overlap")}
        out["exposed"] = np.zeros(n)
        units = self.b.comm[g.index].units if self.b.comm[g.index] is not None else None
        for s, tab in tables.items():
            c = tab["all"]
            for k, field in ((Kind.F, "fwd"), (Kind.B, "bwd"), (Kind.I, "bwd_input"), (Kind.W, "bwd_weight")):
                rows = np.flatnonzero((stage == s) & (kind == k.value))
                if not len(rows):
                    continue
                cols = mb[rows]
                out["seconds"][rows] = c[field][:, cols].T
                out["act"][rows] = c["act_bytes"][:, cols].T
                deferred = c["deferred"][:, cols].T
                out["flops"][rows] = c["flops"][:, cols].T if k is Kind.F else \
                    c["backward_flops"][:, cols].T * {Kind.B: 1.0, Kind.I: (1.0 - deferred) / 2,
                                                      Kind.W: (1.0 + deferred) / 2}[k]
                if k is Kind.F:
                    out["transient"][rows] = c["forward_transient_bytes"][:, cols].T
                else:  # the op that runs the backward through the inputs holds its peak
                    share = {Kind.B: 1.0, Kind.I: 1.0 - deferred, Kind.W: deferred}[k]
                    out["transient"][rows] = c["transient_bytes"][:, cols].T * share
                    out["recompute"][rows] = c["recompute_flops"][:, cols].T * share
                if units is not None and k in (Kind.F, Kind.B):
                    phase = "fwd" if k is Kind.F else "bwd"
                    compute = {name: part[phase][:, cols].T for name, part in tab.items() if name != "all"}
                    exposed, out["seconds"][rows], out["overlap"][rows] = fsdp_op(k, units, compute, slowdown)
                    out["exposed"][rows] = exposed
        return out

    def build(self) -> StepTiming:
        b, t = self.b, self.b.t
        slowdown = b.cluster.hardware.comm_slowdown
        duration, overlap = PerOp.zeros(b.width, np.int64), PerOp.zeros(b.width, np.int64)
        alloc, free, transient, flops, hw_flops = (PerOp.zeros(b.width) for _ in range(5))
        exposed = np.zeros(len(t.ops))
        work = b.phase.work(self.batch, self.assignment) if b.phase is not None else None
        for g, ops in zip(t.groups, t.group_ops):
            got, r = self._group(g, slowdown), g.replicas
            kind = b.columns[g.index][1]
            forward, backward = kind == Kind.F.value, (kind == Kind.B.value) | (kind == Kind.W.value)
            duration.table[ops, :r] = to_ns(got["seconds"])
            overlap.table[ops, :r] = to_ns(got["overlap"])
            alloc.table[ops[forward], :r] = got["act"][forward]
            free.table[ops[backward], :r] = got["act"][backward]
            transient.table[ops, :r] = got["transient"]
            flops.table[ops, :r] = got["flops"]
            hw_flops.table[ops, :r] = got["flops"] + got["recompute"]
            exposed[ops] = got["exposed"]
            if work is not None:  # the group's first op, its ENCODE, and its last: ENCODE_B, or with a
                # frozen encoder the last LLM op, the last to hold the embeddings
                mine = slice(g.index * r, (g.index + 1) * r)  # heterogeneous: every group has the LLM's dp
                encode, back = ops[0], ops[-1]
                duration.table[encode, :r] = work.forward[mine]
                transient.table[encode, :r] = work.chunk_bytes[mine]
                alloc.table[encode, :r] = work.embeddings[mine]
                free.table[back, :r] += work.embeddings[mine]
                flops.table[encode, :r] = hw_flops.table[encode, :r] = work.flops[mine]
                if not t.frozen_encoder:
                    duration.table[back, :r] = work.backward[mine]
                    transient.table[back, :r] = work.chunk_bytes[mine]
                    flops.table[back, :r] = 2 * work.flops[mine]
                    hw_flops.table[back, :r] = 3 * work.flops[mine] + work.recompute_flops[mine]
        collectives = []
        for spec in b.specs:
            if spec.group < 0:
                collectives.append(b.phase.collective(spec, work, duration, slowdown))
            elif spec.kind is Kind.REDUCE_GRAD:
                collectives.append(reduction(spec, b.comm[spec.group], duration, slowdown))
            else:
                lag = np.zeros(t.groups[spec.group].replicas, dtype=np.int64)
                collectives.append(TimedCollective(spec.kind, spec.group, spec.op, int(to_ns(exposed[spec.op])), lag))
        info = OpInfo(t, [self._info_table(g.module) for g in t.groups],
                      None if work is None else {"samples": work.samples, "tiles": work.tiles})
        return StepTiming(t, duration, self._dep_comm(), self._bridges(), collectives, alloc, free, transient,
                          b.static_bytes, b.cluster.hardware.usable_memory_bytes, flops, hw_flops, overlap, info,
                          b.gpus)

    def _info_table(self, module: str) -> dict[str, np.ndarray]:
        if module == Module.ENCODER:
            return {"samples": self.enc_shape.samples, "tiles": self.enc_shape.tiles}
        return {"samples": self.bins.samples, "tokens": self.bins.tokens, "tiles": self.bins.tiles}

    def _dep_comm(self) -> PerOp:
        """Transfer ns of every dependency: over the link between two groups, none within one
        (and none into a W, whose input is its own B's)."""
        b = self.b
        out = PerOp.zeros(b.width, np.int64, (b.t.dep_slots,))
        for (sender, receiver), (ops, slots, mb) in b.transfers.items():
            bw, lat = b.links[(sender, receiver)]
            module = b.t.groups[receiver].module
            ns = to_ns(p2p_time(self.boundary_bytes(module), bw[:, None], lat[:, None]))
            out.table[ops, slots, :len(bw)] = ns[:, mb].T
        return out

    def _bridges(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """Per op with a bridge input: image embeddings from encoder replica j to LLM replica r (and
        gradients back), (source replicas, destination replicas, ns), the pairs that carry any."""
        b = self.b
        out: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * len(b.t.ops)
        if not b.bridged:
            return out
        m, enc_dp, llm_dp = b.m, b.plan.encoder.dp, b.plan.llm.dp
        key = ((self.assignment % m) * enc_dp + self.chunk) * llm_dp + self.assignment // m
        tokens = np.bincount(key, weights=self.batch.image_tokens.astype(float),
                             minlength=m * enc_dp * llm_dp).reshape(m, enc_dp, llm_dp)
        bw, lat = b.bridge_links
        pairs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for i in b.bridged:
            action = b.t.ops[i].action
            k = action.microbatch
            if k not in pairs:
                j, r = np.nonzero(tokens[k])
                nbytes = tokens[k][j, r] * b.model.llm.hidden * b.training.activation_bytes
                pairs[k] = (j.astype(np.int64), r.astype(np.int64), to_ns(p2p_time(nbytes, bw[j, r], lat[j, r])))
            j, r, ns = pairs[k]
            out[i] = (j, r, ns) if action.kind is Kind.F else (r, j, ns)
        return out


class OpInfo(Sequence):
    """Per op, the shape of the work it ran (samples, tokens, tiles per replica), read on demand
    from its group's (replicas, microbatches) tables: only traces and step graphs ask."""

    def __init__(self, template: Template, tables: list[dict[str, np.ndarray]],
                 phase: dict[str, np.ndarray] | None = None) -> None:
        self.t, self.tables, self.phase = template, tables, phase

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:  # type: ignore[override]
        op = self.t.ops[i]
        if op.action.kind.is_encoder_phase:  # per worker of the whole job: this group's slice
            r = self.t.groups[op.group].replicas
            return {name: v[op.group * r:(op.group + 1) * r] for name, v in self.phase.items()}
        return {name: v[:, op.action.microbatch] for name, v in self.tables[op.group].items()}

    def __len__(self) -> int:
        return len(self.t.ops)
