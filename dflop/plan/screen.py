"""Cheap per-candidate figures: memory, a proven lower bound, a closed-form estimate.

These run on every candidate, so everything is cached by the parts of a plan
it depends on. The *estimate* uses average-sized microbatches and the
schedules' closed forms with unequal stages (fill and drain through every
stage once, then the bottleneck stage once per further microbatch); it only
orders the candidates. The *bound* is what prunes: the slowest stage's share
of the whole batch, which no schedule can beat.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.cost.comm import p2p_time, ring_allreduce_time
from dflop.cost.protocol import StageSpec, WorkShape
from dflop.program.costing import group_state
from dflop.specs.plan import Plan
from dflop.plan.evaluate import Evaluator, inflight


@dataclass(frozen=True)
class Screen:
    memory: float
    memory_rank: str
    bound: float
    estimate: float


class Screener:
    def __init__(self, evaluator: Evaluator, bound_batches: int) -> None:
        self.ev, self.p = evaluator, evaluator.p
        self.n = bound_batches
        self._times: dict[tuple, tuple[float, float, float, float]] = {}
        self._state: dict[tuple, tuple[float, float]] = {}

    def _stage(self, spec: StageSpec, shape: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
        """(fwd, bwd_input, bwd_weight, activation bytes) of a stage, cached."""
        key = (spec, shape)
        if key not in self._times:
            c = self.p.cost.stage_cost(spec, WorkShape(*shape))
            self._times[key] = (float(c.fwd), float(c.bwd_input), float(c.bwd_weight), float(c.act_bytes))
        return self._times[key]

    def _group_state(self, plan: Plan, layers: dict, module: str, stages: tuple[int, ...], tp: int) -> tuple[float, float]:
        mp = plan.module(module)
        key = (module, layers[module], stages, tp, mp.dp, plan.zero, plan.placement)
        if key not in self._state:
            self._state[key] = group_state(plan, self.p.model, self.p.training, layers, module, stages, tp)
        return self._state[key]

    def screen(self, plan: Plan, data_aware: bool) -> Screen:
        p, ev = self.p, self.ev
        model, hw = p.model, p.cluster.hardware
        layers = {"encoder": plan.stage_layers("encoder", model), "llm": plan.stage_layers("llm", model)}
        colocated = plan.colocated
        enc_stages = 0 if colocated else plan.encoder.pp
        virtual = plan.virtual_stages if colocated else 1
        ranks = enc_stages + plan.llm.pp
        held = inflight(plan.schedule, ranks * virtual, plan.microbatches, virtual)

        size = ev.pool.size
        per_bin = size / plan.bins
        avg_tokens = per_bin * ev.mean_tokens
        avg = (per_bin, per_bin * ev.mean_tiles, avg_tokens, avg_tokens * ev.mean_tokens)
        tokens_cap, tiles_cap = ev.worst_bins(plan, data_aware)
        cap = (per_bin, tiles_cap, tokens_cap, tokens_cap * ev.max_tokens)
        chunk_avg = size * ev.mean_tiles / (plan.encoder.dp * plan.microbatches)
        chunk_cap = min(tiles_cap * plan.llm.dp / plan.encoder.dp + ev.max_tiles, tiles_cap * plan.llm.dp)

        rank_time, rank_fi, rank_w, memory, where = [], [], [], 0.0, ""
        for rank in range(ranks):
            module = "encoder" if rank < enc_stages else "llm"
            local = rank - (0 if module == "encoder" else enc_stages)
            mp = plan.module(module)
            stages = tuple(range(local, len(layers[module]), mp.pp)) if module == "llm" else (local,)
            f = i = w = act = 0.0
            for s in stages:
                spec = StageSpec.of(module, layers[module], s, mp.tp)
                if module == "encoder":
                    t, a = self._stage(spec, (1, chunk_avg, 0, 0)), self._stage(spec, (1, chunk_cap, 0, 0))[3]
                else:
                    t, a = self._stage(spec, avg), self._stage(spec, cap)[3]
                    if colocated and s == 0:
                        enc = StageSpec("encoder", model.encoder.layers, mp.tp, first=True, last=True)
                        e = self._stage(enc, (per_bin, avg[1], 0, 0))
                        t = tuple(x + y for x, y in zip(t, e))
                        a += self._stage(enc, (per_bin, tiles_cap, 0, 0))[3]
                f, i, w, act = f + t[0], i + t[1], w + t[2], max(act, a)
            rank_time.append(f + i + w)
            rank_fi.append(f + i)
            rank_w.append(w)
            _, state = self._group_state(plan, layers, module, stages, mp.tp)
            need = state + held[rank] * act
            if need > memory:
                memory, where = need, f"{module} pipeline rank {local}"

        m = plan.microbatches
        bottleneck = max(rank_time)
        if virtual > 1:
            estimate = (m + (plan.llm.pp - 1) / virtual) * bottleneck
        elif plan.schedule in ("ZBH1", "InterleavedZeroBubble"):
            estimate = m * bottleneck + sum(a - b for a, b in zip(rank_fi[:-1], rank_w[:-1]))
        else:
            estimate = (m - 1) * bottleneck + sum(rank_time)
        hidden = model.llm.hidden * p.training.activation_bytes * avg_tokens / plan.llm.tp
        estimate += 2 * (ranks - 1) * float(p2p_time(hidden, hw.inter_node_bandwidth * plan.llm.tp,
                                                      hw.inter_node_latency))
        params, _ = self._group_state(plan, layers, "llm", (0,), plan.llm.tp)
        if plan.zero != 3:
            estimate += float(ring_allreduce_time(params / plan.llm.tp * p.training.grad_bytes, plan.llm.dp,
                                                  hw.inter_node_bandwidth, hw.inter_node_latency))
        return Screen(memory, where, ev.lower_bound(plan, self.n), estimate)
