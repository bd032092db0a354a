"""Layer splits chosen by cost: the stage with the LM head (or the encoder) gets fewer layers.

Every stage costs ``layers x per_layer + extra``; the split minimises the
most expensive stage (each stage keeps at least one layer), by bisection on
that maximum.
"""

from __future__ import annotations

import math


def balanced_split(layers: int, per_layer: float, extra: list[float]) -> tuple[int, ...]:
    stages = len(extra)
    if stages > layers:
        raise ValueError(f"{stages} stages cannot each hold one of {layers} layers")
    if per_layer <= 0:
        base, rest = divmod(layers, stages)
        return tuple(base + (1 if i < rest else 0) for i in range(stages))

    def capacity(limit: float) -> list[int]:
        return [max(1, math.floor((limit - e) / per_layer + 1e-9)) for e in extra]

    lo, hi = 0.0, max(extra) + layers * per_layer
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(capacity(mid)) >= layers:
            hi = mid
        else:
            lo = mid
    counts = capacity(hi)
    while sum(counts) > layers:  # trim where it costs the most, never below one layer
        costs = [(c * per_layer + e, i) for i, (c, e) in enumerate(zip(counts, extra)) if c > 1]
        _, i = max(costs)
        counts[i] -= 1
    return tuple(counts)
