"""Adaptive correction: learn where predictions are wrong from what was measured.

A backend reports, for every executed stage op, its measured time; the
scheduler knows what it predicted for every sample in that op. Samples fall
into buckets (modality x size class), and the correction fits, per module,

    measured(op) ~ r_0 + sum_b r_b * predicted_b(op)

where predicted_b is the predicted time of the op's samples in bucket b: r_b
is bucket b's observed/predicted ratio, r_0 absorbs fixed per-op overhead.
The fit is ridge regression shrunk towards ratio 1 (no evidence, no change),
made robust to outliers (stragglers, a noisy measurement) by Huber-weighted
iterative reweighting, over a window of recent observations.

Correcting costs only pays when it changes schedules enough to save more time
than it costs (measuring, re-solving); :class:`CorrectionPolicy` switches it
on only then, as the DFLOP paper describes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from dflop.workload.sample import MODALITIES, SampleTable

SIZE_EDGES = (2048.0, 6144.0)
"""LLM-token boundaries of the size classes within a modality."""


def bucket_of(samples: SampleTable) -> np.ndarray:
    """Bucket of every sample: modality x size class (by LLM tokens)."""
    size = np.searchsorted(np.asarray(SIZE_EDGES), samples.llm_tokens, side="right")
    return samples.modality.astype(np.int64) * (len(SIZE_EDGES) + 1) + size


BUCKETS = len(MODALITIES) * (len(SIZE_EDGES) + 1)


@dataclass
class CostCorrection:
    """Per-module, per-bucket observed/predicted ratios learned from measurements."""

    window: int = 256
    strength: float = 1e-3
    """Ridge weight towards ratio 1, relative to the data's own scale."""
    huber: float = 1.5
    """Residuals beyond this many (robust) standard deviations are down-weighted."""
    clip: tuple[float, float] = (0.2, 5.0)
    _obs: dict[str, deque] = field(default_factory=dict)
    _fit: dict[str, np.ndarray] = field(default_factory=dict)

    def observe(self, module: str, predicted_by_bucket: np.ndarray, measured: float) -> None:
        buf = self._obs.setdefault(module, deque(maxlen=self.window))
        buf.append((np.asarray(predicted_by_bucket, dtype=float), float(measured)))
        self._fit.pop(module, None)

    def observations(self, module: str) -> int:
        return len(self._obs.get(module, ()))

    def ratios(self, module: str) -> np.ndarray:
        """Observed/predicted ratio of every bucket (1 where nothing was seen)."""
        if module in self._fit:
            return self._fit[module]
        obs = self._obs.get(module)
        if not obs:
            return np.ones(BUCKETS)
        x = np.stack([np.concatenate([[1.0], p]) for p, _ in obs])
        y = np.array([m for _, m in obs])
        seen = x[:, 1:].sum(axis=0) > 0
        scale = float(np.mean(np.diag(x.T @ x))) or 1.0
        prior = np.concatenate([[0.0], np.ones(BUCKETS)])
        penalty = self.strength * scale * np.ones(BUCKETS + 1)
        penalty[0] = self.strength * scale * 1e-3  # the intercept is nearly free
        w = np.ones(len(y))
        coef = prior
        for _ in range(8):  # Huber IRLS
            a = x.T @ (w[:, None] * x) + np.diag(penalty)
            coef = np.linalg.solve(a, x.T @ (w * y) + penalty * prior)
            resid = y - x @ coef
            sigma = 1.4826 * np.median(np.abs(resid - np.median(resid))) or 1e-12
            z = np.abs(resid) / (self.huber * sigma)
            w = np.where(z <= 1, 1.0, 1.0 / np.maximum(z, 1e-12))
        ratios = np.where(seen, np.clip(coef[1:], *self.clip), 1.0)
        self._fit[module] = ratios
        return ratios

    def apply(self, costs: np.ndarray, buckets: np.ndarray, modules: tuple[str, ...]) -> np.ndarray:
        """Per-sample costs (samples, modules) corrected by the learned ratios."""
        out = np.array(costs, dtype=float, copy=True)
        for d, module in enumerate(modules):
            out[:, d] *= self.ratios(module)[buckets]
        return out


def by_bucket(costs: np.ndarray, buckets: np.ndarray, members: np.ndarray) -> np.ndarray:
    """Predicted time of ``members`` (indices) summed per bucket."""
    return np.bincount(buckets[members], weights=costs[members], minlength=BUCKETS)


@dataclass
class CorrectionPolicy:
    """Decides whether correcting is worth it: on when the expected saving per step exceeds the
    overhead (measurement and re-solving), re-checked every ``recheck`` steps."""

    overhead_s: float
    """Cost of correcting per step: measuring op times and solving a second time."""
    warmup: int = 4
    """Steps of observations before the first decision."""
    recheck: int = 8
    enabled: bool = False
    gains: list[float] = field(default_factory=list)
    _since: int = 0

    def due(self, step: int) -> bool:
        """Whether this step should compare both schedules (costs a second solve)."""
        if step < self.warmup:
            return False
        self._since += 1
        return not self.gains or self._since >= self.recheck

    def update(self, saving_s: float) -> bool:
        """Record the predicted saving of correcting this step; returns the decision."""
        self._since = 0
        self.gains.append(saving_s)
        recent = self.gains[-3:]
        self.enabled = float(np.mean(recent)) > self.overhead_s
        return self.enabled
