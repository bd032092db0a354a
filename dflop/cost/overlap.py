"""How long compute takes with communication running beside it: the formulas every mode shares.

Two shapes of overlap, both with the hardware's ``comm_slowdown`` s (compute
runs (1 + s) times slower while a communication kernel overlaps it):

- *one unit beside one transfer* (``overlapped``): compute c with a transfer q
  issued at its start ends after max(c + s * min(c, q), q): the overlapped
  part of the compute is slowed, and a transfer longer than the compute is
  exposed. FSDP's per-layer prefetch is a chain of these, one per layer
  (``unit_chain``): layer i computes while layer i+1's weights are gathered
  (and, backward, layer i-1's gradients are reduced), and no layer starts
  before its gather has finished (per-layer synchronisation).
- *a bucketed reduction beside the last backward* (``bucket_lag``,
  ``bucket_slowdown``): gradients of b seconds of backward fill n equal
  buckets; bucket i can be reduced once it is full and the previous bucket's
  reduction is done, so a reduction of c seconds in all ends at
  start + max(b/n + c, b + c/n): it starts ``bucket_lag`` = max(b/n, b - c(n-1)/n)
  after the backward starts and runs c seconds; only the tail beyond the
  backward is exposed (at least one bucket's c/n).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import numpy as np

Array = Any


def overlapped(compute: Array, comm: Array, slowdown: float) -> Array:
    """Seconds from the start of ``compute`` with ``comm`` issued beside it until both are done."""
    c, q = np.asarray(compute, dtype=float), np.asarray(comm, dtype=float)
    return np.maximum(c + slowdown * np.minimum(c, q), q)


def bucket_lag(backward: Array, comm: float, buckets: int) -> Array:
    """Seconds after the start of the last backward at which its bucketed reduction starts."""
    b = np.asarray(backward, dtype=float)
    n = max(int(buckets), 1)
    return np.maximum(b / n, b - comm * (n - 1) / n)


def bucket_slowdown(backward: Array, comm: float, lag: Array, slowdown: float) -> Array:
    """Extra seconds of that backward: its part beside the reduction runs slower."""
    beside = np.maximum(np.asarray(backward, dtype=float) - lag, 0.0)
    return slowdown * np.minimum(beside, comm)


def unit_chain(units: Sequence[str], compute: dict[str, Array], ahead: dict[str, float],
               behind: dict[str, float], slowdown: float) -> tuple[Array, float]:
    """(seconds, communication seconds overlapped) of a pass over FSDP units in order.

    Unit i computes ``compute[kind]`` while the next unit's ``ahead`` (its weights' gather) and the
    previous unit's ``behind`` (its gradients' reduction) run beside it; the first unit's gather is
    not counted (it is exposed before the pass) and the last unit's ``behind`` is (it is exposed
    after). Units of the same kind in the same neighbourhood cost the same, so the chain is summed
    over the few distinct (kind, next, previous) triples.
    """
    triples = Counter((u, units[i + 1] if i + 1 < len(units) else None, units[i - 1] if i else None)
                      for i, u in enumerate(units))
    total: Array = 0.0
    comm = 0.0
    for (u, nxt, prev), count in triples.items():
        q = (ahead[nxt] if nxt else 0.0) + (behind[prev] if prev else 0.0)
        total = total + count * overlapped(compute[u], q, slowdown)
        comm += count * q
    if units:
        total = total + behind[units[-1]]
    return total, comm
