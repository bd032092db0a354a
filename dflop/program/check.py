"""Checking a program before anything runs it.

A program is correct when it is *complete* (every stage runs every
microbatch's forward once and its backward once, as B or as I and W, on the
rank that owns the stage) and *deadlock-free* (the union of program order and
data dependencies has no cycle: then some execution finishes). The proof is a
networkx acyclicity check; the explanation of a failure is a dry run in
lockstep that shows, step by rank, what ran until everything got stuck.

An overlapped step ``(F;B)OVERLAP_F_B`` counts its sub-actions for
completeness and is one node for deadlock freedom: it starts once the inputs of
all its sub-actions are there (as torch's lowering posts all their receives
before it), and a sub-action may use an earlier sibling's output.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import networkx as nx

from dflop.errors import DflopError
from dflop.program.actions import Action, Kind, Program


class ProgramError(DflopError):
    """A program that would compute the wrong thing or hang.

    The message is one line; ``details`` holds the step-by-rank table of a deadlock.
    """

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def _completeness(program: Program) -> list[str]:
    problems = []
    counts = Counter((a.stage, a.kind, a.microbatch) for r in range(program.num_ranks) for a in program.parts(r))
    for rank in range(program.num_ranks):
        for a in program.parts(rank):
            if not (0 <= a.stage < program.stages and 0 <= a.microbatch < program.microbatches):
                problems.append(f"rank {rank} runs {a}, outside {program.stages} stages x "
                                f"{program.microbatches} microbatches")
            elif a.kind.is_compute and program.stage_to_rank[a.stage] != rank:
                problems.append(f"rank {rank} runs {a} but stage {a.stage} belongs to rank "
                                f"{program.stage_to_rank[a.stage]}")
    for s in range(program.stages):
        for k in range(program.microbatches):
            f, b = counts[(s, Kind.F, k)], counts[(s, Kind.B, k)]
            i, w = counts[(s, Kind.I, k)], counts[(s, Kind.W, k)]
            if f != 1:
                problems.append(f"{Action(s, Kind.F, k)} appears {f} times (expected once)")
            if not ((b == 1 and i == w == 0) or (b == 0 and i == w == 1)):
                problems.append(f"stage {s} microbatch {k} has B x{b}, I x{i}, W x{w} "
                                "(expected one B, or one I and one W)")
    return problems


def _split(program: Program) -> set[tuple[int, int]]:
    """(stage, microbatch) pairs whose backward is split into I and W."""
    return {(a.stage, a.microbatch) for r in range(program.num_ranks) for a in program.parts(r)
            if a.kind is Kind.I}


def data_deps(a: Action, last: int, split: set[tuple[int, int]],
              received: Callable[[int, int], bool] = lambda stage, source: False) -> list[Action]:
    """Actions that must finish before ``a`` may start (data dependencies only): the one rule of
    what an action needs. ``last`` is the last stage; ``received(stage, source)`` says that
    ``stage`` gets what ``source`` makes through a receive (in a lowered program), so it waits for
    the RECV instead.

    Dependencies are read at three levels, each derived from the one below: here, on the actions
    of a program (checked before it is laid over replicas, and possibly read from torch's CSV with
    its sends and receives); on template ops (``template.waits_for``: the same edges as op
    indices, which the fast evaluator walks vectorised over replicas); and on step-graph nodes
    (``StepGraph.deps``: communication explicit, what the runtimes and the other evaluators read)."""
    s, k = a.stage, a.microbatch
    if a.kind is Kind.F:
        if s == 0:
            return []
        return [Action(s, Kind.RECV_F, k)] if received(s, s - 1) else [Action(s - 1, Kind.F, k)]
    if a.kind in (Kind.B, Kind.I):
        deps = [Action(s, Kind.F, k)]
        if s < last:
            deps.append(Action(s, Kind.RECV_B, k) if received(s, s + 1) else _backward_of(s + 1, k, split))
        return deps
    if a.kind is Kind.W:
        return [Action(s, Kind.I, k)]
    if a.kind is Kind.SEND_F:
        return [Action(s, Kind.F, k)]
    if a.kind is Kind.RECV_F:
        return [Action(s - 1, Kind.SEND_F, k)]
    if a.kind is Kind.SEND_B:
        return [_backward_of(s, k, split)]
    return [Action(s + 1, Kind.SEND_B, k)]  # RECV_B


def _deps(program: Program, a: Action, split: set[tuple[int, int]]) -> list[Action]:
    owner = program.stage_to_rank
    if program.lowered:
        return data_deps(a, program.stages - 1, split, lambda stage, source: owner[stage] != owner[source])
    return data_deps(a, program.stages - 1, split)


def _backward_of(stage: int, k: int, split: set[tuple[int, int]]) -> Action:
    return Action(stage, Kind.I if (stage, k) in split else Kind.B, k)


def _external_deps(program: Program, a: Action, split: set[tuple[int, int]]) -> list[Action]:
    """What ``a`` (or any of its sub-actions) needs from outside itself; a sub-action's need for
    an earlier sibling is met inside, for a later one it stays (and makes a cycle)."""
    out = []
    for i, part in enumerate(a.parts):
        out += [d for d in _deps(program, part, split) if d not in a.sub_actions[:i]]
    return out


def dependency_graph(program: Program) -> nx.DiGraph:
    """Program order plus data dependencies; nodes are actions (an OVERLAP_F_B is one node)."""
    g = nx.DiGraph()
    node = {p: a for row in program.ranks for a in row for p in a.parts}
    split = _split(program)
    for rank, row in enumerate(program.ranks):
        for i, a in enumerate(row):
            g.add_node(a, rank=rank, index=i)
            if i:
                g.add_edge(row[i - 1], a, why="order")
    for a in set(node.values()):
        for d in _external_deps(program, a, split):
            if d not in node:
                raise ProgramError(f"{a} depends on {d}, which no rank runs")
            g.add_edge(node[d], a, why="data")
    return g


def dry_run(program: Program) -> tuple[list[list[str]], list[str]]:
    """Run in lockstep: each step every rank runs its next action if its dependencies ran in
    earlier steps. Returns the step-by-rank cells and, if it got stuck, what each rank waits for."""
    done: set[Action] = set()
    split = _split(program)
    cursor = [0] * program.num_ranks
    cells: list[list[str]] = [[] for _ in range(program.num_ranks)]
    total = sum(len(program.parts(r)) for r in range(program.num_ranks))
    while len(done) < total:
        ran = []
        for r, row in enumerate(program.ranks):
            if cursor[r] < len(row) and all(d in done for d in _external_deps(program, row[cursor[r]], split)):
                ran.append(row[cursor[r]])
                cells[r].append(str(row[cursor[r]]))
                cursor[r] += 1
            else:
                cells[r].append("." if cursor[r] < len(row) else "")
        if not ran:
            for c in cells:
                c.pop()
            waits = []
            for r, row in enumerate(program.ranks):
                if cursor[r] < len(row):
                    a = row[cursor[r]]
                    missing = [str(d) for d in _external_deps(program, a, split) if d not in done]
                    waits.append(f"rank {r} waits at {a} for {', '.join(missing)}")
            return cells, waits
        done.update(p for a in ran for p in a.parts)
    return cells, []


def check_program(program: Program) -> None:
    """Raise ProgramError naming the first violation, with a step-by-rank table if it hangs."""
    problems = _completeness(program)
    if problems:
        raise ProgramError(f"{program.name} is incomplete: " + "; ".join(problems[:5])
                           + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    graph = dependency_graph(program)
    if nx.is_directed_acyclic_graph(graph):
        return
    cells, waits = dry_run(program)
    steps = max(len(c) for c in cells)
    window = [c[max(0, steps - 12):] for c in cells]
    raise ProgramError(f"{program.name} deadlocks after {steps} steps: " + "; ".join(waits),
                       details=program.table(window))
