"""The data-aware 3D-parallelism optimizer, and the baselines it is measured against.

For each (space, batching rule) searched (dflop's space with dflop's balanced
bins; each baseline space with each baseline batching rule):

1. enumerate every plan the topology allows, with its memory options (ZeRO,
   hybrid sharding, gradient width) minus the provably dominated ones, each
   with the least recomputation that fits;
2. drop plans that do not fit in memory (their largest possible bins);
3. order the rest by a closed-form estimate and evaluate them on sampled
   batches (bins + fast evaluator), skipping every plan whose proven lower
   bound is no better than the best time already measured, and stopping after
   ``budget`` evaluations (``exhaustive`` evaluates everything the bound allows);
4. refine the leaders with more batches until the paired confidence interval
   separates them from the best (or ``most`` batches);
5. time the best few of every search on all ``most`` batches, so that the
   final comparisons are paired (the same batches for every plan and rule).

Every baseline's best plan is then also timed with dflop's bins (kept, where
dflop's usual bins would not fit it, to the bin sizes it was sized for); those, and
the baselines as they are, join dflop's candidates (dflop's space contains
every baseline space), so dflop's choice is never slower than a baseline under
the same model. The speedup is against the strongest baseline; it splits into
a *plan gain* (dflop's plan vs the strongest baseline's plan, both with dflop's
bins) and a *balance gain* (that plan with dflop's bins vs with its own rule).
With a prediction error, the chosen plans are timed again on batches whose
costs differ from the predictions the bins were made from. A ``confirm``
function (SimPy, link contention on) adds simulated times of dflop's choice
and the strongest baseline, for the report; choices use the fast evaluator.

dflop's searches and each (baseline space, rule) are independent units: with ``workers`` > 1 they
are spread over that many forked processes, each unit searching alone, so the answer is the one
a single process finds; the final timings (all ``most`` batches, the prediction error) are made
in the unit that found the plan, whose caches hold its bins.

With ``max_seconds``, whatever is left when the deadline passes is not searched:
once dflop's search has timed one plan, the rest of its plans, the refinement,
the baselines, the timing at the prediction error and the SimPy confirmation
are skipped, and the result says which (``OptimizeResult.not_searched``).
"""

from __future__ import annotations

import multiprocessing
import os
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dflop.cost.protocol import StageSpec
from dflop.errors import InfeasibleError
from dflop.plan.evaluate import BatchPool, Estimate, Evaluator, PlanningProblem
from dflop.plan.report import Baseline, OptimizeResult, explain, score
from dflop.plan.screen import Screener
from dflop.plan.space import BASELINES, DFLOP, Space, SpaceBuilder
from dflop.schedule.batching import RULES, Batching
from dflop.specs.hardware import GIB
from dflop.specs.plan import Module, Placement, Plan
from dflop.specs.progress import Progress

Confirm = Callable[[Plan, Batching], float]
"""(plan, batching) -> simulated step seconds."""
Unit = tuple[None, tuple[Space, ...]] | tuple[Space, Batching]
"""A search that runs alone: (None, dflop's spaces) or (a baseline space, one of its rules)."""


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
    batching: Batching
    ranked: list[Estimate]
    stats: SearchStats

    @property
    def best(self) -> Estimate:
        return min(self.ranked, key=score)


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
                 confirm_top: int = 3, progress: Progress | None = None, noise: float = 0.0,
                 max_seconds: float | None = None, workers: int = 1) -> None:
        self.p = problem
        self.pool = BatchPool(problem.data, global_batch, problem.seed)
        self.ev = Evaluator(problem, self.pool, cap_batches=max(most, first))
        self.noisy = self.ev.with_noise(noise) if noise > 0 else None
        self.screener = Screener(self.ev, first)
        self.spaces = SpaceBuilder(problem, global_batch)
        self.first, self.most, self.budget = first, max(most, first), budget
        self.exhaustive, self.confirm, self.confirm_top = exhaustive, confirm, confirm_top
        self.progress = progress or (lambda what, done, total: None)
        self.usable = problem.cluster.hardware.usable_memory_bytes
        self.max_seconds = max_seconds
        self.workers = workers
        self.deadline = float("inf")
        self.skipped: list[str] = []
        """What the deadline left out, in words."""

    def late(self) -> bool:
        return time.perf_counter() > self.deadline

    def split_bound(self, encoder_gpus: int) -> float:
        """Proven lower bound of every disaggregated plan giving the encoder ``encoder_gpus`` GPUs:
        each module's whole work on one GPU (the most efficient), spread over its GPUs."""
        model, n = self.p.model, self.first
        enc = self.ev._whole_batch(StageSpec(Module.ENCODER, model.encoder.layers, 1, first=True, last=True), n)
        llm = self.ev._whole_batch(StageSpec(Module.LLM, model.llm.layers, 1, first=True, last=True), n)
        return float(np.mean(np.maximum(enc / encoder_gpus, llm / (self.p.cluster.gpus - encoder_gpus))))

    def _fitting(self, options: list[Plan], batching: Batching, stats: SearchStats, short: list) -> tuple | None:
        """(estimate, bound, options from the first that fits on) of one plan's recomputation options."""
        for k, plan in enumerate(options):
            s = self.screener.screen(plan, batching)
            if s.memory <= self.usable:
                return s.estimate, s.bound, options[k:]
            if not short or s.memory < short[0][0]:
                short[:] = [(s.memory, plan, s.memory_rank)]
        stats.pruned_memory += 1
        return None

    def _evaluate(self, options: list[Plan], batching: Batching, bound: float) -> Estimate | None:
        """The first recomputation option whose evaluated bins fit."""
        for plan in options:
            if plan is not options[0] and self.screener.screen(plan, batching).memory > self.usable:
                continue
            e = self.ev.extend(Estimate(plan, batching, bound), self.first)
            if not e.infeasible and e.peak_memory <= self.usable:
                return e
        return None

    def search(self, space: Space, batching: Batching = Batching.BALANCED) -> SpaceResult:
        """Colocated plans first: they are few, and the time they reach bounds the disaggregated
        search from the start (whole encoder/LLM GPU splits are skipped by ``split_bound``)."""
        stats = SearchStats()
        ranked: list[Estimate] = []
        best = [float("inf")]
        short: list = []

        def skip(encoder_gpus: int) -> bool:
            if self.split_bound(encoder_gpus) >= best[0]:
                stats.pruned_splits += 1
                return True
            return False

        what = f"{space.name} {batching}"
        for placement in (Placement.COLOCATED, Placement.HETEROGENEOUS, Placement.DISAGGREGATED):
            if ranked and self.late():
                self.skipped.append(f"{what} {placement} plans")
                continue
            screened = []
            for options in self.spaces.plans(space, placement, skip):
                if ranked and self.late():
                    self.skipped.append(f"the rest of the {what} {placement} plans")
                    break
                stats.enumerated += 1
                if min(self.screener.bound(plan) for plan in options) >= best[0]:  # whichever option
                    stats.pruned_bound += 1  # fits, it is skipped below: spare its memory and estimate
                    continue
                found = self._fitting(options, batching, stats, short)
                if found is not None:
                    screened.append(found)
            screened.sort(key=lambda x: (x[0], x[1]))
            for k, (_, bound, options) in enumerate(screened):
                self.progress(f"{what} {placement}", k, len(screened))
                if ranked and self.late():
                    self.skipped.append(f"{len(screened) - k} of {len(screened)} {what} {placement} plans")
                    break
                if bound >= best[0]:
                    stats.pruned_bound += 1
                    continue
                if not self.exhaustive and self.budget is not None and stats.evaluated >= self.budget:
                    stats.not_evaluated += 1
                    continue
                stats.evaluated += 1
                e = self._evaluate(options, batching, bound)
                if e is None:  # bins larger than screened for: out
                    stats.pruned_memory += 1
                    continue
                ranked.append(e)
                best[0] = min(best[0], e.mean)
            self.progress(f"{what} {placement}", len(screened), len(screened))
        if not ranked:
            self._no_fit(space, short[0] if short else None)
        if self.late():
            self.skipped.append(f"refining {what}")
        else:
            self._refine(ranked)
        ranked = [e for e in ranked if not e.infeasible and e.peak_memory <= self.usable]
        stats.batches = sum(e.n for e in ranked)
        return SpaceResult(space.name, batching, sorted(ranked, key=lambda e: e.mean), stats)

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

    def _settle(self, estimates: list[Estimate]) -> list[Estimate]:
        """``estimates`` timed on all ``most`` batches (the same for every one), those that still
        fit, fastest first: the final comparisons are paired, never between different batches."""
        for e in estimates:
            self.ev.extend(e, self.most)
        return sorted((e for e in estimates if not e.infeasible and e.peak_memory <= self.usable), key=score)

    def _confirm(self, estimates: list[Estimate]) -> None:
        """SimPy's step times (link contention on), reported beside the fast evaluator's."""
        if self.confirm is None:
            return
        for e in estimates:
            if e is not None and e.simulated is None:
                e.simulated = self.confirm(e.plan, e.batching)

    def ideal(self) -> float:
        model = self.p.model
        llm = StageSpec(Module.LLM, model.llm.layers, 1, first=True, last=True)
        enc = StageSpec(Module.ENCODER, model.encoder.layers, 1, first=True, last=True)
        whole = self.ev._whole_batch(llm, self.first) + self.ev._whole_batch(enc, self.first)
        return float(np.mean(whole)) / self.p.cluster.gpus

    def _mine(self, spaces: tuple[Space, ...]) -> tuple[dict, list[Estimate]]:
        """dflop's searches: their stats, and their best plans timed on all ``most`` batches (the
        best few, and the best without an encoder phase)."""
        mine = [self.search(s) for s in spaces]
        stats = {f"{r.space}:{r.batching}": r.stats for r in mine}
        pool = self._settle(sorted((e for r in mine for e in r.ranked), key=score)[:self.confirm_top])
        pool += self._settle(sorted((e for r in mine for e in r.ranked if not e.plan.heterogeneous), key=score)[:1])
        self._time_at_error(pool)
        return stats, pool

    def baseline(self, space: Space, rule: Batching) -> tuple[Baseline, dict]:
        """A baseline space under one of its framework's rules: its best plan, or why it has none;
        and that plan timed with dflop's bins."""
        if self.late():
            self.skipped.append(f"baseline {space.name} / {rule}")
            return Baseline(space.name, rule, None, None, "not searched: the deadline passed"), {}
        try:
            r = self.search(space, rule)
        except InfeasibleError as exc:
            return Baseline(space.name, rule, None, None, str(exc)), {}
        stats = {f"{space.name}:{rule}": r.stats}
        settled = self._settle(r.ranked[:self.confirm_top])
        if not settled:
            return Baseline(space.name, rule, None, None, "its best plans outgrow memory on later batches"), stats
        best = settled[0]
        balanced = self._twin(best, rule)
        self._time_at_error([best] + ([balanced] if balanced else []))
        why = "" if balanced else "its plan does not fit with dflop's bins"
        return Baseline(space.name, rule, best, balanced, why), stats

    def _time_at_error(self, estimates: list[Estimate]) -> None:
        """Each final estimate's ``at_error``: its bins made from the predictions, timed on all ``most``
        batches as the world costs them (where the optimizer has a ``noise``)."""
        if self.noisy is None:
            return
        if self.late():
            self.skipped.append("the timing at the prediction error")
            return
        for e in estimates:
            if e.at_error is None:
                again = Estimate(e.plan, e.batching, e.lower_bound, within=e.within)
                e.at_error = self.noisy.extend(again, self.most).mean

    def _unit(self, unit: Unit) -> tuple[tuple, list[str]]:
        """One unit of the search (dflop's spaces, or one baseline space and rule), and what the
        deadline left out of it."""
        before = len(self.skipped)
        found = self._mine(unit[1]) if unit[0] is None else self.baseline(*unit)
        skipped = self.skipped[before:]
        del self.skipped[before:]
        return found, skipped

    def _units(self, units: list[Unit]) -> list[tuple]:
        """Every unit's result, in order: in this process, or spread over ``workers`` forked
        processes (each unit searches alone; every result is the one this process would find).
        Forked, not spawned: a worker starts at once with the problem, its batches and the
        compiled partitioners, and nothing is pickled on the way in."""
        workers = min(self.workers, len(units))
        if (workers <= 1 or "fork" not in multiprocessing.get_all_start_methods()
                or multiprocessing.current_process().daemon):  # a pool's worker may start no process
            done = [self._unit(u) for u in units]
        else:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                     initializer=_adopt, initargs=(self, units)) as pool:
                futures = [pool.submit(_work, k) for k in range(len(units))]  # dflop's, the longest, first
                for k, _ in enumerate(as_completed(futures)):
                    self.progress("every space's", k + 1, len(units))
                done = [future.result() for future in futures]
            for warned in dict.fromkeys(w for _, _, said in done for w in said):  # said here, once each
                warnings.warn_explicit(*warned)
            done = [(found, skipped) for found, skipped, _ in done]
        for _, skipped in done:
            self.skipped += skipped
        return [found for found, _ in done]

    def _twin(self, best: Estimate, rule: Batching) -> Estimate | None:
        """A baseline's plan with dflop's bins: within dflop's usual bin caps, or, where those bins
        would not fit that plan's memory, within the largest bins its own rule made."""
        for within in (None, rule):
            twin = self.ev.extend(Estimate(best.plan, Batching.BALANCED, best.lower_bound, within=within), self.most)
            if not twin.infeasible and twin.peak_memory <= self.usable:
                return twin
        return None

    def run(self, spaces: tuple[Space, ...] = (DFLOP,), baselines: tuple[Space, ...] = BASELINES,
            rules: tuple[Batching, ...] = tuple(RULES)) -> OptimizeResult:
        start = time.perf_counter()
        if self.max_seconds is not None:
            self.deadline = start + self.max_seconds
        units: list[Unit] = [(None, spaces)] + [(space, rule) for space in baselines for rule in rules
                                                 if rule in space.rules]
        (stats, pool), *base_found = self._units(units)
        base = [b for b, _ in base_found]
        for _, found in base_found:
            stats.update(found)
        pool += [e for b in base for e in (b.best, b.balanced) if e is not None]
        unique = {(e.plan, e.batching, e.within): e for e in sorted(pool, key=score, reverse=True)}
        ranked = sorted(unique.values(), key=score)
        result = OptimizeResult(ranked[0], ranked[1:6], base, stats, 0.0, self.ideal(), self.p.cluster.hardware)
        if ranked[0].plan.heterogeneous:  # the layout gain is over the best plan without an encoder phase
            result.homogeneous = min((e for e in ranked if not e.plan.heterogeneous), key=score, default=None)
        if self.confirm is not None and self.late():
            self.skipped.append("the SimPy confirmation")
        else:
            self._confirm([result.best] + ([result.strongest.best, result.strongest.balanced]
                                           if result.strongest else []))
        if self.noisy is not None and all(e.at_error is not None for e in result.judged()):
            result.noise = self.noisy.noise
        result.why = explain(result, self.usable)
        if self.skipped:
            result.not_searched = (f"deadline of {self.max_seconds:g} s reached; not searched: "
                                   + ", ".join(dict.fromkeys(self.skipped)))
        result.seconds = time.perf_counter() - start
        return result


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_WORKER: list = []
"""In a worker process only: the optimizer it was forked with and the units to run."""


def _adopt(optimizer: Optimizer, units: list[Unit]) -> None:
    optimizer.progress = lambda what, done, total: None  # the parent reports the units as they finish
    _WORKER[:] = [optimizer, units]


def _work(k: int) -> tuple[tuple, list[str], list[tuple]]:
    """Unit ``k``, and the warnings it gave, for the parent to give (a worker writes nothing)."""
    optimizer, units = _WORKER
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        found, skipped = optimizer._unit(units[k])
    return found, skipped, [(str(w.message), w.category, w.filename, w.lineno) for w in caught]


def optimize(problem: PlanningProblem, global_batch: int, **options) -> OptimizeResult:
    spaces = options.pop("spaces", (DFLOP,))
    baselines = options.pop("baselines", BASELINES)
    rules = options.pop("rules", tuple(RULES))
    return Optimizer(problem, global_batch, **options).run(spaces, baselines, rules)
