"""How long DualPipeV's overlapped forward-and-backward step takes: a modelling choice.

The step ``(F;B)OVERLAP_F_B`` pairs the forward of one microbatch with the
backward of another on the same rank. The template lays it out as its two
sub-actions back to back, each waiting for its own input and handing on its
output when it ends. Then:

- ``sequential``: the two run one after the other, ``F + B``. This is what
  torch's runtime does unless a custom overlapped function is registered
  (torch also posts the pair's sends after both; where sends go is the
  lowering's business, not the cost's).
- ``overlapped``: the two hide each other, so the pair takes ``max(F, B)``
  when both inputs are there (DualPipe's point: one chunk's communication,
  e.g. MoE all-to-all, runs behind the other's compute; with nothing to hide
  it is the bound a perfect overlap reaches). Both sub-actions are scaled by
  ``max(F, B) / (F + B)``, so the trace still shows which is which; a backward
  whose input comes late still waits for it.
"""

from __future__ import annotations

from dataclasses import replace
from enum import Enum

import numpy as np

from dflop.errors import DflopError
from dflop.timing.costing import StepTiming


class Overlap(str, Enum):
    SEQUENTIAL = "sequential"
    OVERLAPPED = "overlapped"

    @classmethod
    def of(cls, value: "Overlap | str") -> "Overlap":
        try:
            return cls(value)
        except ValueError:
            raise DflopError(f"overlap: '{value}' is not one of "
                             f"{', '.join(m.value for m in cls)}") from None


def with_overlap(timing: StepTiming, overlap: Overlap | str) -> StepTiming:
    """``timing`` with every overlapped pair costed as ``overlap`` says (integer ns; a pair's two
    durations add up to exactly ``max(F, B)``)."""
    if Overlap.of(overlap) is Overlap.SEQUENTIAL:
        return timing
    duration = timing.duration.copy()
    for op in timing.template.ops:
        if op.overlap > op.index:
            a, b = duration[op.index], duration[op.overlap]
            span = np.maximum(a, b)
            first = np.rint(span * (a / np.maximum(a + b, 1))).astype(np.int64)  # span * a overflows int64
            duration[op.index], duration[op.overlap] = first, span - first
    return replace(timing, duration=duration)
