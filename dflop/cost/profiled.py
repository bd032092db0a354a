"""The profiled cost model: times and memory fitted to measurements, same protocol as the analytical one.

For each module, phase (block, embed, head, projector) and tensor-parallel
degree, time is fitted as

    t(x) = a + sum_i w_i * min(x, k_i) + w * x  (+ c * sum of squared lengths, LLM blocks)

with every coefficient >= 0, x the tokens (LLM) or tiles (encoder) and k_i the
profiled grid points: piecewise linear, increasing, concave in x, and additive
in the attention term. Those properties are not cosmetic: they keep time
subadditive, which the optimizer's pruning bounds rely on. Memory is fitted
the same way (linear in x). The fit weights relative error, as times span
decades. Shapes beyond the profiled range are extrapolated along the last
segment, with a warning; ``holdout_error`` reports the error on measured
shapes the fit never saw.

What a profile cannot tell (how backward splits into input and weight
gradients, the tensor-parallel all-reduces, full recomputation) comes from the
analytical model, as does every tensor-parallel degree that was not profiled
(the tp=1 compute divided by tp).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflop.cost.analytical import AnalyticalCostModel
from dflop.cost.protocol import StageCost, StageSpec, WorkShape
from dflop.specs.hardware import HardwareSpec, TrainingSpec
from dflop.specs.models import MLLMSpec


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 500) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iterations):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max(initial=0) <= 1e-12 * max(1.0, np.abs(gradient).max()):
            break
        j = int(np.argmax(np.where(passive, -np.inf, gradient)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            shrink = passive & (z <= 0)
            alpha = np.min(x[shrink] / (x[shrink] - z[shrink]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


@dataclass(frozen=True)
class Fit:
    knots: tuple[float, ...]
    coef: np.ndarray
    top: float
    """Largest x profiled."""
    quadratic: bool

    @staticmethod
    def basis(x: np.ndarray, sq: np.ndarray | None, knots: tuple[float, ...]) -> np.ndarray:
        cols = [np.ones_like(x)] + [np.minimum(x, k) for k in knots] + [x]
        if sq is not None:
            cols.append(sq)
        return np.stack(cols, axis=-1)

    @classmethod
    def of(cls, x: np.ndarray, y: np.ndarray, sq: np.ndarray | None = None) -> "Fit":
        grid = sorted(set(x.tolist()))
        knots = tuple(grid[1:-1]) if len(grid) > 3 else ()
        a = cls.basis(x, sq, knots)
        weight = 1.0 / np.maximum(y, 1e-12)
        coef = nnls(a * weight[:, None], y * weight)
        return cls(knots, coef, float(max(grid)), sq is not None)

    def __call__(self, x: Any, sq: Any = None) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        sq = np.asarray(sq, dtype=float) if self.quadratic else None
        value = self.basis(x, np.broadcast_to(sq, x.shape) if sq is not None else None, self.knots) @ self.coef
        return np.where(x > 0, value, 0.0)


def _shape_x(record: dict) -> tuple[float, float | None]:
    shape = record["shape"]
    if "tiles" in shape:
        return float(shape["tiles"]), None
    tokens, seq = shape["tokens"], shape.get("seq", shape["tokens"])
    full, rest = divmod(tokens, seq)
    return float(tokens), float(full * seq * seq + rest * rest) if "seq" in shape else None


def fit(records: list[dict]) -> dict[tuple, Fit]:
    """Fits keyed by (module, phase, tp, quantity), on every record not held out."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if not r.get("holdout"):
            groups[(r["module"], r["phase"], r["tp"])].append(r)
    fits = {}
    for key, rows in groups.items():
        xs = [_shape_x(r) for r in rows]
        x = np.array([v[0] for v in xs])
        sq = np.array([v[1] for v in xs]) if key[1] == "block" and xs[0][1] is not None else None
        for name in ("fwd_ms", "bwd_ms", "memory_bytes"):
            y = np.array([r[name] for r in rows], dtype=float)
            fits[key + (name,)] = Fit.of(x, y, sq if name != "memory_bytes" else None)
    return fits


def holdout_error(records: list[dict], fits: dict[tuple, Fit] | None = None) -> dict[str, float]:
    """Relative error of the fits on the held-out measurements (forward and backward)."""
    fits = fit(records) if fits is None else fits
    errors = []
    for r in records:
        if not r.get("holdout") or (r["module"], r["phase"], r["tp"], "fwd_ms") not in fits:
            continue
        x, sq = _shape_x(r)
        for name in ("fwd_ms", "bwd_ms"):
            f = fits[(r["module"], r["phase"], r["tp"], name)]
            predicted = float(f(np.array(x), np.array(sq) if sq is not None else None))
            errors.append(abs(predicted - r[name]) / r[name])
    if not errors:
        return {"median": float("nan"), "max": float("nan"), "shapes": 0}
    return {"median": float(np.median(errors)), "max": float(np.max(errors)), "shapes": len(errors) // 2}


@dataclass
class ProfiledCostModel:
    model: MLLMSpec
    hardware: HardwareSpec
    training: TrainingSpec
    records: list[dict]
    device: str
    dtype: str
    fits: dict[tuple, Fit] = field(default_factory=dict)
    _warned: set = field(default_factory=set)

    def __post_init__(self) -> None:
        self.analytical = AnalyticalCostModel(self.model, self.hardware, self.training)
        self.fits = fit(self.records)

    @property
    def name(self) -> str:
        return f"profiled ({self.device}, {self.dtype}, {len(self.records)} records)"

    def _part(self, module: str, phase: str, tp: int, x: np.ndarray, sq: np.ndarray | None) -> tuple:
        """(fwd s, bwd s, bytes) of one part on a tp shard; unprofiled tp divides tp=1's compute."""
        scale = 1.0
        if (module, phase, tp, "fwd_ms") not in self.fits:
            scale = 1.0 / tp
            tp = 1
        fwd = self.fits[(module, phase, tp, "fwd_ms")]
        if np.max(x, initial=0) > fwd.top * 1.0001 and (module, phase) not in self._warned:
            self._warned.add((module, phase))
            warnings.warn(f"profiled cost model: {module} {phase} at {np.max(x):.0f} is beyond the profiled "
                          f"range (up to {fwd.top:.0f}); extrapolating", stacklevel=3)
        f = fwd(x, sq) * 1e-3 * scale
        b = self.fits[(module, phase, tp, "bwd_ms")](x, sq) * 1e-3 * scale
        m = self.fits[(module, phase, tp, "memory_bytes")](x) * scale
        return f, b, m

    def stage_cost(self, stage: StageSpec, shape: WorkShape) -> StageCost:
        ref = self.analytical.stage_cost(stage, shape)
        if stage.module == "encoder":
            x, sq = np.asarray(shape.tiles, dtype=float), None
            extras = (["embed"] if stage.first else []) + (["projector"] if stage.last else [])
        else:
            x, sq = np.asarray(shape.tokens, dtype=float), np.asarray(shape.sum_sq, dtype=float)
            extras = (["embed"] if stage.first else []) + (["head"] if stage.last else [])
        f, b, m = self._part(stage.module, "block", stage.tp, x, sq)
        fwd, bwd, act = stage.layers * f, stage.layers * b, stage.layers * m
        if self.training.recompute == "full":
            bwd = bwd + fwd
            act = ref.act_bytes  # layer inputs only: the analytical count of what recomputation keeps
        for phase in extras:
            if (stage.module, phase, 1, "fwd_ms") in self.fits or (stage.module, phase, stage.tp, "fwd_ms") in self.fits:
                ef, eb, em = self._part(stage.module, phase, stage.tp, x, None)
                fwd, bwd = fwd + ef, bwd + eb
                if self.training.recompute != "full":
                    act = act + em
        comm = self.analytical.tp_comm(stage, shape)
        share = np.where(ref.bwd > 0, ref.bwd_weight / np.maximum(ref.bwd, 1e-30), 0.5)
        return StageCost(fwd + comm, bwd * (1 - share) + comm, bwd * share, act, ref.flops)

    def holdout_error(self) -> dict[str, float]:
        return holdout_error(self.records, self.fits)
