"""Layer splits chosen by cost: the stage with the LM head (or the encoder) gets fewer layers.

Every stage costs ``layers x per_layer + extra``; a split minimises the
most expensive stage (each stage keeps at least one layer), by bisection, so
that deep models (thousands of layers) split as fast as shallow ones.
"""

from __future__ import annotations

import bisect
import math

from dflop.specs.plan import even_split


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


def first_last_split(layers: int, per_layer: float, extra: list[float]) -> tuple[int, ...]:
    """Even middle stages, the first and last sized by cost (Megatron's uneven pipeline): the
    cheapest such split, ties to the fewest layers on the first stage, then on the last.

    For each middle size ``k`` the first stage's cost rises and the last's falls with the first
    stage's layers, so their maximum is lowest where they cross: two bisections per ``k``, not a
    scan of every (first, last) pair, which is quadratic in the layers (thousands in a deep model).
    Costs are computed term by term as ``n * per_layer + extra``, the form every split is compared in.
    """
    stages = len(extra)
    middle = stages - 2
    head, tail = extra[0], extra[-1]
    inner = max(extra[1:-1], default=-math.inf)
    best: tuple[float, int, int, int] | None = None
    sizes = range(1, (layers - 2) // middle + 1) if middle else range(0, 1 if layers >= 2 else 0)
    for k in sizes:
        body = k * per_layer + inner
        pair = layers - middle * k  # layers of the first and last stage together (at least 2)

        def cost(first: int) -> float:
            return max(first * per_layer + head, body, (pair - first) * per_layer + tail)

        firsts = range(1, pair)
        cross = 1 + bisect.bisect_left(firsts, True,
                                       key=lambda f: f * per_layer + head >= (pair - f) * per_layer + tail)
        first = cross
        if cross > 1 and (cross == pair or cost(cross - 1) <= cost(cross)):
            low = cost(cross - 1)  # left of the crossing the cost only falls: its first minimum
            first = 1 + bisect.bisect_left(range(1, cross), True,
                                           key=lambda f: max((pair - f) * per_layer + tail, body) <= low)
        here = (cost(first), first, pair - first, k)
        if best is None or here[:3] < best[:3]:
            best = here
    if best is None:
        return even_split(layers, stages)
    _, first, last, k = best
    return (first,) + (k,) * middle + (last,)
