"""Lowering: make a program's communication explicit.

``add_send_recv`` puts a RECV right before each compute action that needs a
tensor from another rank and a SEND right after each compute action that
produces one, as torch.distributed.pipelining's ``_add_send_recv`` does; an
OVERLAP_F_B gets the receives of all its sub-actions before it and their sends
after it.
"""

from __future__ import annotations

from dataclasses import replace

from dflop.program.actions import Action, Kind, Program


def add_send_recv(program: Program) -> Program:
    if program.lowered:
        return program
    owner = program.stage_to_rank
    last = program.stages - 1

    def remote(a: int, b: int) -> bool:
        return 0 <= b <= last and owner[a] != owner[b]

    def comms(a: Action) -> tuple[list[Action], list[Action]]:
        """(receives before, sends after) one plain action."""
        s, k = a.stage, a.microbatch
        if a.kind is Kind.F:
            return ([Action(s, Kind.RECV_F, k)] if remote(s, s - 1) else [],
                    [Action(s, Kind.SEND_F, k)] if remote(s, s + 1) else [])
        if a.kind in (Kind.B, Kind.I):
            return ([Action(s, Kind.RECV_B, k)] if remote(s, s + 1) else [],
                    [Action(s, Kind.SEND_B, k)] if remote(s, s - 1) else [])
        return [], []

    ranks = []
    for actions in program.ranks:
        out: list[Action] = []
        for a in actions:
            pairs = [comms(p) for p in a.parts]
            out += [r for before, _ in pairs for r in before] + [a] + [s for _, after in pairs for s in after]
        ranks.append(tuple(out))
    return replace(program, ranks=tuple(ranks))
