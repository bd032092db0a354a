"""The step template: a plan's pipeline program laid over its modules and replicas.

A *group* is one pipeline rank of one module, repeated on every data-parallel
replica; a *template op* is one action of one group, i.e. an array of ops,
one per replica. All replicas of a module run the same program, so the
template, its dependencies and its topological order are built once per plan
and evaluated on many batches (vectorised over replicas).

Disaggregated placement runs the encoder stages and the LLM stages as one
pipeline of ``pp_enc + pp_llm`` stages (the encoder's warm-up accounts for the
LLM stages behind it); the *bridge* from the last encoder stage to the first
LLM stage connects replicas many-to-many, as the samples of each LLM bin were
encoded by whichever encoder replicas held them. Colocated placement runs the
encoder inside LLM stage 0. Heterogeneous placement runs the LLM's program
as colocated does, with an encoder phase around it on every rank: an ENCODE op
first and an ENCODE_B op last, the latter after every rank's last LLM op (the
all-to-all between them is a collective of the whole job, ``collectives.py``);
a frozen encoder has no ENCODE_B, and a disaggregated one no backwards.

An overlapped step ``(F;B)OVERLAP_F_B`` becomes its sub-actions, one op each,
back to back, marked as a pair (``overlap``); how long the pair takes is the
cost layer's choice (:mod:`dflop.timing.overlap`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Sequence

import numpy as np

from dflop.errors import DflopError
from dflop.program.actions import Action, Kind, Program
from dflop.program.check import check_program, data_deps
from dflop.program.schedules import build, placement
from dflop.specs.plan import Module, Plan


@dataclass(frozen=True)
class Group:
    index: int
    module: Module
    """The module of this pipeline rank (a colocated LLM stage 0 also carries the encoder)."""
    rank: int
    """Pipeline rank within its module."""
    replicas: int
    tp: int
    stages: tuple[int, ...]
    """Module-local stages this rank holds (more than one with virtual stages)."""


@dataclass(frozen=True)
class TemplateOp:
    index: int
    group: int
    action: Action
    """The action as the program numbers stages."""
    stage: int
    """Module-local stage."""
    prev: int
    """Previous op of the same group in program order (-1 for the first)."""
    deps: tuple[int, ...]
    """Ops of the same replica that must finish first (data dependencies)."""
    bridge: int
    """Op on the other side of the encoder-LLM bridge that must finish first (-1 if none)."""
    overlap: int = -1
    """The other op of the same OVERLAP_F_B step (-1 if none)."""
    after: tuple[int, ...] = ()
    """Ops of other groups that must have ended on every replica first (an ENCODE_B waits for every
    rank's last LLM op, through the all-to-all that brings its gradients)."""

    @property
    def released_by(self) -> int:
        """The op whose end makes this op's outputs available: a pair sends after both halves,
        as torch runs it, so the first half's outputs wait for the second."""
        return max(self.index, self.overlap)


@dataclass(frozen=True)
class Wave:
    """Ops that wait only for ops of earlier waves; index ``n`` (the number of ops) stands for none."""

    ops: np.ndarray
    waits: np.ndarray
    """Per op: its predecessor on its replica, then per dependency slot (``op.deps`` order) the
    op releasing it."""
    bridged: tuple[tuple[int, int], ...]
    """(row in ``ops``, op releasing the bridge input) of the ops with a bridge input."""


@dataclass(frozen=True)
class Template:
    plan: Plan
    program: Program
    encoder_stages: int
    """Program stages that belong to the encoder (0 when colocated)."""
    groups: tuple[Group, ...]
    ops: tuple[TemplateOp, ...]
    order: tuple[int, ...]
    """Ops in a topological order valid for every replica."""
    last_op: tuple[int, ...]
    """Last op of each group in program order."""
    frozen_encoder: bool = False
    """The encoder runs forward only: its stages have no backward, a heterogeneous phase no ENCODE_B
    (and no collective after it), and nothing sends it gradients."""

    @property
    def colocated(self) -> bool:
        """No encoder stage in the program (the encoder in LLM stage 0, or in a phase of its own)."""
        return self.encoder_stages == 0

    @cached_property
    def llm_ops(self) -> tuple[np.ndarray, ...]:
        """Each group's ops of the pipeline program (not its encoder phase), in program order."""
        return tuple(ops[[not self.ops[i].action.kind.is_encoder_phase for i in ops]] for ops in self.group_ops)

    @cached_property
    def dep_slots(self) -> int:
        """The most data dependencies of any op."""
        return max((len(op.deps) for op in self.ops), default=0)

    @cached_property
    def group_ops(self) -> tuple[np.ndarray, ...]:
        """Each group's op indices, in program order."""
        groups = np.array([op.group for op in self.ops], dtype=np.int64)
        return tuple(np.flatnonzero(groups == g.index) for g in self.groups)

    @cached_property
    def waves(self) -> tuple["Wave", ...]:
        """The ops in waves, each op in the first wave after every op it waits for (``waits_for``).
        A group's ops wait for each other in program order, so a wave holds at most one op per
        group: the fast evaluator times a whole wave at once, and a group's collectives still
        run in program order."""
        n = len(self.ops)
        wave = [0] * n
        waits = [waits_for(op, self.ops) for op in self.ops]
        for i in self.order:
            prev, data, bridge = waits[i]
            wave[i] = 1 + max((wave[d] for d in (prev, bridge, *data, *self.ops[i].after) if d >= 0), default=-1)
        members: list[list[int]] = [[] for _ in range(max(wave, default=-1) + 1)]
        for i in self.order:
            members[wave[i]].append(i)
        out = []
        for ops in members:
            table = np.full((len(ops), 1 + self.dep_slots), n, dtype=np.int64)
            for row, i in enumerate(ops):
                prev, data, _ = waits[i]
                table[row, 0] = prev if prev >= 0 else n
                table[row, 1:1 + len(data)] = data
            out.append(Wave(np.array(ops, dtype=np.int64), table,
                            tuple((row, waits[i][2]) for row, i in enumerate(ops) if waits[i][2] >= 0)))
        return tuple(out)

    @cached_property
    def wave_position(self) -> dict[int, tuple[int, int]]:
        """Each op's (wave, row in the wave)."""
        return {int(i): (w, row) for w, wave in enumerate(self.waves) for row, i in enumerate(wave.ops)}

    def module_stage(self, program_stage: int) -> tuple[Module, int]:
        if program_stage < self.encoder_stages:
            return Module.ENCODER, program_stage
        return Module.LLM, program_stage - self.encoder_stages


@lru_cache(maxsize=512)
def checked(name: str, pp: int, m: int, v: int) -> Program:
    """A named schedule, built and checked once (programs are pure functions of these four)."""
    program = build(name, pp, m, v)
    check_program(program)
    return program


def program_for(plan: Plan) -> tuple[Program, int]:
    """The plan's pipeline program and how many of its stages are encoder stages."""
    if plan.shares_gpus:
        return checked(plan.schedule, plan.llm.pp, plan.microbatches, plan.virtual_stages), 0
    if plan.virtual_stages > 1:
        raise DflopError("virtual stages need colocated or heterogeneous placement")
    return checked(plan.schedule, plan.encoder.pp + plan.llm.pp, plan.microbatches, 1), plan.encoder.pp


def _groups(plan: Plan, stage_to_rank: tuple[int, ...], encoder_stages: int) -> tuple[Group, ...]:
    groups = []
    for rank in range(max(stage_to_rank) + 1):
        stages = [s for s, r in enumerate(stage_to_rank) if r == rank]
        module = Module.ENCODER if stages[0] < encoder_stages else Module.LLM
        offset = 0 if module is Module.ENCODER else encoder_stages
        mp = plan.module(module)
        groups.append(Group(rank, module, rank - offset, mp.dp, mp.tp, tuple(s - offset for s in stages)))
    return tuple(groups)


def plan_groups(plan: Plan) -> tuple[Group, ...]:
    """The pipeline ranks of the plan's program and the stages each holds, where its schedule places
    them (loop, or V: rank r of p holds stages r and 2p-1-r), without building the program: the
    groups :func:`build_template` makes, for the planner's cheap figures."""
    if plan.shares_gpus:
        ranks, encoder_stages, stages = plan.llm.pp, 0, plan.stages(Module.LLM)
    else:
        ranks = stages = plan.encoder.pp + plan.llm.pp
        encoder_stages = plan.encoder.pp
    return _groups(plan, placement(plan.schedule).stage_to_rank(ranks, stages), encoder_stages)


def build_template(plan: Plan, program: Program | None = None, *, frozen_encoder: bool = False) -> Template:
    """The step template of ``plan`` (its own schedule's program unless ``program`` is given); with
    ``frozen_encoder`` the encoder's backwards are left out (:attr:`Template.frozen_encoder`)."""
    if program is None:
        program, encoder_stages = program_for(plan)
    else:
        encoder_stages = 0 if plan.shares_gpus else plan.encoder.pp
        check_program(program)
    last_stage = program.stages - 1
    groups = _groups(plan, program.stage_to_rank, encoder_stages)

    index: dict[Action, int] = {}
    flat: list[tuple[int, Action, int]] = []
    pairs: list[tuple[int, int]] = []
    phase = plan.heterogeneous
    for rank, actions in enumerate(program.ranks):
        prev = -1
        if phase:
            flat.append((rank, Action.encoder_phase(Kind.ENCODE), prev))
            prev = len(flat) - 1
        for action in actions:
            if not action.kind.is_compute:
                continue
            for a in action.parts:
                if frozen_encoder and a.stage < encoder_stages and a.kind is not Kind.F:
                    continue
                index[a] = len(flat)
                flat.append((rank, a, prev))
                prev = index[a]
            if action.sub_actions and all(a in index for a in action.parts):
                pairs.append((index[action.parts[0]], index[action.parts[1]]))
        if phase and not frozen_encoder:
            flat.append((rank, Action.encoder_phase(Kind.ENCODE_B), prev))
    split = {(a.stage, a.microbatch) for a in index if a.kind is Kind.I}
    last_llm = tuple(prev for _, a, prev in flat if a.kind is Kind.ENCODE_B)

    ops = []
    for i, (rank, a, prev) in enumerate(flat):
        if a.kind.is_encoder_phase:
            ops.append(TemplateOp(i, rank, a, -1, prev, (), -1,
                                  after=last_llm if a.kind is Kind.ENCODE_B else ()))
            continue
        s = a.stage
        deps: list[int] = []
        bridge = -1
        for d in data_deps(a, last_stage, split):  # one crossing the encoder-LLM boundary is the bridge
            if (d.stage < encoder_stages) != (s < encoder_stages):
                bridge = index[d]
            else:
                deps.append(index[d])
        local = s - (0 if s < encoder_stages else encoder_stages)
        ops.append(TemplateOp(i, rank, a, local, prev, tuple(deps), bridge))
    for first, second in pairs:
        ops[first] = replace(ops[first], overlap=second)
        ops[second] = replace(ops[second], overlap=first)

    last = [-1] * len(groups)
    for op in ops:
        last[op.group] = op.index
    return Template(plan, program, encoder_stages, groups, tuple(ops),
                    _topological(ops), tuple(last), frozen_encoder)


def waits_for(op: TemplateOp, ops: Sequence[TemplateOp]) -> tuple[int, tuple[int, ...], int]:
    """The ops whose ends ``op`` waits for on its replica: its predecessor (-1 for none), the op
    releasing each of its data dependencies (``released_by``, in ``op.deps`` order), and the op
    releasing its bridge input (-1 for none). The template-level reading of ``check.data_deps``
    (see there why there are three levels); the topological order and the fast evaluator use it.
    An op's ``after`` (other groups' ops, on every replica) is the evaluators' to wait for, through
    the collective between them."""
    return op.prev, tuple(ops[d].released_by for d in op.deps), ops[op.bridge].released_by if op.bridge >= 0 else -1


def _topological(ops: list[TemplateOp]) -> tuple[int, ...]:
    """Kahn's algorithm, smallest index first among ready ops (deterministic)."""
    succ: list[list[int]] = [[] for _ in ops]
    indegree = [0] * len(ops)
    for op in ops:
        prev, data, bridge = waits_for(op, ops)
        for d in (prev, bridge, *data, *op.after):
            if d >= 0:
                succ[d].append(op.index)
                indegree[op.index] += 1
    ready = deque(i for i, n in enumerate(indegree) if n == 0)
    order = []
    while ready:
        i = ready.popleft()
        order.append(i)
        for j in succ[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    if len(order) != len(ops):
        raise DflopError("the step's dependencies form a cycle (the program would deadlock)")
    return tuple(order)
