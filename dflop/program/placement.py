"""Where a schedule puts its stages: in loops over the ranks, or in a V.

torch.distributed.pipelining places stage s on rank ``s mod p`` for its looped
schedules (Interleaved1F1B, LoopedBFS, ...) and in a V for ZBVZeroBubble and
DualPipeV: down the ranks and back up, so that rank r holds stages r and
2p-1-r, the first and the last stage sit on rank 0, and the turn (stages p-1
and p) needs no transfer (``generate_stage_to_rank_mapping(style="v")``).
"""

from __future__ import annotations

from enum import Enum


class StagePlacement(str, Enum):
    LOOP = "loop"
    V = "v"

    def stage_to_rank(self, pp: int, stages: int) -> tuple[int, ...]:
        """Rank of every stage, for ``pp`` ranks and ``stages`` stages (a multiple of ``pp``)."""
        if self is StagePlacement.LOOP:
            return tuple(s % pp for s in range(stages))
        return tuple(s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(stages))
