"""The profiled cost model: times and memory fitted to measurements, same protocol as the analytical one.

For each module, phase (block, embed, head, projector) and tensor-parallel
degree, time is fitted as

    t(x) = a + sum_i w_i * min(x, k_i) + w * x  (+ c * sum of squared lengths + s * samples,
                                                  for LLM blocks over packed samples)

with every coefficient >= 0, x the tokens (LLM; for the head, the positions that predict
text, the only rows it runs on) or tiles (encoder) and k_i the
profiled grid points: piecewise linear, increasing, concave in x, and additive
in the attention term and in the per-sample overhead (a kernel per sample where
attention is not a single varlen kernel). Those properties are not cosmetic: they keep time
subadditive, which the optimizer's pruning bounds rely on. Memory is fitted
the same way (linear in x). The fit weights relative error, as times span
decades. Shapes beyond the profiled range are extrapolated along the last
segment, with a warning; ``holdout_error`` reports the error on measured
shapes the fit never saw.

Backward splits into input and weight gradients as in the analytical model:
the weight gradient is one GEMM per forward GEMM, so it takes half of the
backward's token- or tile-linear part, and the attention and per-sample terms
(and full recomputation) all go to the input gradient. The split is
subadditive too, and W ops of zero-bubble schedules inherit it. A TP degree
profiled in a real TP group (``tp_comm: measured``) holds its collectives in
its figures; one profiled as a shard alone gets the analytical model's
all-reduces, as does every TP degree that was not profiled (the tp=1 compute
divided by tp).

A profile measured with FSDP2's units (``fsdp_unit`` records, lock-step
processes on a CPU) prices what a sharded plan (ZeRO-2/3) adds to a unit from
them: seconds = a + b * parameters, all-gather and reduce-scatter apart, fitted
per shard count (``fsdp_unit``).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dflop.cost.analytical import AnalyticalCostModel
from dflop.cost.protocol import StageCost, StageSpec, WorkShape
from dflop.cost.store import FSDP_UNIT, TPComm, tp_comm_of
from dflop.errors import DflopError
from dflop.specs.hardware import HardwareSpec, TrainingSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module, Recompute


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
    packed: bool
    """Also a term in the sum of squared lengths and one per packed sample (LLM blocks)."""

    @staticmethod
    def basis(x: np.ndarray, knots: tuple[float, ...], sq: np.ndarray | None = None,
              samples: np.ndarray | None = None) -> np.ndarray:
        cols = [np.ones_like(x)] + [np.minimum(x, k) for k in knots] + [x]
        if sq is not None:
            cols += [sq, samples]
        return np.stack(cols, axis=-1)

    @classmethod
    def of(cls, x: np.ndarray, y: np.ndarray, sq: np.ndarray | None = None,
           samples: np.ndarray | None = None) -> "Fit":
        grid = sorted(set(x.tolist()))
        knots = tuple(grid[1:-1]) if len(grid) > 3 else ()
        a = cls.basis(x, knots, sq, samples)
        weight = 1.0 / np.maximum(y, 1e-12)
        coef = nnls(a * weight[:, None], y * weight)
        return cls(knots, coef, float(max(grid)), sq is not None)

    def __call__(self, x: Any, sq: Any = None, samples: Any = None) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        extra = ()
        if self.packed:
            extra = (np.broadcast_to(np.asarray(sq, dtype=float), x.shape),
                     np.broadcast_to(np.asarray(samples, dtype=float), x.shape))
        value = self.basis(x, self.knots, *extra) @ self.coef
        return np.where(x > 0, value, 0.0)


def _shape_x(record: dict) -> tuple[float, float | None, float | None]:
    """(tokens or tiles, sum of squared lengths, packed samples) of a record's shape."""
    shape = record["shape"]
    if "seq" not in shape:
        return float(shape.get("tiles", shape.get("tokens"))), None, None
    tokens, seq = shape["tokens"], shape["seq"]
    full, rest = divmod(tokens, seq)
    return float(tokens), float(full * seq * seq + rest * rest), float(full + (1 if rest else 0))


def comm_measured(records: list[dict]) -> set[tuple[str, int]]:
    """(module, tp) whose block records hold their TP collectives. A TP degree profiled both ways
    cannot be fitted as one: that is an error naming it."""
    ways: dict[tuple[str, int], set] = defaultdict(set)
    for r in records:
        if r["phase"] == "block" and r["tp"] > 1:
            ways[(r["module"], r["tp"])].add(tp_comm_of(r))
    for (module, tp), seen in ways.items():
        if len(seen) > 1:
            raise DflopError(f"profile: {module} tp{tp} mixes records measured in a real TP group with shards "
                             "measured alone (tp_comm); profile it again into one store, one way")
    return {key for key, seen in ways.items() if seen == {TPComm.MEASURED}}


def _grid_groups(records: list[dict]) -> dict[tuple, list[dict]]:
    """The records not held out, by (module, phase, tp): what one fit is made of (FSDP2's units
    are fitted apart, ``fsdp_unit_fits``)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if not r.get("holdout") and r["phase"] != FSDP_UNIT:
            groups[(r["module"], r["phase"], r["tp"])].append(r)
    return groups


def fit(records: list[dict]) -> dict[tuple, Fit]:
    """Fits keyed by (module, phase, tp, quantity), on every record not held out."""
    return {key + (name,): f for key, rows in _grid_groups(records).items() for name, f in _fit_group(rows).items()}


def _fit_group(rows: list[dict], names: tuple[str, ...] = ("fwd_ms", "bwd_ms", "memory_bytes")) -> dict[str, Fit]:
    """One (module, phase, tp)'s fits by quantity."""
    xs = [_shape_x(r) for r in rows]
    x = np.array([v[0] for v in xs])
    packed = xs[0][1] is not None
    sq = np.array([v[1] for v in xs]) if packed else None
    samples = np.array([v[2] for v in xs]) if packed else None
    return {name: Fit.of(x, np.array([r[name] for r in rows], dtype=float),
                         *((sq, samples) if name != "memory_bytes" else ()))
            for name in names}


OFF_NEIGHBOURS = 1.4
"""How far (either way) a grid record's time may sit from what the other records predict without it."""


def off_their_neighbours(records: list[dict], factor: float = OFF_NEIGHBOURS) -> list[dict]:
    """Grid records (not held out, not at either end of their grid) whose forward or backward time is
    ``factor`` or more off what the fit of their group's other records predicts there. The fit runs
    through every grid point, so such a record bends the model around one disturbed measurement
    (a neighbour's process woke up mid-shape); it says nothing about held-out shapes,
    which test the model and are left as measured. ``records`` are one model's, of one device and
    dtype (as a fit is made of)."""
    off = []
    for rows in _grid_groups(records).values():
        grid = sorted({_shape_x(r)[0] for r in rows})
        for i, r in enumerate(rows):
            x, sq, samples = _shape_x(r)
            if x in (grid[0], grid[-1]):
                continue
            fits = _fit_group(rows[:i] + rows[i + 1:], ("fwd_ms", "bwd_ms"))
            if any(not 1 / factor < r[name] / max(float(f(np.array(x), sq, samples)), 1e-12) < factor
                   for name, f in fits.items()):
                off.append(r)
    return off


@dataclass(frozen=True)
class UnitFit:
    """Milliseconds FSDP2 adds to a unit, a + b * parameters, for its all-gather and its reduce-scatter."""

    gather: tuple[float, float]
    reduce: tuple[float, float]

    def __call__(self, params: float) -> tuple[float, float]:
        """(all-gather, reduce-scatter) seconds of a unit of ``params`` parameters."""
        return tuple((a + b * params) * 1e-3 for a, b in (self.gather, self.reduce))


def fsdp_unit_fits(records: list[dict]) -> dict[int, UnitFit]:
    """Per shard count, the fit of the ``fsdp_unit`` records measured over that many processes."""
    by_shards: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        if r["phase"] == FSDP_UNIT:
            by_shards[int(r["shape"]["shards"])].append(r)

    def line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        a, b = nnls(np.stack([np.ones_like(x), x], axis=-1), y) if len(set(x)) > 1 else (float(np.median(y)), 0.0)
        return float(a), float(b)

    fits = {}
    for shards, rows in by_shards.items():
        x = np.array([r["shape"]["params"] for r in rows], dtype=float)
        fits[shards] = UnitFit(*(line(x, np.array([r[name] for r in rows], dtype=float))
                                 for name in ("fwd_ms", "bwd_ms")))
    return fits


def holdout_error(records: list[dict], fits: dict[tuple, Fit] | None = None) -> dict[str, float]:
    """Relative error of the fits on the held-out measurements (forward and backward)."""
    fits = fit(records) if fits is None else fits
    errors = []
    for r in records:
        if not r.get("holdout") or (r["module"], r["phase"], r["tp"], "fwd_ms") not in fits:
            continue
        x, sq, samples = _shape_x(r)
        for name in ("fwd_ms", "bwd_ms"):
            f = fits[(r["module"], r["phase"], r["tp"], name)]
            predicted = float(f(np.array(x), sq, samples))
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
    measured_comm: set[tuple[str, int]] = field(default_factory=set)
    unit_fits: dict[int, UnitFit] = field(default_factory=dict)
    _warned: set = field(default_factory=set)

    def __post_init__(self) -> None:
        self.analytical = AnalyticalCostModel(self.model, self.hardware, self.training)
        self.fits = fit(self.records)
        self.measured_comm = comm_measured(self.records)
        self.unit_fits = fsdp_unit_fits(self.records)

    def fsdp_unit(self, shards: int) -> UnitFit | None:
        """What FSDP2 adds to a unit sharded over ``shards`` ranks, as measured (None: not measured
        over that many; the analytical collectives apply)."""
        return self.unit_fits.get(shards)

    @property
    def name(self) -> str:
        return f"profiled ({self.device}, {self.dtype}, {len(self.records)} records)"

    def _part(self, module: str, phase: str, tp: int, x: np.ndarray, sq: np.ndarray | None = None,
              samples: np.ndarray | None = None) -> tuple:
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
        bwd = self.fits[(module, phase, tp, "bwd_ms")]
        f = fwd(x, sq, samples) * 1e-3 * scale
        b = bwd(x, sq, samples) * 1e-3 * scale
        linear = bwd(x, 0.0, 0.0) * 1e-3 * scale if bwd.packed else b
        m = self.fits[(module, phase, tp, "memory_bytes")](x) * scale
        return f, b, linear, m

    def stage_cost(self, stage: StageSpec, shape: WorkShape) -> StageCost:
        ref = self.analytical.stage_cost(stage, shape)
        if stage.module == Module.ENCODER:
            x, sq, samples = np.asarray(shape.tiles, dtype=float), None, None
            extras = (["embed"] if stage.first else []) + (["projector"] if stage.last else [])
        else:
            x, sq = np.asarray(shape.tokens, dtype=float), np.asarray(shape.sum_sq, dtype=float)
            samples = np.asarray(shape.samples, dtype=float)
            extras = (["embed"] if stage.first else []) + (["head"] if stage.last else [])
        f, b, linear, m = self._part(stage.module, "block", stage.tp, x, sq, samples)
        fwd, bwd, weight, act = stage.layers * f, stage.layers * b, stage.layers * linear / 2, stage.layers * m
        if stage.recompute is Recompute.FULL:
            bwd = bwd + fwd
            act = ref.act_bytes  # layer inputs only: the analytical count of what recomputation keeps
        elif stage.recompute is Recompute.SELECTIVE:  # the analytical share kept, and its redo time
            plain = self.analytical.stage_cost(replace(stage, recompute=Recompute.NONE), shape)
            act = act * np.where(plain.act_bytes > 0, ref.act_bytes / np.maximum(plain.act_bytes, 1e-30), 1.0)
            bwd = bwd + (ref.bwd_input - plain.bwd_input)
        for phase in extras:
            if (stage.module, phase, 1, "fwd_ms") in self.fits or (stage.module, phase, stage.tp, "fwd_ms") in self.fits:
                rows = np.asarray(shape.head_rows, dtype=float) if phase == "head" else x  # the head runs on targets
                ef, eb, _, em = self._part(stage.module, phase, stage.tp, rows)
                fwd, bwd, weight = fwd + ef, bwd + eb, weight + eb / 2
                if stage.recompute is not Recompute.FULL:
                    act = act + em
        comm = 0.0 if (stage.module, stage.tp) in self.measured_comm else self.analytical.tp_comm(stage, shape)
        return StageCost(fwd + comm, bwd - weight + comm, weight, act, ref.flops, ref.transient_bytes,
                         ref.recompute_flops)

    def holdout_error(self) -> dict[str, float]:
        return holdout_error(self.records, self.fits)
