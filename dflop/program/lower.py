"""Lowering: make a program's communication explicit.

``add_send_recv`` puts a RECV right before each compute action that needs a
tensor from another rank and a SEND right after each compute action that
produces one, as torch.distributed.pipelining's ``_add_send_recv`` does.
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

    ranks = []
    for actions in program.ranks:
        out: list[Action] = []
        for a in actions:
            s, k = a.stage, a.microbatch
            if a.kind is Kind.F:
                if remote(s, s - 1):
                    out.append(Action(s, Kind.RECV_F, k))
                out.append(a)
                if remote(s, s + 1):
                    out.append(Action(s, Kind.SEND_F, k))
            elif a.kind in (Kind.B, Kind.I):
                if remote(s, s + 1):
                    out.append(Action(s, Kind.RECV_B, k))
                out.append(a)
                if remote(s, s - 1):
                    out.append(Action(s, Kind.SEND_B, k))
            else:
                out.append(a)
        ranks.append(tuple(out))
    return replace(program, ranks=tuple(ranks))
