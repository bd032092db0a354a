"""Cheap per-candidate figures: memory, a proven lower bound, a closed-form estimate.

These run on every candidate, so everything is cached by the parts of a plan
it depends on. The *estimate* uses average-sized microbatches and the
schedules' closed forms with unequal stages (fill and drain through every
stage once, then the bottleneck stage once per further microbatch), plus the
exposed part of the data-parallel communication (``dpcomm``'s formulas on the
average microbatch); it only orders the candidates. The *bound* is what
prunes: the slowest stage's share of the whole batch, which no schedule and no
communication can beat.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.cost.comm import p2p_time
from dflop.cost.memory import stage_params
from dflop.cost.overlap import bucket_lag
from dflop.cost.protocol import StageSpec, WorkShape
from dflop.plan.evaluate import Evaluator, inflight_by_stage
from dflop.program.actions import Kind
from dflop.timing.costing import group_state
from dflop.timing.encoder_phase import embedding_copies, phase_spec, phase_state
from dflop.timing.dpcomm import GroupComm, fsdp_op, group_comm
from dflop.program.template import plan_groups
from dflop.schedule.batching import Batching
from dflop.specs.plan import MODULES, Module, Plan
from dflop.specs.schedule_kinds import DUAL_PIPE_V, ZBV_ZERO_BUBBLE, schedule_facts

Shape = tuple[float, float, float, float, float]
"""A WorkShape's fields, hashable for the cache."""


@dataclass(frozen=True)
class Screen:
    memory: float
    memory_rank: str
    bound: float
    estimate: float


def dp_group(plan: Plan, module: Module, stage: int) -> list[int]:
    """GPUs of the data-parallel group of tensor-parallel rank 0 of a pipeline rank, as ``place``
    lays them out (encoder first, then the LLM; replicas side by side, stages apart)."""
    mp = plan.module(module)
    base = plan.encoder.gpus if module == Module.LLM and not plan.shares_gpus else 0
    return [base + mp.tp * (r + mp.dp * stage) for r in range(mp.dp)]


def closed_form(plan: Plan, virtual: int, rank_time: list[float], rank_f: list[float], rank_i: list[float],
                rank_w: list[float]) -> float:
    """The schedule's step time with unequal ranks (per microbatch: ``rank_time`` in all, forward
    ``rank_f``, input gradients ``rank_i``, weight gradients ``rank_w``): the closed forms of
    ``benchmarks/bench_schedules.py``, a V rank's stage taking half its rank's time."""
    m, bottleneck, kind = plan.microbatches, max(rank_time), schedule_facts(plan.schedule)
    fill = list(zip(rank_f, rank_i, rank_w))[:-1]  # every rank but the last
    if kind is ZBV_ZERO_BUBBLE:  # only the fill idles
        return m * bottleneck + sum(f for f, _, _ in fill) / 2
    if kind is DUAL_PIPE_V:  # ZB1P's with one stage's times, plus the forward of each pair held
        return m * bottleneck + sum(2 * f + i - w for f, i, w in fill) / 2
    if virtual > 1:
        return (m + (plan.llm.pp - 1) / virtual) * bottleneck
    if kind.splits_backward:
        return m * bottleneck + sum(f + i - w for f, i, w in fill)
    return (m - 1) * bottleneck + sum(rank_time)


class Screener:
    def __init__(self, evaluator: Evaluator, bound_batches: int) -> None:
        self.ev, self.p = evaluator, evaluator.p
        self.n = bound_batches
        self._times: dict[tuple, tuple[float, ...]] = {}
        self._state: dict[tuple, tuple[float, float]] = {}
        self._comm: dict[tuple, GroupComm | None] = {}
        self._bounds: dict[tuple, float] = {}
        self._plans: dict[Plan, tuple[float, float, list]] = {}

    def _stage(self, spec: StageSpec, shape: Shape) -> tuple[float, ...]:
        """(fwd, bwd_input, bwd_weight, activation bytes, transient bytes) of a stage, cached."""
        key = (spec, shape)
        if key not in self._times:
            c = self.p.cost.stage_cost(spec, WorkShape(*shape))
            self._times[key] = (float(c.fwd), float(c.bwd_input), float(c.bwd_weight), float(c.act_bytes),
                                float(np.max(np.maximum(c.transient_bytes, c.forward_transient_bytes))))
        return self._times[key]

    def _group_state(self, plan: Plan, layers: dict, module: Module, stages: tuple[int, ...], tp: int) -> tuple[float, float]:
        mp = plan.module(module)
        key = (module, layers[module], stages, tp, mp.dp, plan.zero, plan.hsdp, plan.fp32_grads, plan.placement)
        if key not in self._state:
            self._state[key] = group_state(plan, self.p.model, self.p.training, layers, module, stages, tp,
                                           self.p.cluster.gpus_per_node)
        return self._state[key]

    def _group_comm(self, plan: Plan, module: Module, stage: int, stages: tuple[int, ...],
                    params: float) -> GroupComm | None:
        mp = plan.module(module)
        key = (module, stage, stages, params, mp.tp, mp.dp, plan.zero, plan.hsdp, plan.fp32_grads, plan.placement,
               plan.encoder.gpus)
        if key not in self._comm:
            self._comm[key] = group_comm(plan, self.p.model, self.p.training, self.p.cluster, params, mp.tp,
                                         dp_group(plan, module, stage), module, stages, self.p.cost)
        return self._comm[key]

    def screen(self, plan: Plan, batching: Batching) -> Screen:
        """Memory at the largest bins ``batching`` makes; the estimate and bound (the same for every
        rule) once per plan."""
        if plan not in self._plans:
            self._plans[plan] = self._timing(plan)
        estimate, bound, ranks = self._plans[plan]
        ev = self.ev
        model = self.p.model
        per_bin = ev.pool.size / plan.bins
        tokens_cap, tiles_cap = ev.worst_bins(plan, batching)
        cap = (per_bin, tiles_cap, tokens_cap, tokens_cap * ev.max_tokens)
        chunk_cap = min(tiles_cap * plan.llm.dp / plan.encoder.dp + ev.max_tiles, tiles_cap * plan.llm.dp)
        memory, where = 0.0, ""
        for module, local, stages, specs, state, held in ranks:
            acts, transient = [], 0.0
            for s, spec in zip(stages, specs):
                c = self._stage(spec, (1, chunk_cap, 0, 0) if module == Module.ENCODER else cap)
                a, t = c[3], c[4]
                if plan.strategy.carries_encoder(module, (s,)):
                    enc = StageSpec(Module.ENCODER, model.encoder.layers, spec.tp, first=True, last=True,
                                    recompute=plan.recompute)
                    e = self._stage(enc, (per_bin, tiles_cap, 0, 0))
                    a, t = a + e[3], max(t, e[4])
                acts.append(a)
                transient = max(transient, t)
            if plan.heterogeneous:  # a chunk of its encoder phase while it runs; stage 0, its embeddings
                transient = max(transient, self._phase_chunk(plan))
                state += embedding_copies(self.p.training) * plan.microbatches * tokens_cap * model.llm.hidden \
                    * self.p.training.activation_bytes if local == 0 else 0.0
            need = state + max(sum(n * a for n, a in zip(moment, acts)) for moment in held) + transient
            if need > memory:
                memory, where = need, f"{module} pipeline rank {local}"
        return Screen(memory, where, bound, estimate)

    def _timing(self, plan: Plan) -> tuple[float, float, list]:
        """(estimate, bound, per rank: module, local rank, stage specs, state bytes, activations held
        per stage at the moments that may peak)."""
        p, ev = self.p, self.ev
        model, hw = p.model, p.cluster.hardware
        layers = {m: plan.stage_layers(m, model) for m in MODULES}
        groups = plan_groups(plan)
        virtual = plan.virtual_stages if plan.shares_gpus else 1
        held = inflight_by_stage(plan.schedule, len(groups) * virtual, plan.microbatches, virtual)
        per_bin = ev.pool.size / plan.bins
        avg_tokens = per_bin * ev.mean_tokens
        avg = (per_bin, per_bin * ev.mean_tiles, avg_tokens, avg_tokens * ev.mean_tokens, per_bin * ev.mean_targets)
        chunk_avg = ev.pool.size * ev.mean_tiles / (plan.encoder.dp * plan.microbatches)
        rank_time, rank_f, rank_i, rank_w, out, parts = [], [], [], [], [], {}
        for group in groups:
            module, local, stages, tp = group.module.value, group.rank, group.stages, group.tp
            specs = [StageSpec.of(module, layers[module], s, tp, plan.recompute) for s in stages]
            f = i = w = 0.0
            for s, spec in zip(stages, specs):
                t = self._stage(spec, (1, chunk_avg, 0, 0, 0) if module == Module.ENCODER else avg)
                if module == Module.LLM:
                    parts[Module.LLM] = t
                    if plan.strategy.carries_encoder(module, (s,)):
                        enc = StageSpec(Module.ENCODER, model.encoder.layers, tp, first=True, last=True,
                                        recompute=plan.recompute)
                        parts[Module.ENCODER] = self._stage(enc, (per_bin, avg[1], 0, 0, 0))
                        t = tuple(x + y for x, y in zip(t, parts[Module.ENCODER]))
                f, i, w = f + t[0], i + t[1], w + t[2]
            rank_time.append(f + i + w)
            rank_f.append(f)
            rank_i.append(i)
            rank_w.append(w)
            params, state = self._group_state(plan, layers, module, stages, tp)
            if plan.heterogeneous:
                state += self._phase_state(plan)
            out.append((module, local, stages, specs, state, held[group.index]))
            comm = self._group_comm(plan, module, local, stages, params)
            if comm is not None:
                rank_time[-1] += self._exposed(plan, comm, parts, i + w) / plan.microbatches
        estimate = closed_form(plan, virtual, rank_time, rank_f, rank_i, rank_w)
        if plan.heterogeneous:
            estimate += self._phase_time(plan)
        hidden = model.llm.hidden * p.training.activation_bytes * avg_tokens / plan.llm.tp
        estimate += 2 * (len(groups) - 1) * float(p2p_time(hidden, hw.inter_node_bandwidth * plan.llm.tp,
                                                      hw.inter_node_latency))
        return estimate, self.bound(plan), out

    def _phase_time(self, plan: Plan) -> float:
        """A heterogeneous encoder phase on average chunks (ENCODE, and ENCODE_B's forward again and
        backward, which a frozen encoder has not), and its gradient reduction's tail."""
        ev, m = self.ev, plan.microbatches
        chunk = ev.pool.size / (plan.encoder.dp * m)
        f, i, w, _, _ = self._stage(phase_spec(plan, self.p.model), (chunk, chunk * ev.mean_tiles, 0, 0))
        if self.p.training.freeze_encoder:
            return m * f
        params = stage_params(self.p.model, phase_spec(plan, self.p.model))
        comm = self._group_comm(plan, Module.ENCODER, 0, (0,), params)
        return m * (2 * f + i + w) + (self._exposed(plan, comm, {}, i + w) if comm is not None else 0.0)

    def _phase_state(self, plan: Plan) -> float:
        """The encoder replica's weights, gradients and optimizer state on a GPU holding one (every rank
        is screened as if it did)."""
        key = ("phase", plan.encoder, plan.zero, plan.fp32_grads)
        if key not in self._state:
            self._state[key] = (0.0, phase_state(plan, self.p.model, self.p.training))
        return self._state[key][1]

    def _phase_chunk(self, plan: Plan) -> float:
        """Bytes a chunk of the phase holds while it runs, at the largest replica share (LPT: the mean
        plus one sample)."""
        ev, m = self.ev, plan.microbatches
        tiles = (ev.heaviest_tiles / plan.encoder.dp + ev.max_tiles) / m
        samples = ev.pool.size / (plan.encoder.dp * m) + 1
        _, _, _, act, transient = self._stage(phase_spec(plan, self.p.model), (samples, tiles, 0, 0))
        return act + transient

    def bound(self, plan: Plan) -> float:
        """The plan's proven lower bound, once per pipeline shape: it reads neither the memory
        options (ZeRO, HSDP, gradient width) nor the microbatch count."""
        shape = (plan.encoder, plan.llm, plan.placement, plan.schedule, plan.virtual_stages, plan.recompute)
        if shape not in self._bounds:
            self._bounds[shape] = self.ev.lower_bound(plan, self.n)
        return self._bounds[shape]

    def _exposed(self, plan: Plan, comm: GroupComm, parts: dict, backward: float) -> float:
        """Seconds per step the rank's data-parallel communication adds beyond its compute, on
        average microbatches (``backward``: one microbatch's backward on the rank)."""
        m, s = plan.microbatches, self.p.cluster.hardware.comm_slowdown
        if comm.units is not None:
            fwd = {k: v[0] for k, v in parts.items()}
            bwd = {k: v[1] + v[2] for k, v in parts.items()}
            g_f, t_f, _ = fsdp_op(Kind.F, comm.units, fwd, s)
            g_b, t_b, _ = fsdp_op(Kind.B, comm.units, bwd, s)
            return m * (g_f + g_b + float(t_f) + float(t_b) - sum(fwd.values()) - sum(bwd.values()))
        if comm.inline:  # measured FSDP2 units: inside every backward
            return m * comm.reduce
        total = comm.reduce + comm.gather
        tail = float(bucket_lag(backward, total, comm.buckets)) + total - backward
        if plan.strategy.reduces_every_backward:  # every microbatch reduce-scatters beside its backward
            tail += (m - 1) * max(0.0, comm.reduce - backward)
        return max(tail, 0.0)
