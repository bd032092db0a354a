"""Pipeline schedules, named as torch.distributed.pipelining names them.

Each builder returns a :class:`Program` for ``pp`` ranks and ``m`` microbatches:

- ``GPipe``: all forwards, then all backwards.
- ``1F1B``: ``pp - r - 1`` warm-up forwards on rank r, then one forward and one
  backward alternately; at most ``pp - r`` microbatches in flight.
- ``Interleaved1F1B``: ``v`` model chunks per rank (stage s on rank s mod pp),
  Megatron's depth-first order with rounds of ``pp`` microbatches.
- ``InterleavedZeroBubble``: backward split into input gradients (I) and weight
  gradients (W), the W's deferred into what would be bubbles (Qi et al.,
  "Zero Bubble Pipeline Parallelism", 2024); with one chunk per rank this is
  their ZB-H1 schedule, registered also as ``ZBH1``.
- ``LoopedBFS``: looped placement like Interleaved1F1B, but breadth-first: all
  forwards of a rank's earlier stage before its next stage.
- ``ZBVZeroBubble`` and ``DualPipeV``: two stages per rank in a V (see
  :mod:`dflop.program.vshape`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from dflop.errors import DflopError
from dflop.program.actions import Action, Kind, Program
from dflop.program.placement import StagePlacement
from dflop.program.vshape import dual_pipe_v, dual_pipe_v_problem, zbv_zero_bubble
from dflop.specs import schedule_kinds as table
from dflop.specs.schedule_kinds import ScheduleFacts, schedule_facts


def gpipe(pp: int, m: int) -> Program:
    ranks = tuple(tuple([Action(r, Kind.F, k) for k in range(m)] + [Action(r, Kind.B, k) for k in range(m)])
                  for r in range(pp))
    return Program("GPipe", pp, m, tuple(range(pp)), ranks)


def rounds_problem(pp: int, m: int, v: int) -> str:
    """Why ``m`` microbatches do not make whole rounds of a looped schedule with ``v`` stages per
    rank ('' when they do): torch's flexible rule, Megatron's when m is a multiple of pp."""
    rounds = max(1, m // pp)
    if v == 1 or m % rounds == 0:
        return ""
    return f"needs the microbatches ({m}) to be a multiple of the number of rounds ({rounds})"


def _one_f_one_b_ranks(pp: int, m: int, v: int, zero_bubble: bool) -> tuple[tuple[Action, ...], ...]:
    """torch's _get_1f1b_rank_ops for every rank (F/B, or F/I/W with zero_bubble); the microbatches
    make whole rounds (``build`` checks ``rounds_problem`` first)."""
    per_round = m // max(1, m // pp) if v > 1 else m
    backward = Kind.I if zero_bubble else Kind.B
    out = []
    for rank in range(pp):
        hop = 1 if zero_bubble else 2
        warmup = min((v - 1) * per_round + hop * (pp - 1 - rank), m * v)
        total = m * v

        def fwd_stage(step: int) -> int:
            return ((step // per_round) % v) * pp + rank

        def bwd_stage(step: int) -> int:
            return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

        fwd_mb: dict[int, int] = defaultdict(int)
        bwd_mb: dict[int, int] = defaultdict(int)
        w_mb: dict[int, int] = defaultdict(int)
        pending_w: list[int] = []
        actions: list[Action] = []

        def forward(step: int) -> None:
            stage = fwd_stage(step)
            actions.append(Action(stage, Kind.F, fwd_mb[stage]))
            fwd_mb[stage] += 1

        def backward_(step: int) -> None:
            stage = bwd_stage(step)
            actions.append(Action(stage, backward, bwd_mb[stage]))
            bwd_mb[stage] += 1
            pending_w.append(stage)
            # Rank r defers its W's by r steps (torch: num_1f1b_microbatches = rank).
            if zero_bubble and step - warmup >= rank:
                weight(pending_w.pop(0))

        def weight(stage: int) -> None:
            actions.append(Action(stage, Kind.W, w_mb[stage]))
            w_mb[stage] += 1

        for step in range(warmup):
            forward(step)
        for step in range(warmup, total):
            forward(step)
            backward_(step)
        for step in range(total, total + warmup):
            backward_(step)
        while zero_bubble and pending_w:
            weight(pending_w.pop(0))
        out.append(tuple(actions))
    return tuple(out)


def one_f_one_b(pp: int, m: int) -> Program:
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        actions = [Action(r, Kind.F, k) for k in range(warmup)]
        for k in range(m - warmup):
            actions += [Action(r, Kind.F, warmup + k), Action(r, Kind.B, k)]
        actions += [Action(r, Kind.B, k) for k in range(m - warmup, m)]
        ranks.append(tuple(actions))
    return Program("1F1B", pp, m, tuple(range(pp)), tuple(ranks))


def interleaved_1f1b(pp: int, m: int, v: int = 2) -> Program:
    stages = pp * v
    return Program("Interleaved1F1B", stages, m, tuple(s % pp for s in range(stages)),
                   _one_f_one_b_ranks(pp, m, v, zero_bubble=False))


def interleaved_zero_bubble(pp: int, m: int, v: int = 1) -> Program:
    stages = pp * v
    name = "ZBH1" if v == 1 else "InterleavedZeroBubble"
    return Program(name, stages, m, tuple(s % pp for s in range(stages)),
                   _one_f_one_b_ranks(pp, m, v, zero_bubble=True))


def looped_bfs(pp: int, m: int, v: int = 2) -> Program:
    """Breadth-first: every microbatch through a rank's earlier stage before its next one
    (Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2023); backwards last stage first, last
    microbatch first, as torch orders them."""
    stages = pp * v
    ranks = []
    for rank in range(pp):
        own = range(rank, stages, pp)
        ranks.append(tuple([Action(s, Kind.F, k) for s in own for k in range(m)]
                           + [Action(s, Kind.B, k) for s in reversed(own) for k in reversed(range(m))]))
    return Program("LoopedBFS", stages, m, StagePlacement.LOOP.stage_to_rank(pp, stages), tuple(ranks))


Builder = Callable[..., Program]


@dataclass(frozen=True)
class ScheduleKind:
    facts: ScheduleFacts
    """What the schedule is (:mod:`dflop.specs.schedule_kinds`)."""
    builder: Builder
    limits: Callable[[int, int, int], str] = lambda pp, m, v: ""
    """Why the builder refuses ``pp`` ranks, ``m`` microbatches and ``v`` stages per rank ('' when
    it takes them), for those it checks beyond the stages per rank."""

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def stages_per_rank(self) -> int | None:
        return self.facts.stages_per_rank

    @property
    def placement(self) -> StagePlacement:
        return StagePlacement.V if self.facts.v_shape else StagePlacement.LOOP

    @property
    def splits_backward(self) -> bool:
        return self.facts.splits_backward


SCHEDULES: dict[str, ScheduleKind] = {s.name.lower(): s for s in (
    ScheduleKind(table.GPIPE, gpipe),
    ScheduleKind(table.ONE_F_ONE_B, one_f_one_b),
    ScheduleKind(table.INTERLEAVED_1F1B, interleaved_1f1b, rounds_problem),
    ScheduleKind(table.LOOPED_BFS, looped_bfs),
    ScheduleKind(table.INTERLEAVED_ZERO_BUBBLE, interleaved_zero_bubble, rounds_problem),
    ScheduleKind(table.ZBH1, interleaved_zero_bubble),
    ScheduleKind(table.ZBV_ZERO_BUBBLE, zbv_zero_bubble),
    ScheduleKind(table.DUAL_PIPE_V, dual_pipe_v, lambda pp, m, v: dual_pipe_v_problem(pp, m)),
)}
"""A builder for every schedule of the table, keyed as the table is."""


def schedule_kind(name: str) -> ScheduleKind:
    """The registered schedule of that name, case-insensitively (as torch's get_schedule_class)."""
    return SCHEDULES[schedule_facts(name).name.lower()]


def canonical(name: str) -> str:
    return schedule_kind(name).name


def splits_backward(name: str) -> bool:
    """True for schedules with separate input- and weight-gradient actions."""
    return schedule_kind(name).splits_backward


def placement(name: str) -> StagePlacement:
    """How the schedule places its stages on ranks (loop, or V for ZBVZeroBubble and DualPipeV)."""
    return schedule_kind(name).placement


def stages_per_rank(name: str, virtual_stages: int | None = None) -> int:
    """Stages each rank holds: the schedule's fixed number, else ``virtual_stages`` (default 1)."""
    fixed = schedule_kind(name).stages_per_rank
    return fixed if fixed is not None else (virtual_stages or 1)


def shape_problem(name: str, pp: int, m: int, v: int | None = None) -> str:
    """Why the named schedule cannot run ``pp`` ranks, ``m`` microbatches and ``v`` stages per rank
    ('' when it can): every check :func:`build` makes, for those who only ask (the planner)."""
    kind = schedule_kind(name)
    v = stages_per_rank(name) if v is None else v
    if pp < 1 or m < 1 or v < 1:
        return f"{kind.name}: pp, microbatches and virtual stages must be at least 1"
    if kind.stages_per_rank == 1 and v != 1:
        return (f"{kind.name} has one stage per rank; use Interleaved1F1B, InterleavedZeroBubble "
                f"or LoopedBFS for {v} virtual stages")
    if kind.stages_per_rank not in (None, v):
        return f"{kind.name} runs exactly {kind.stages_per_rank} stages per rank (V placement), got virtual_stages={v}"
    problem = kind.limits(pp, m, v)
    return f"{kind.name} {problem}" if problem else ""


def build(name: str, pp: int, m: int, v: int | None = None) -> Program:
    """The named schedule for ``pp`` ranks, ``m`` microbatches and ``v`` stages per rank
    (default: the schedule's fixed number, else 1)."""
    if problem := shape_problem(name, pp, m, v):
        raise DflopError(problem)
    kind = schedule_kind(name)
    if kind.stages_per_rank is None:
        return kind.builder(pp, m, stages_per_rank(name, v))
    return kind.builder(pp, m)
