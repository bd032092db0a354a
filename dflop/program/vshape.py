"""The V-shaped schedules: two stages per rank, rank r holding stages r and 2p-1-r.

- ``ZBVZeroBubble`` (Qi et al., "Zero Bubble Pipeline Parallelism", 2024,
  section 6): forwards of the first chunk fill the pipe, then each rank runs
  one forward and one input-gradient backward per chunk in the steady state and
  defers the weight gradients into what would be bubbles.
- ``DualPipeV`` (DeepSeek-V3's DualPipe cut in half, as in deepseek-ai/DualPipe):
  the steady state pairs the forward of one chunk with the full backward of the
  other in one overlapped step, ``(F;B)OVERLAP_F_B``, whose compute and
  communication can hide each other; the tail switches to split backwards so
  that weight gradients fill the drain.

Both generate, rank by rank, the compute orders torch 2.13's
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` generate (the tests compare
them with torch itself). Microbatch numbers count per (stage, kind): the k-th
forward of a stage is microbatch k.
"""

from __future__ import annotations

from collections import Counter, deque

from dflop.program.actions import Action, Kind, Program
from dflop.program.placement import StagePlacement

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741


class _Rank:
    """One rank's action list, numbering microbatches per (stage, kind) as it goes."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.count: Counter[tuple[int, Kind]] = Counter()
        self.pending_w: deque[tuple[int, int]] = deque()

    def make(self, stage: int, kind: Kind) -> Action:
        """The next ``kind`` of ``stage``; a B takes the number of the next I (they share it)."""
        key = (stage, I if kind is B else kind)
        k = self.count[key]
        self.count[key] += 1
        if kind is I:
            self.pending_w.append((stage, k))
        return Action(stage, kind, k)

    def add(self, stage: int, kind: Kind) -> None:
        self.actions.append(self.make(stage, kind))

    def overlap(self, forward_stage: int, backward_stage: int) -> None:
        self.actions.append(Action.overlap(self.make(forward_stage, F), self.make(backward_stage, B)))

    def oldest_w(self) -> None:
        """The weight gradient of the oldest split backward still waiting, if any."""
        if self.pending_w:
            stage, k = self.pending_w.popleft()
            self.actions.append(Action(stage, W, k))


def _v_program(name: str, pp: int, m: int, ranks: list[list[Action]]) -> Program:
    stages = 2 * pp
    return Program(name, stages, m, StagePlacement.V.stage_to_rank(pp, stages), tuple(map(tuple, ranks)))


def zbv_zero_bubble(pp: int, m: int) -> Program:
    """ZB-V; with fewer than 2p-1 microbatches, the order for 2p-1 with the extra ones left out."""
    n = max(2 * pp - 1, m)
    out = []
    for rank in range(pp):
        c0, c1 = rank, 2 * pp - 1 - rank
        r = _Rank()
        for _ in range(2 * (pp - rank) - 1):
            r.add(c0, F)
        for _ in range(rank):
            r.add(c1, F)
            r.add(c0, F)
        for _ in range(pp - rank):
            for kind in (F, I, W):
                r.add(c1, kind)
        while r.count[(c1, F)] < r.count[(c0, F)] or r.count[(c0, F)] < n:
            if r.count[(c0, F)] < n:
                r.add(c0, F)
            for stage, kinds in ((c0, (I, W)), (c1, (F, I, W))):
                for kind in kinds:
                    r.add(stage, kind)
        for _ in range(rank):
            r.add(c0, I)
            r.add(c1, I)
        for _ in range(pp - rank):
            r.add(c0, I)
            r.add(c0, W)
        for stage in (c1, c0):
            while r.count[(stage, W)] < r.count[(stage, I)]:
                r.add(stage, W)
        out.append([a for a in r.actions if a.microbatch < m])
    return _v_program("ZBVZeroBubble", pp, m, out)


def dual_pipe_v_problem(pp: int, m: int) -> str:
    """Why DualPipeV cannot run ``m`` microbatches on ``pp`` ranks ('' when it can): as torch's
    ScheduleDualPipeV, it needs at least one per stage."""
    if m < 2 * pp:
        return f"needs at least as many microbatches as stages (2 x {pp} = {2 * pp}), got {m}"
    return ""


def dual_pipe_v(pp: int, m: int) -> Program:
    """DualPipeV's ranks; ``build`` checks ``dual_pipe_v_problem`` first."""
    return _v_program("DualPipeV", pp, m, [_dual_pipe_v_rank(pp, m, rank) for rank in range(pp)])


def _dual_pipe_v_rank(pp: int, m: int, rank: int) -> list[Action]:
    s0, s1 = rank, 2 * pp - 1 - rank
    r = _Rank()
    for _ in range(2 * (pp - rank - 1)):  # chunk 0 forwards fill the pipe
        r.add(s0, F)
    for _ in range(rank + 1):
        r.add(s0, F)
        r.add(s1, F)
    for _ in range(pp - rank - 1):  # zero bubble: I, then the oldest W, then a forward
        r.add(s1, I)
        r.oldest_w()
        r.add(s1, F)
    for i in range(m - 2 * pp + rank + 1):  # steady state: overlapped F0&B1, F1&B0
        if i == 0 and rank == pp - 1:  # the last rank's first pair runs apart (a smaller bubble)
            r.add(s0, F)
            r.add(s1, B)
        else:
            r.overlap(s0, s1)
        r.overlap(s1, s0)
    for _ in range(pp - rank - 1):
        r.add(s1, B)
        r.overlap(s1, s0)
    split = False  # the second half of the drain splits its backwards
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        r.add(s1, I if split else B)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        r.add(s0, I if split else B)
    for _ in range(pp - rank - 1):
        r.oldest_w()
        r.add(s0, I if split else B)
    for _ in range(rank + 1):
        r.oldest_w()
    return r.actions
