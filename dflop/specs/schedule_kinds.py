"""What each pipeline schedule is, as data: the facts a plan is checked against and the program
builders are registered under, written once.

Names are torch.distributed.pipelining's and are looked up case-insensitively (as torch's
``get_schedule_class``); an unknown name lists the known ones. The programs themselves are built in
:mod:`dflop.program.schedules`, one builder per entry of this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from dflop.errors import DflopError


@dataclass(frozen=True, kw_only=True)
class ScheduleFacts:
    """The static facts of one pipeline schedule."""

    name: str
    """As torch.distributed.pipelining names it."""
    stages_per_rank: int | None
    """Fixed stages per rank (1, or 2 for a V), or None where the schedule takes any number (virtual
    stages)."""
    interleaved: bool = False
    """Several model chunks per rank in depth-first rounds: with one chunk per rank it is the plain
    (non-interleaved) schedule, so a plan names that instead."""
    v_shape: bool = False
    """Rank r holds stages r and 2p-1-r (a V) rather than every p-th stage (a loop)."""
    splits_backward: bool = False
    """Has separate input- and weight-gradient actions (I and W): zero-bubble schedules."""


GPIPE = ScheduleFacts(name="GPipe", stages_per_rank=1)
ONE_F_ONE_B = ScheduleFacts(name="1F1B", stages_per_rank=1)
"""Also what one pipeline rank runs: plain gradient accumulation."""
INTERLEAVED_1F1B = ScheduleFacts(name="Interleaved1F1B", stages_per_rank=None, interleaved=True)
LOOPED_BFS = ScheduleFacts(name="LoopedBFS", stages_per_rank=None)
INTERLEAVED_ZERO_BUBBLE = ScheduleFacts(name="InterleavedZeroBubble", stages_per_rank=None, interleaved=True,
                                        splits_backward=True)
ZBH1 = ScheduleFacts(name="ZBH1", stages_per_rank=1, splits_backward=True)
ZBV_ZERO_BUBBLE = ScheduleFacts(name="ZBVZeroBubble", stages_per_rank=2, v_shape=True, splits_backward=True)
DUAL_PIPE_V = ScheduleFacts(name="DualPipeV", stages_per_rank=2, v_shape=True, splits_backward=True)

SCHEDULE_FACTS = MappingProxyType({s.name.lower(): s for s in (
    GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, LOOPED_BFS, INTERLEAVED_ZERO_BUBBLE, ZBH1, ZBV_ZERO_BUBBLE, DUAL_PIPE_V)})
"""Every schedule, keyed by its lower-case name, in the order an error lists them."""


def find(name: str) -> ScheduleFacts | None:
    """The schedule of that name, whatever its case; None when there is none."""
    return SCHEDULE_FACTS.get(name.strip().lower())


def schedule_facts(name: str) -> ScheduleFacts:
    """The schedule of that name, whatever its case; an unknown name lists the known ones."""
    facts = find(name)
    if facts is None:
        known = ", ".join(s.name for s in SCHEDULE_FACTS.values())
        raise DflopError(f"unknown pipeline schedule '{name}' (known: {known})")
    return facts
