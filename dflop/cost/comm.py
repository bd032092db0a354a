"""Communication times from link bandwidth and latency (alpha-beta model)."""

from __future__ import annotations

from typing import Any

import numpy as np


def p2p_time(nbytes: Any, bandwidth: float, latency: float) -> Any:
    """One point-to-point transfer; nothing to send costs nothing."""
    nbytes = np.asarray(nbytes, dtype=float)
    return np.where(nbytes > 0, latency + nbytes / bandwidth, 0.0)


def ring_allreduce_time(nbytes: Any, ranks: int, bandwidth: float, latency: float) -> Any:
    """Ring all-reduce of ``nbytes`` per rank: 2(n-1)/n of the data crosses each link, in
    2(n-1) latency-bound steps. Reduce-scatter plus all-gather (sequence parallelism,
    ZeRO) moves the same volume."""
    if ranks <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=float))
    nbytes = np.asarray(nbytes, dtype=float)
    volume = 2.0 * (ranks - 1) / ranks * nbytes / bandwidth
    return np.where(nbytes > 0, volume + 2.0 * (ranks - 1) * latency, 0.0)


def allgather_time(nbytes: Any, ranks: int, bandwidth: float, latency: float) -> Any:
    """Ring all-gather (or reduce-scatter) producing ``nbytes`` per rank: half an all-reduce."""
    return 0.5 * ring_allreduce_time(nbytes, ranks, bandwidth, latency)
