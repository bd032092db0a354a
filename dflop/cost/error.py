"""Prediction error: the world as it costs a batch, not as the cost model predicts it.

The scheduler balances bins from predicted per-sample costs; the world runs
them at costs that differ per sample. ``perturb`` gives the batch as the world
costs it: every sample's shapes (tiles, text and image tokens) scaled by its
own multiplicative lognormal factor of mean 1 and log-spread ``sigma``, as
``dflop.jobs.experiments.inflate`` scales whole modalities. Schedules are made from
the batch as seen; step times are taken on the perturbed one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dflop.workload.sample import SampleTable


def perturb(batch: SampleTable, sigma: float, seed: Any) -> SampleTable:
    """``batch`` with per-sample lognormal cost error ``sigma`` (0: unchanged), reproducible by ``seed``."""
    if sigma <= 0:
        return batch
    rng = np.random.default_rng(seed)
    factor = np.exp(rng.normal(-0.5 * sigma**2, sigma, size=len(batch)))

    def scaled(x: np.ndarray) -> np.ndarray:
        out = np.rint(x * factor).astype(np.int64)
        return np.where(x > 0, np.maximum(out, 1), 0)  # nothing appears or vanishes

    return SampleTable(batch.ids, batch.modality, scaled(batch.tiles), scaled(batch.text_tokens),
                       scaled(batch.image_tokens))
