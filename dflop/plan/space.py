"""The search spaces: every plan the optimizer may choose, and the baselines' smaller spaces.

Topology rules: tensor parallelism divides a node and the attention (and
key-value) heads; pipeline stages never outnumber layers; every bin of the
global batch gets at least one sample; the encoder's GPUs come first and are
a multiple of the LLM's TP degree, so no TP group straddles two nodes. On
large clusters the encoder/LLM split moves in whole nodes.

- ``DFLOP``: encoder and LLM planned independently, disaggregated or
  colocated, layers split by cost, data-aware microbatches.
- ``MEGATRON``: one TP/PP/DP for the whole model, encoder in the first stage,
  even layer split, microbatches cut in arrival order.
- ``PYTORCH``: pure data parallelism (FSDP), equal sample counts per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from dflop.cost.protocol import StageSpec, WorkShape
from dflop.plan.split import balanced_split
from dflop.specs.plan import ModulePlan, Placement, Plan

PP_OPTIONS = (1, 2, 3, 4, 6, 8, 12, 16)
ENCODER_PP_OPTIONS = (1, 2, 3, 4)
MICROBATCH_OPTIONS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Space:
    name: str
    data_aware: bool
    placements: tuple[Placement, ...]
    schedules: tuple[str, ...]
    balanced_layers: bool
    zero: int = 1
    pure_dp: bool = False


DFLOP = Space("dflop", True, (Placement.DISAGGREGATED, Placement.COLOCATED), ("1F1B", "ZBH1", "Interleaved1F1B"), True)
MEGATRON = Space("megatron", False, (Placement.COLOCATED,), ("1F1B", "Interleaved1F1B"), False)
PYTORCH = Space("pytorch", False, (Placement.COLOCATED,), ("1F1B",), False, zero=3, pure_dp=True)
BASELINES = (MEGATRON, PYTORCH)


def _tp_options(per_node: int, *heads: int) -> list[int]:
    return [t for t in range(1, per_node + 1) if per_node % t == 0 and all(h % t == 0 for h in heads)]


class SpaceBuilder:
    """Enumerates plans of a space for one problem (model, cluster, global batch)."""

    def __init__(self, problem, global_batch: int) -> None:
        self.p, self.batch = problem, global_batch
        model, cluster = problem.model, problem.cluster
        self.n, self.per_node = cluster.gpus, cluster.gpus_per_node
        self.llm_tp = _tp_options(self.per_node, model.llm.heads, model.llm.kv_heads)
        self.enc_tp = _tp_options(self.per_node, model.encoder.heads)
        self.mean_tokens = float(problem.data.llm_tokens.mean())
        self.mean_tiles = float(problem.data.tiles.mean())
        self._splits: dict[tuple, tuple[int, ...]] = {}

    def microbatches(self, dp: int, pp: int, interleaved: bool) -> list[int]:
        out = [m for m in MICROBATCH_OPTIONS if dp * m <= self.batch]
        if interleaved:
            out = [m for m in out if m >= pp and m % pp == 0]
        return out

    def _time(self, spec: StageSpec, shape: WorkShape) -> float:
        c = self.p.cost.stage_cost(spec, shape)
        return float(c.fwd + c.bwd)

    def llm_split(self, tp: int, stages: int, bin_samples: float, encoder_tp: int | None) -> tuple[int, ...]:
        """Layers per LLM stage balancing time at the average bin; the first stage also runs the
        encoder when ``encoder_tp`` is given (colocated)."""
        key = ("llm", tp, stages, round(bin_samples, 3), encoder_tp)
        if key not in self._splits:
            model = self.p.model
            tokens = bin_samples * self.mean_tokens
            shape = WorkShape(bin_samples, bin_samples * self.mean_tiles, tokens, tokens * self.mean_tokens)
            layer = self._time(StageSpec("llm", 1, tp), shape)
            head = self._time(StageSpec("llm", 1, tp, last=True), shape) - layer
            extra = [0.0] * stages
            extra[-1] += head
            if encoder_tp is not None:
                enc = StageSpec("encoder", model.encoder.layers, encoder_tp, first=True, last=True)
                extra[0] += self._time(enc, WorkShape(bin_samples, bin_samples * self.mean_tiles))
            self._splits[key] = balanced_split(model.llm.layers, layer, extra)
        return self._splits[key]

    def encoder_split(self, tp: int, stages: int, chunk_tiles: float) -> tuple[int, ...]:
        key = ("encoder", tp, stages, round(chunk_tiles, 3))
        if key not in self._splits:
            shape = WorkShape(1, chunk_tiles)
            layer = self._time(StageSpec("encoder", 1, tp), shape)
            extra = [0.0] * stages
            extra[0] += self._time(StageSpec("encoder", 1, tp, first=True), shape) - layer
            extra[-1] += self._time(StageSpec("encoder", 1, tp, last=True), shape) - layer
            self._splits[key] = balanced_split(self.p.model.encoder.layers, layer, extra)
        return self._splits[key]

    def _pp_options(self, layers: int, options: tuple[int, ...], virtual: int = 1) -> list[int]:
        return [p for p in options if p * virtual <= layers]

    def plans(self, space: Space, placement: Placement,
              skip_split: Callable[[int], bool] | None = None) -> Iterator[Plan]:
        """Plans of ``space`` with one placement; ``skip_split(encoder_gpus)`` drops whole GPU splits."""
        placement = Placement(placement)
        if placement not in space.placements:
            return
        if space.pure_dp:
            for m in self.microbatches(self.n, 1, False):
                yield Plan(encoder=ModulePlan(dp=self.n), llm=ModulePlan(dp=self.n), placement=Placement.COLOCATED,
                           microbatches=m, schedule="1F1B", zero=space.zero)
        elif placement is Placement.COLOCATED:
            yield from self._colocated(space)
        else:
            yield from self._disaggregated(space, skip_split or (lambda e: False))

    def _colocated(self, space: Space) -> Iterator[Plan]:
        model = self.p.model
        for tp in self.llm_tp:
            if model.encoder.heads % tp:
                continue
            for schedule in space.schedules:
                virtual = 2 if schedule == "Interleaved1F1B" else 1
                for pp in self._pp_options(model.llm.layers, PP_OPTIONS, virtual):
                    if self.n % (tp * pp) or (pp == 1 and schedule != "1F1B"):
                        continue  # one stage: every schedule is plain gradient accumulation
                    dp = self.n // (tp * pp)
                    for m in self.microbatches(dp, pp, virtual > 1):
                        split = (self.llm_split(tp, pp * virtual, self.batch / (dp * m), tp)
                                 if space.balanced_layers else ())
                        yield Plan(encoder=ModulePlan(tp=tp, dp=dp), llm=ModulePlan(tp=tp, pp=pp, dp=dp,
                                   layers_per_stage=split), placement=Placement.COLOCATED, microbatches=m,
                                   schedule=schedule, virtual_stages=virtual, zero=space.zero)

    def encoder_gpu_options(self, llm_tp: int) -> list[int]:
        """GPUs the encoder may get: any count on small clusters, whole nodes from 4 nodes up, and
        at most ~32 choices (in whole nodes) on large ones."""
        quantum = self.per_node if self.n >= 4 * self.per_node else 1
        if self.n >= 32 * self.per_node:
            quantum = (self.n // 32) // self.per_node * self.per_node
        return [e for e in range(quantum, self.n, quantum) if e % llm_tp == 0]

    def _disaggregated(self, space: Space, skip_split: Callable[[int], bool]) -> Iterator[Plan]:
        model = self.p.model
        schedules = [s for s in space.schedules if s != "Interleaved1F1B"]
        for tp in self.llm_tp:
            for enc_gpus in self.encoder_gpu_options(tp):
                if skip_split(enc_gpus):
                    continue
                llm_gpus = self.n - enc_gpus
                for pp in self._pp_options(model.llm.layers, PP_OPTIONS):
                    if llm_gpus % (tp * pp):
                        continue
                    dp = llm_gpus // (tp * pp)
                    for etp in self.enc_tp:
                        for epp in self._pp_options(model.encoder.layers, ENCODER_PP_OPTIONS):
                            if enc_gpus % (etp * epp):
                                continue
                            edp = enc_gpus // (etp * epp)
                            for m in self.microbatches(dp, pp, False):
                                bin_samples = self.batch / (dp * m)
                                split = self.llm_split(tp, pp, bin_samples, None) if space.balanced_layers else ()
                                esplit = (self.encoder_split(etp, epp, self.batch * self.mean_tiles / (edp * m))
                                          if space.balanced_layers else ())
                                for schedule in schedules:
                                    yield Plan(encoder=ModulePlan(tp=etp, pp=epp, dp=edp, layers_per_stage=esplit),
                                               llm=ModulePlan(tp=tp, pp=pp, dp=dp, layers_per_stage=split),
                                               placement=Placement.DISAGGREGATED, microbatches=m, schedule=schedule,
                                               zero=space.zero)
