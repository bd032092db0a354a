"""Pipeline programs as data: for every rank, an ordered list of actions.

Actions read as torch.distributed.pipelining writes them: ``<stage><kind><microbatch>``,
e.g. ``1F3`` (stage 1, forward, microbatch 3), ``2I0`` (backward through the
inputs), ``2W0`` (weight gradients), ``0SEND_F1``, and DualPipeV's overlapped
forward and backward ``(0F7;7B3)OVERLAP_F_B``: one step of the rank made of two
sub-actions of different microbatches, whose compute and communication may hide
each other. A program round-trips through CSV, one row per rank, as torch's
``_dump_csv`` writes it.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from dflop.errors import DflopError


class Kind(str, Enum):
    F = "F"
    B = "B"
    """Full backward (inputs and weights together)."""
    I = "I"  # noqa: E741 - torch's name for backward-input
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    BRIDGE_SEND_F = "BRIDGE_SEND_F"
    """Image features from an encoder replica to an LLM replica that owns some of its samples."""
    BRIDGE_RECV_F = "BRIDGE_RECV_F"
    BRIDGE_SEND_B = "BRIDGE_SEND_B"
    """Gradients of those features, back from the LLM replica to the encoder replica."""
    BRIDGE_RECV_B = "BRIDGE_RECV_B"
    REDUCE_GRAD = "REDUCE_GRAD"
    """Gradient reduction across data-parallel replicas (all-reduce, or reduce-scatter when sharded)."""
    UNSHARD = "UNSHARD"
    """All-gather of a sharded (FSDP) stage's parameters before its first use in a step."""
    RESHARD = "RESHARD"
    """Free the gathered parameters after the stage's last use in a step."""
    OVERLAP_F_B = "OVERLAP_F_B"
    """A forward and a backward of two microbatches run together (its ``sub_actions``)."""
    ENCODE = "ENCODE"
    """Heterogeneous placement: the forwards of the step's samples this rank's encoder replicas encode."""
    ENCODE_B = "ENCODE_B"
    """Their backwards, once the all-to-all has brought their embeddings' gradients back."""
    ALL_TO_ALL_F = "ALL_TO_ALL_F"
    """Heterogeneous placement: every rank's image embeddings to the LLM stage-0 ranks that need them."""
    ALL_TO_ALL_B = "ALL_TO_ALL_B"
    """Their gradients back to the ranks that encoded them."""
    REDUCE_ENCODER_GRAD = "REDUCE_ENCODER_GRAD"
    """Heterogeneous placement: the encoder's gradient reduction over its own data-parallel replicas."""

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self in _SENDS

    @property
    def is_recv(self) -> bool:
        return self in _RECVS

    @property
    def is_collective(self) -> bool:
        return self in _COLLECTIVES

    @property
    def precedes_its_op(self) -> bool:
        """A collective that runs before the op it is placed at (and is one of its inputs); the others
        follow their op, anchored on it."""
        return self in (Kind.UNSHARD, Kind.ALL_TO_ALL_F, Kind.ALL_TO_ALL_B)

    @property
    def is_encoder_phase(self) -> bool:
        """A heterogeneous encoder phase's compute (one op per rank and step, outside the pipeline program)."""
        return self in (Kind.ENCODE, Kind.ENCODE_B)


_COMPUTE = frozenset((Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP_F_B, Kind.ENCODE, Kind.ENCODE_B))
_COLLECTIVES = frozenset((Kind.REDUCE_GRAD, Kind.UNSHARD, Kind.RESHARD, Kind.ALL_TO_ALL_F, Kind.ALL_TO_ALL_B,
                          Kind.REDUCE_ENCODER_GRAD))
_SENDS = frozenset((Kind.SEND_F, Kind.SEND_B, Kind.BRIDGE_SEND_F, Kind.BRIDGE_SEND_B))
_RECVS = frozenset((Kind.RECV_F, Kind.RECV_B, Kind.BRIDGE_RECV_F, Kind.BRIDGE_RECV_B))
_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")
_OVERLAP = re.compile(r"^\(([^()]*)\)OVERLAP_F_B$")
_PLAIN_COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: Kind
    microbatch: int
    sub_actions: tuple["Action", ...] = ()
    """The plain compute actions of an OVERLAP_F_B, in the order the rank issues them (torch's
    runtime runs them in this order unless a custom overlapped function is registered)."""

    def __post_init__(self) -> None:
        if (self.kind is Kind.OVERLAP_F_B) != bool(self.sub_actions):
            raise DflopError(f"action {self.kind.value}: only OVERLAP_F_B has sub-actions, and it needs some")
        if self.sub_actions and (len(self.sub_actions) != 2
                                 or any(a.kind not in _PLAIN_COMPUTE for a in self.sub_actions)):
            raise DflopError(f"OVERLAP_F_B needs two sub-actions of kind F, B, I or W, got "
                             f"({';'.join(str(a) for a in self.sub_actions)})")

    @classmethod
    def encoder_phase(cls, kind: Kind) -> "Action":
        """A rank's ENCODE or ENCODE_B: all its microbatches at once, so neither stage nor microbatch."""
        return cls(-1, kind, -1)

    @classmethod
    def overlap(cls, *sub_actions: "Action") -> "Action":
        """torch's ``_Action(-1, OVERLAP_F_B, None, sub_actions)``."""
        return cls(-1, Kind.OVERLAP_F_B, -1, tuple(sub_actions))

    @property
    def parts(self) -> tuple["Action", ...]:
        """The plain actions this one stands for: its sub-actions, or itself."""
        return self.sub_actions or (self,)

    def __str__(self) -> str:
        if self.sub_actions:
            return f"({';'.join(str(a) for a in self.sub_actions)}){self.kind.value}"
        if self.kind.is_encoder_phase:
            return self.kind.value
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        text = text.strip()
        overlap = _OVERLAP.match(text)
        if overlap:
            return cls.overlap(*(cls.parse(part) for part in overlap.group(1).split(";")))
        match = _ACTION.match(text)
        if not match:
            raise DflopError(f"invalid action '{text}': expected <stage><kind><microbatch>, e.g. 1F3, "
                             "kinds F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, or "
                             "(<action>;<action>)OVERLAP_F_B")
        return cls(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


@dataclass(frozen=True)
class Program:
    """A pipeline schedule: ``ranks[r]`` is rank r's actions in execution order."""

    name: str
    stages: int
    """Pipeline stages, counting virtual stages."""
    microbatches: int
    stage_to_rank: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @cached_property
    def lowered(self) -> bool:
        """True once send/recv actions have been added."""
        return any(not a.kind.is_compute for actions in self.ranks for a in actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def parts(self, rank: int) -> list[Action]:
        """Rank ``rank``'s plain actions in order, each OVERLAP_F_B replaced by its sub-actions."""
        return [p for a in self.ranks[rank] for p in a.parts]

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for actions in self.ranks:
            writer.writerow([str(a) for a in actions])
        return buf.getvalue()

    @classmethod
    def from_csv(cls, text: str, name: str = "custom") -> "Program":
        """Read a program written by :meth:`to_csv`; stages, microbatches and the stage-to-rank
        map are read off the actions."""
        rows = [[cell for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))]
        ranks = tuple(tuple(Action.parse(cell) for cell in row) for row in rows if row)
        if not ranks:
            raise DflopError("program CSV has no actions")
        actions = [p for row in ranks for a in row for p in a.parts]
        stages = max(a.stage for a in actions) + 1
        owner: dict[int, int] = {}
        for rank, row in enumerate(ranks):
            for a in (p for action in row for p in action.parts):
                if a.kind.is_compute and owner.setdefault(a.stage, rank) != rank:
                    raise DflopError(f"program CSV: stage {a.stage} has compute on ranks "
                                     f"{owner[a.stage]} and {rank}")
        missing = [s for s in range(stages) if s not in owner]
        if missing:
            raise DflopError(f"program CSV: stage {missing[0]} has no compute action")
        return cls(name, stages, max(a.microbatch for a in actions) + 1,
                   tuple(owner[s] for s in range(stages)), ranks)

    def table(self, steps: list[list[str]] | None = None, limit: int = 40) -> str:
        """A step-by-rank table (one row per step, one column per rank)."""
        columns = steps if steps is not None else [[str(a) for a in row] for row in self.ranks]
        depth = max((len(c) for c in columns), default=0)
        width = max([len(x) for c in columns for x in c] + [6])
        header = "step  " + " ".join(f"{'rank ' + str(r):<{width}}" for r in range(len(columns)))
        lines = [header]
        for step in range(min(depth, limit)):
            cells = [c[step] if step < len(c) else "" for c in columns]
            lines.append(f"{step:>4}  " + " ".join(f"{x:<{width}}" for x in cells))
        if depth > limit:
            lines.append(f" ...  ({depth - limit} more steps)")
        return "\n".join(lines)
