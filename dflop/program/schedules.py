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
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from dflop.errors import DflopError
from dflop.program.actions import Action, Kind, Program


def gpipe(pp: int, m: int) -> Program:
    ranks = tuple(tuple([Action(r, Kind.F, k) for k in range(m)] + [Action(r, Kind.B, k) for k in range(m)])
                  for r in range(pp))
    return Program("GPipe", pp, m, tuple(range(pp)), ranks)


def _rounds(pp: int, m: int, name: str) -> int:
    """Microbatches per round (torch's flexible rule; Megatron's when m is a multiple of pp)."""
    rounds = max(1, m // pp)
    if m % rounds:
        raise DflopError(f"{name} needs the microbatches ({m}) to be a multiple of the number of "
                         f"rounds ({rounds})")
    return m // rounds


def _one_f_one_b_ranks(pp: int, m: int, v: int, zero_bubble: bool, name: str) -> tuple[tuple[Action, ...], ...]:
    """torch's _get_1f1b_rank_ops for every rank (F/B, or F/I/W with zero_bubble)."""
    per_round = _rounds(pp, m, name) if v > 1 else m
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
                   _one_f_one_b_ranks(pp, m, v, zero_bubble=False, name="Interleaved1F1B"))


def interleaved_zero_bubble(pp: int, m: int, v: int = 1) -> Program:
    stages = pp * v
    name = "ZBH1" if v == 1 else "InterleavedZeroBubble"
    return Program(name, stages, m, tuple(s % pp for s in range(stages)),
                   _one_f_one_b_ranks(pp, m, v, zero_bubble=True, name=name))


Builder = Callable[..., Program]

SCHEDULES: dict[str, tuple[str, Builder, bool]] = {
    # lower-case key: (display name, builder, takes virtual stages)
    "gpipe": ("GPipe", gpipe, False),
    "1f1b": ("1F1B", one_f_one_b, False),
    "interleaved1f1b": ("Interleaved1F1B", interleaved_1f1b, True),
    "interleavedzerobubble": ("InterleavedZeroBubble", interleaved_zero_bubble, True),
    "zbh1": ("ZBH1", interleaved_zero_bubble, False),
}


def canonical(name: str) -> str:
    key = name.strip().lower()
    if key not in SCHEDULES:
        known = ", ".join(v[0] for v in SCHEDULES.values())
        raise DflopError(f"unknown pipeline schedule '{name}' (known: {known})")
    return SCHEDULES[key][0]


def splits_backward(name: str) -> bool:
    """True for schedules with separate input- and weight-gradient actions."""
    return canonical(name) in ("InterleavedZeroBubble", "ZBH1")


def supports_virtual_stages(name: str) -> bool:
    return SCHEDULES[canonical(name).lower()][2]


def build(name: str, pp: int, m: int, v: int = 1) -> Program:
    """The named schedule for ``pp`` ranks, ``m`` microbatches and ``v`` chunks per rank."""
    display, builder, virtual = SCHEDULES[canonical(name).lower()]
    if pp < 1 or m < 1 or v < 1:
        raise DflopError(f"{display}: pp, microbatches and virtual stages must be at least 1")
    if v > 1 and not virtual:
        raise DflopError(f"{display} has one stage per rank; use Interleaved1F1B or "
                         f"InterleavedZeroBubble for {v} virtual stages")
    return builder(pp, m, v) if virtual else builder(pp, m)
