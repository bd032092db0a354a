"""What an optimization found, in the terms people check: the baselines, the speedup, where it comes from.

``OptimizeResult`` holds dflop's choice and every baseline (space x batching
rule): the best plan it found, or the reason it found none; the same plan with
dflop's bins. The speedup is against the strongest baseline and splits into
``plan_gain`` x ``balance_gain``; with a prediction error the same plans are
timed on costs that differ from the predictions (``at_error``). Every step
time comes with its MFU and HFU, and a prediction above the hardware's
plausible MFU is flagged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflop.plan.evaluate import Estimate
from dflop.schedule.batching import Batching
from dflop.specs.hardware import GIB, HardwareSpec


def score(e: Estimate) -> float:
    """The step time comparisons use: the fast evaluator's mean over the common batches."""
    return e.mean


@dataclass
class Baseline:
    space: str
    batching: Batching
    best: Estimate | None
    """Its best plan with its own batching rule (None: nothing fits)."""
    balanced: Estimate | None
    """That plan with dflop's balanced bins."""
    reason: str = ""
    """Why it has no plan (or why its plan has no balanced twin)."""

    @property
    def name(self) -> str:
        return f"{self.space} / {self.batching}"


@dataclass
class OptimizeResult:
    best: Estimate
    alternatives: list[Estimate]
    baselines: list[Baseline]
    stats: dict[str, Any]
    seconds: float
    ideal_s: float
    """All compute of a batch spread evenly over all GPUs at the hardware's efficiency."""
    hardware: HardwareSpec
    why: list[str] = field(default_factory=list)
    noise: float = 0.0
    """Per-sample prediction error (lognormal sigma) of ``at_error``; 0 when not measured."""
    not_searched: str = ""
    """What a search deadline left out, in one line ('' when everything was searched)."""
    homogeneous: Estimate | None = None
    """The best plan without a heterogeneous encoder phase (dflop's own or a baseline's with dflop's
    bins), when dflop's choice has one: the decomposition's layout gain is over it."""

    @property
    def at_error(self) -> dict[int, float]:
        """id(estimate) -> its mean step time when the world's costs differ from the predictions, for
        every estimate the report compares (empty when not measured)."""
        return {id(e): e.at_error for e in self.judged()} if self.noise else {}

    @property
    def without_phase(self) -> Estimate:
        """What the plan gain starts from: dflop's choice, or the best plan without an encoder phase."""
        return self.homogeneous if self.homogeneous is not None else self.best

    @property
    def found(self) -> list[Baseline]:
        return [b for b in self.baselines if b.best is not None]

    @property
    def strongest(self) -> Baseline | None:
        return min(self.found, key=lambda b: score(b.best), default=None)

    @property
    def speedup(self) -> float | None:
        b = self.strongest
        return score(b.best) / score(self.best) if b is not None else None

    @property
    def decomposition(self) -> dict[str, float] | None:
        """speedup = layout_gain x plan_gain x balance_gain: dflop's choice over the best plan without a
        heterogeneous encoder phase (1 when its choice has none), that over the strongest baseline's
        plan with dflop's bins, that over the same plan with the baseline's own rule."""
        b = self.strongest
        if b is None or b.balanced is None:
            return None
        h = self.without_phase
        return {"layout_gain": score(h) / score(self.best), "plan_gain": score(b.balanced) / score(h),
                "balance_gain": score(b.best) / score(b.balanced)}

    def judged(self) -> list[Estimate]:
        """The estimates the report compares (dflop's choice, the best without an encoder phase, every
        baseline and its balanced twin)."""
        return [self.best] + ([self.homogeneous] if self.homogeneous is not None else []) + [
            e for b in self.found for e in (b.best, b.balanced) if e is not None]

    def speedup_at_error(self) -> dict[str, float] | None:
        b = self.strongest
        if b is None or not self.at_error:
            return None
        mine = self.at_error[id(self.best)]
        out = {"sigma": self.noise, "step_time_s": mine, "baseline_step_time_s": self.at_error[id(b.best)],
               "speedup": self.at_error[id(b.best)] / mine}
        h = self.at_error[id(self.without_phase)]
        out["layout_gain"] = h / mine
        out["plan_gain"] = self.at_error[id(b.balanced)] / h if b.balanced is not None else None
        out["balance_gain"] = (self.at_error[id(b.best)] / self.at_error[id(b.balanced)]
                               if b.balanced is not None else None)
        return out

    def warnings(self) -> list[str]:
        return [w for name, e in [("dflop", self.best)] + [(b.name, b.best) for b in self.found]
                for w in implausible(name, float(np.mean(e.mfu)), self.hardware)]

    def entry(self, b: Baseline) -> dict[str, Any]:
        if b.best is None:
            return {"space": b.space, "batching": str(b.batching), "plan": None, "step_time_s": None, "mfu": None,
                    "reason": b.reason}
        e = b.best
        out = {"space": b.space, "batching": str(b.batching), "plan": e.plan.describe(), "step_time_s": score(e),
               "mfu": float(np.mean(e.mfu)), "hfu": float(np.mean(e.hfu)), "expected_step_time_s": e.mean,
               "simulated_step_time_s": e.simulated, "peak_memory_gib": e.peak_memory / GIB,
               "bubble_fraction": float(np.mean(e.bubble)), "imbalance": float(np.mean(e.imbalance)),
               "balanced_step_time_s": score(b.balanced) if b.balanced is not None else None, "reason": b.reason}
        if self.at_error:
            out["step_time_at_error_s"] = self.at_error[id(e)]
        return out

    def to_json(self) -> dict:
        strongest = self.strongest
        return {"plan": self.best.summary(), "alternatives": [e.summary() for e in self.alternatives],
                "baselines": [self.entry(b) for b in self.baselines],
                "baseline": ({**self.entry(strongest), **strongest.best.summary()} if strongest else None),
                "speedup": self.speedup, "decomposition": self.decomposition,
                "prediction_error": self.speedup_at_error(), "ideal_step_time_s": self.ideal_s,
                "search_seconds": self.seconds, "pruning": {k: v.as_dict() for k, v in self.stats.items()},
                "warnings": self.warnings(), "why": self.why, "not_searched": self.not_searched}


def implausible(name: str, mfu: float | None, hardware: HardwareSpec) -> list[str]:
    """A warning when a predicted MFU is above what the hardware plausibly reaches."""
    bound = hardware.plausible_mfu
    if mfu is None or mfu <= bound:
        return []
    return [f"{name}: predicted MFU {mfu:.1%} exceeds the plausible {bound:.0%} for {hardware.name} "
            + (f"(its efficiency curve is refitted from {hardware.calibrated_from})" if hardware.calibrated_from
               else "(the efficiency curve is an assumption, not calibrated on this GPU)")]


def explain(result: OptimizeResult, usable: float) -> list[str]:
    """Why the winner wins, in the terms a person would check: bubbles, balance, memory."""
    w = result.best
    out = []
    b = result.strongest
    if b is not None:
        base = b.best
        if base is w:
            out.append(f"no gain: the strongest baseline ({b.name}) is already the best plan found")
        else:
            out.append(f"{result.speedup:.2f}x faster than the strongest baseline ({b.name}) "
                       f"[{base.plan.describe()}]: step {score(w):.3f} s vs {score(base):.3f} s")
        d = result.decomposition
        if d is not None:
            layout = "" if result.homogeneous is None else (
                f"layout gain {d['layout_gain']:.2f}x (the best plan without an encoder phase: "
                f"{score(result.homogeneous):.3f} s), ")
            out.append(layout + f"plan gain {d['plan_gain']:.2f}x (its plan with dflop's bins: "
                       f"{score(b.balanced):.3f} s), balance gain {d['balance_gain']:.2f}x")
        else:
            out.append(f"no decomposition: {b.reason}")
        out.append(f"bubbles {np.mean(w.bubble):.1%} vs {np.mean(base.bubble):.1%}; bins within "
                   f"{np.mean(w.imbalance):.3f}x of the mean vs {np.mean(base.imbalance):.3f}x")
        out.append(f"peak memory {w.peak_memory / GIB:.1f} GiB vs {base.peak_memory / GIB:.1f} GiB "
                   f"of {usable / GIB:.1f} GiB usable")
    for none in (x for x in result.baselines if x.best is None):
        out.append(f"{none.name}: no plan ({none.reason})")
    if result.alternatives:
        a = result.alternatives[0]
        gap = score(a) / score(w) - 1
        out.append(f"runner-up [{a.plan.describe()}] ({a.batching}) is {gap:.1%} slower "
                   f"(bubbles {np.mean(a.bubble):.1%}, {a.n} batches)")
    return out
