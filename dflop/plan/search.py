"""The data-aware 3D-parallelism optimizer.

For each space (dflop's, and the data-blind baselines' restricted spaces):

1. enumerate every plan the topology allows;
2. drop plans that do not fit in memory (their largest possible bins);
3. order the rest by a closed-form estimate and evaluate them on sampled
   batches (scheduler + fast evaluator), skipping every plan whose proven lower
   bound is no better than the best time already measured, and stopping after
   ``budget`` evaluations (``exhaustive`` evaluates everything the bound allows);
4. refine the leaders with more batches until the paired confidence interval
   separates them from the best (or ``most`` batches);
5. re-run the best few in the SimPy simulator (link contention included), when
   a ``confirm`` function is given, and pick the fastest there.

The speedup is always against the best plan of the best baseline space.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dflop.cost.protocol import StageSpec
from dflop.errors import InfeasibleError
from dflop.plan.evaluate import BatchPool, Estimate, Evaluator, PlanningProblem
from dflop.plan.screen import Screener
from dflop.plan.space import BASELINES, DFLOP, Space, SpaceBuilder
from dflop.specs.hardware import GIB
from dflop.specs.plan import Placement, Plan

Progress = Callable[[str, int, int], None]
"""(what, done, total)."""
Confirm = Callable[[Plan, bool], float]
"""(plan, data_aware) -> simulated step seconds."""


@dataclass
class SearchStats:
    enumerated: int = 0
    pruned_memory: int = 0
    pruned_bound: int = 0
    not_evaluated: int = 0
    """Left out by the evaluation budget (ranked low by the estimate, not proven worse)."""
    pruned_splits: int = 0
    """Whole encoder/LLM GPU splits skipped by their proven bound (their plans never enumerated)."""
    evaluated: int = 0
    batches: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class SpaceResult:
    space: str
    ranked: list[Estimate]
    stats: SearchStats

    @property
    def best(self) -> Estimate:
        return min(self.ranked, key=_score)


@dataclass
class OptimizeResult:
    best: Estimate
    alternatives: list[Estimate]
    baselines: dict[str, Estimate]
    stats: dict[str, SearchStats]
    seconds: float
    ideal_s: float
    """All compute of a batch spread evenly over all GPUs at the hardware's efficiency."""
    why: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> Estimate:
        return min(self.baselines.values(), key=_score)

    @property
    def speedup(self) -> float:
        return _score(self.baseline) / _score(self.best)

    def to_json(self) -> dict:
        base = self.baseline
        return {"plan": self.best.summary(), "alternatives": [e.summary() for e in self.alternatives],
                "baseline": {"space": next(k for k, v in self.baselines.items() if v is base), **base.summary()},
                "baselines": {k: v.summary() for k, v in self.baselines.items()},
                "speedup": self.speedup, "ideal_step_time_s": self.ideal_s,
                "search_seconds": self.seconds, "pruning": {k: v.as_dict() for k, v in self.stats.items()},
                "why": self.why}


def _score(e: Estimate) -> float:
    return e.simulated if e.simulated is not None else e.mean


def _paired_worse(a: Estimate, b: Estimate) -> bool:
    """True when ``a`` is slower than ``b`` beyond doubt (95% CI of the paired difference > 0)."""
    n = min(a.n, b.n)
    if n < 2:
        return False
    diff = np.array(a.steps[:n]) - np.array(b.steps[:n])
    return float(diff.mean() - 1.96 * diff.std(ddof=1) / np.sqrt(n)) > 0


class Optimizer:
    def __init__(self, problem: PlanningProblem, global_batch: int, *, first: int = 3, most: int = 12,
                 budget: int | None = 48, exhaustive: bool = False, confirm: Confirm | None = None,
                 confirm_top: int = 3, progress: Progress | None = None) -> None:
        self.p = problem
        self.pool = BatchPool(problem.data, global_batch, problem.seed)
        self.ev = Evaluator(problem, self.pool, cap_batches=max(most, first))
        self.screener = Screener(self.ev, first)
        self.spaces = SpaceBuilder(problem, global_batch)
        self.first, self.most, self.budget = first, max(most, first), budget
        self.exhaustive, self.confirm, self.confirm_top = exhaustive, confirm, confirm_top
        self.progress = progress or (lambda what, done, total: None)
        self.usable = problem.cluster.hardware.usable_memory_bytes

    def split_bound(self, encoder_gpus: int) -> float:
        """Proven lower bound of every disaggregated plan giving the encoder ``encoder_gpus`` GPUs:
        each module's whole work on one GPU (the most efficient), spread over its GPUs."""
        model, n = self.p.model, self.first
        enc = self.ev._whole_batch(StageSpec("encoder", model.encoder.layers, 1, first=True, last=True), n)
        llm = self.ev._whole_batch(StageSpec("llm", model.llm.layers, 1, first=True, last=True), n)
        return float(np.mean(np.maximum(enc / encoder_gpus, llm / (self.p.cluster.gpus - encoder_gpus))))

    def search(self, space: Space) -> SpaceResult:
        """Colocated plans first: they are few, and the time they reach bounds the disaggregated
        search from the start (whole encoder/LLM GPU splits are skipped by ``split_bound``)."""
        stats = SearchStats()
        ranked: list[Estimate] = []
        best = [float("inf")]
        short = None

        def skip(encoder_gpus: int) -> bool:
            if self.split_bound(encoder_gpus) >= best[0]:
                stats.pruned_splits += 1
                return True
            return False

        for placement in (Placement.COLOCATED, Placement.DISAGGREGATED):
            screened = []
            for plan in self.spaces.plans(space, placement, skip):
                stats.enumerated += 1
                s = self.screener.screen(plan, space.data_aware)
                if s.memory > self.usable:
                    stats.pruned_memory += 1
                    if short is None or s.memory < short[0]:
                        short = (s.memory, plan, s.memory_rank)
                    continue
                screened.append((s.estimate, s.bound, plan))
            screened.sort(key=lambda x: (x[0], x[1]))
            for k, (_, bound, plan) in enumerate(screened):
                self.progress(f"{space.name} {placement}", k, len(screened))
                if bound >= best[0]:
                    stats.pruned_bound += 1
                    continue
                if not self.exhaustive and self.budget is not None and stats.evaluated >= self.budget:
                    stats.not_evaluated += 1
                    continue
                e = self.ev.extend(Estimate(plan, space.data_aware, bound), self.first)
                stats.evaluated += 1
                if e.infeasible or e.peak_memory > self.usable:  # bins larger than screened for: out
                    stats.pruned_memory += 1
                    continue
                ranked.append(e)
                best[0] = min(best[0], e.mean)
            self.progress(f"{space.name} {placement}", len(screened), len(screened))
        if not ranked:
            self._no_fit(space, short)
        self._refine(ranked)
        ranked = [e for e in ranked if not e.infeasible and e.peak_memory <= self.usable]
        stats.batches = sum(e.n for e in ranked)
        return SpaceResult(space.name, sorted(ranked, key=lambda e: e.mean), stats)

    def _no_fit(self, space: Space, short) -> None:
        hw = self.p.cluster.hardware
        if short is None:
            raise InfeasibleError(f"no {space.name} plan for {self.p.cluster.gpus} x {hw.name} and a global batch "
                                  f"of {self.pool.size}")
        need, plan, where = short
        raise InfeasibleError(
            f"no {space.name} plan fits {self.p.cluster.gpus} x {hw.name}: the closest, [{plan.describe()}], "
            f"needs {need / GIB:.1f} GiB on its {where} but {self.usable / GIB:.1f} GiB are usable "
            f"({(need - self.usable) / GIB:.1f} GiB short)")

    def _refine(self, ranked: list[Estimate], leaders: int = 5) -> None:
        """More batches for the leaders until each is told apart from the best (or ``most``)."""
        top = sorted(ranked, key=lambda e: e.mean)[:leaders]
        while True:
            top = [e for e in top if not e.infeasible]
            if not top:
                return
            best = min(top, key=lambda e: e.mean)
            open_ = [e for e in top if e is not best and e.n < self.most and not _paired_worse(e, best)]
            if not open_:
                return
            for e in open_ + ([best] if best.n < self.most else []):
                self.ev.extend(e, min(self.most, e.n + self.first))

    def _confirm(self, result: SpaceResult) -> None:
        if self.confirm is None:
            return
        for e in result.ranked[:self.confirm_top]:
            e.simulated = self.confirm(e.plan, e.data_aware)

    def ideal(self) -> float:
        model = self.p.model
        llm = StageSpec("llm", model.llm.layers, 1, first=True, last=True)
        enc = StageSpec("encoder", model.encoder.layers, 1, first=True, last=True)
        whole = self.ev._whole_batch(llm, self.first) + self.ev._whole_batch(enc, self.first)
        return float(np.mean(whole)) / self.p.cluster.gpus

    def run(self, spaces: tuple[Space, ...] = (DFLOP,), baselines: tuple[Space, ...] = BASELINES) -> OptimizeResult:
        start = time.perf_counter()
        mine = [self.search(s) for s in spaces]
        results = {s.name: r for s, r in zip(spaces, mine)}
        for r in mine:
            self._confirm(r)
        base: dict[str, Estimate] = {}
        for space in baselines:
            try:
                r = self.search(space)
            except InfeasibleError:
                continue  # a baseline space with no fitting plan is simply absent
            self._confirm(r)
            results[space.name] = r
            base[space.name] = r.best
        winner = min((r.best for r in mine), key=_score)
        pool = sorted((e for r in mine for e in r.ranked), key=_score)
        alternatives = [e for e in pool if e is not winner][:5]
        result = OptimizeResult(winner, alternatives, base, {k: r.stats for k, r in results.items()},
                                time.perf_counter() - start, self.ideal())
        result.why = explain(result, self.usable)
        return result


def explain(result: OptimizeResult, usable: float) -> list[str]:
    """Why the winner wins, in the terms a person would check: bubbles, balance, memory."""
    w = result.best
    out = []
    if result.baselines:
        b = result.baseline
        out.append(f"{result.speedup:.2f}x faster than the best data-blind baseline [{b.plan.describe()}]: "
                   f"step {_score(w):.3f} s vs {_score(b):.3f} s")
        out.append(f"bubbles {np.mean(w.bubble):.1%} vs {np.mean(b.bubble):.1%}; bins within "
                   f"{np.mean(w.imbalance):.3f}x of the mean vs {np.mean(b.imbalance):.3f}x")
        out.append(f"peak memory {w.peak_memory / GIB:.1f} GiB vs {b.peak_memory / GIB:.1f} GiB "
                   f"of {usable / GIB:.1f} GiB usable")
    if result.alternatives:
        a = result.alternatives[0]
        gap = _score(a) / _score(w) - 1
        out.append(f"runner-up [{a.plan.describe()}] is {gap:.1%} slower "
                   f"(bubbles {np.mean(a.bubble):.1%}, {a.n} batches)")
    return out


def optimize(problem: PlanningProblem, global_batch: int, **options) -> OptimizeResult:
    spaces = options.pop("spaces", (DFLOP,))
    baselines = options.pop("baselines", BASELINES)
    return Optimizer(problem, global_batch, **options).run(spaces, baselines)
