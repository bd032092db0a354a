"""The search spaces: every plan the optimizer may choose, and the baselines' smaller spaces.

Topology rules: tensor parallelism divides a node and the attention (and
key-value) heads; pipeline stages never outnumber layers; every bin of the
global batch gets at least one sample; the encoder's GPUs come first and are
a multiple of the LLM's TP degree, so no TP group straddles two nodes. On
large clusters the encoder/LLM split moves in whole nodes. Plans are canonical:
one pipeline rank always runs 1F1B with one virtual stage.

- ``MEGATRON`` (Megatron-LM's LLaVA): one TP/PP/DP for the LLM; the encoder in
  the first LLM stage with the LLM's TP, or in its own pipeline stages with
  its own TP (at most the LLM's) on every data-parallel replica
  (``--encoder-pipeline-model-parallel-size``, ``--encoder-tensor-model-parallel-size``):
  a disaggregated plan whose encoder has the LLM's data parallelism (an encoder
  sharing the first LLM stage has the LLM's TP: Megatron-LM asserts it, core_r0.10.0
  ``arguments.py``). Layers split evenly, with a lighter first and last stage
  (``--decoder-first/last-pipeline-num-layers``) or any way
  (``--pipeline-model-parallel-layout``: layers per virtual stage; here balanced
  by cost); 1F1B or interleaved; DDP or
  the distributed optimizer, both with fp32 gradient buffers. Besides the three
  rules every baseline space runs, Megatron-LM's own ``dp_balanced`` packing.
- ``PYTORCH`` (FSDP2 / DeepSpeed, as torchtitan and LLaVA's trainer run them):
  one colocated stage, TP optional; DDP, ZeRO-2, FSDP (ZeRO-3) or HSDP.
- ``DFLOP``: everything above, plus encoder and LLM planned independently on
  separate GPUs, or on the same GPUs with the encoder in a phase of its own
  (heterogeneous: its own TP and DP on every GPU), any layer split (balanced by cost), every schedule of torch's
  that dflop generates (zero-bubble, LoopedBFS, and the V-shaped ZBVZeroBubble
  and DualPipeV, whose rank 0 holds the first and the last stage) with the
  microbatch counts its generator takes, ZeRO-1 everywhere and bf16 gradient
  buffers. Every space picks its recomputation (none, selective, full) per plan.

Schedules with several stages per rank (two: virtual stages in loops, or a V)
need colocated or heterogeneous placement.

A space lists what it allows; ``variants`` drops the choices that can never be
faster than another the same space allows (``prove_dominated`` says why), so
the search evaluates fewer plans without losing the best.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable, Iterator

from dflop.cost.protocol import StageSpec, WorkShape
from dflop.plan.split import balanced_split, first_last_split
from dflop.program.schedules import ScheduleKind, schedule_kind, shape_problem
from dflop.schedule.batching import Batching
from dflop.specs.plan import Module, ModulePlan, Placement, Plan, Recompute, even_split

PP_OPTIONS = (1, 2, 3, 4, 6, 8, 12, 16)
ENCODER_PP_OPTIONS = (1, 2, 3, 4)
MICROBATCH_OPTIONS = (1, 2, 4, 8, 16, 32, 64, 128)


class Layers(str, Enum):
    """How a space may split layers over pipeline stages."""

    EVEN = "even"
    FIRST_LAST = "first-last"
    """Even middle stages, first and last stage sized by cost (Megatron's uneven pipeline)."""
    BALANCED = "balanced"
    """Any split, balanced by cost at the average bin."""


class Encoder(str, Enum):
    """Where a space may put the encoder besides the first LLM stage."""

    STAGE = "stage"
    """Own pipeline stages on every LLM replica, own TP up to the LLM's (Megatron)."""
    FREE = "free"
    """Own GPUs with its own TP, PP and DP (dflop's disaggregated plans)."""
    PHASE = "phase"
    """Every GPU, with its own TP and DP, as a phase around the LLM's pipeline (heterogeneous)."""


@dataclass(frozen=True)
class Space:
    name: str
    encoder: tuple[Encoder, ...]
    """Layouts besides colocated (the encoder in the first LLM stage, which every space allows)."""
    schedules: tuple[ScheduleKind, ...]
    """Each with the stages per rank it fixes, or 2 where it takes any number (virtual stages)."""
    layers: tuple[Layers, ...]
    zero: tuple[int, ...]
    hsdp: bool
    fp32_grads: tuple[bool, ...]
    max_pp: int = max(PP_OPTIONS)
    recompute: tuple[Recompute, ...] = tuple(Recompute)
    whole_rounds: bool = False
    """Several stages per rank only with microbatches in whole rounds of the pipeline ranks
    (Megatron-LM's rule); otherwise as the schedule's generator allows (torch's rules)."""
    rules: tuple[Batching, ...] = (Batching.ARRIVAL, Batching.MODALITY, Batching.TOKENS)
    """The batching rules its framework runs, as a baseline (dflop's space runs its own bins)."""


def _kinds(*names: str) -> tuple[ScheduleKind, ...]:
    return tuple(schedule_kind(n) for n in names)


DFLOP = Space("dflop", (Encoder.STAGE, Encoder.FREE, Encoder.PHASE),
              _kinds("1F1B", "ZBH1", "Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS", "ZBVZeroBubble",
                     "DualPipeV"),
              (Layers.EVEN, Layers.FIRST_LAST, Layers.BALANCED), (0, 1, 2, 3), True, (False, True))
MEGATRON = Space("megatron", (Encoder.STAGE,), _kinds("1F1B", "Interleaved1F1B"),
                 (Layers.EVEN, Layers.FIRST_LAST, Layers.BALANCED),
                 (0, 1), False, (True,), whole_rounds=True,
                 rules=(Batching.ARRIVAL, Batching.MODALITY, Batching.TOKENS, Batching.DP_BALANCED))
PYTORCH = Space("pytorch", (), _kinds("1F1B"), (Layers.EVEN,), (0, 2, 3), True, (False, True), max_pp=1)
BASELINES = (MEGATRON, PYTORCH)
SPACES = {s.name: s for s in (DFLOP, *BASELINES)}


def prove_dominated(space: Space, plan: Plan) -> str:
    """Why another plan of ``space``, alike but for its memory options, is never slower and never
    bigger ('' when none is): the rules ``variants`` applies."""
    if plan.fp32_grads and False in space.fp32_grads:
        return "bf16 gradient buffers move half the bytes and hold half the memory"
    if plan.zero == 0 and 1 in space.zero:
        return ("ZeRO-1's reduce-scatter plus weight all-gather moves no more than DDP's all-reduce "
                "(weights are no wider than gradients) and shards the optimizer")
    if plan.zero == 0 and 2 in space.zero and plan.microbatches == 1 and plan.strategy.single_stage:
        return "with one microbatch ZeRO-2 moves what DDP moves and shards gradients and optimizer"
    if plan.zero == 1 and 2 in space.zero and plan.microbatches == 1 and plan.strategy.single_stage:
        return "with one microbatch ZeRO-2 moves what ZeRO-1 moves and shards gradients too"
    return ""


def variants(space: Space, base: Plan, recompute: tuple[Recompute, ...]) -> list[list[Plan]]:
    """The memory options of ``base`` worth evaluating: one list per (ZeRO, HSDP, gradient width),
    each its recomputation options from the least (fastest) to the most (smallest)."""
    out = []
    for zero in space.zero:
        strategy = replace(base.strategy, zero=zero)
        if not strategy.zero_fits_layout:
            continue
        for hsdp in ((False, True) if strategy.shards_parameters and space.hsdp else (False,)):
            for fp32 in space.fp32_grads:
                plan = base.with_options(zero=zero, hsdp=hsdp, fp32_grads=fp32)
                if not prove_dominated(space, plan):
                    out.append([plan.with_options(recompute=r) for r in recompute])
    return out


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
        self.mean_targets = float(problem.data.targets.mean())
        allowed = problem.training.recompute
        self.recompute = tuple(Recompute) if allowed == "auto" else (Recompute(allowed),)
        self._splits: dict[tuple, tuple[int, ...]] = {}

    def microbatches(self, space: Space, dp: int, ranks: int, schedule: str, virtual: int) -> list[int]:
        """Microbatch counts that give every bin a sample and that the schedule runs on ``ranks``
        ranks with ``virtual`` stages each (its generator's own checks, plus the space's rule)."""
        whole = space.whole_rounds and virtual > 1
        return [m for m in MICROBATCH_OPTIONS if dp * m <= self.batch and not shape_problem(schedule, ranks, m, virtual)
                and not (whole and m % ranks)]

    def _time(self, spec: StageSpec, shape: WorkShape) -> float:
        c = self.p.cost.stage_cost(spec, shape)
        return float(c.fwd + c.bwd)

    def _split(self, layers: int, per_layer: float, extra: list[float], how: Layers) -> tuple[int, ...]:
        stages = len(extra)
        if how is Layers.EVEN or stages == 1:
            return even_split(layers, stages)
        if how is Layers.BALANCED:
            return balanced_split(layers, per_layer, extra)
        return first_last_split(layers, per_layer, extra)

    def llm_split(self, tp: int, stages: int, bin_samples: float, encoder_tp: int | None,
                  how: Layers) -> tuple[int, ...]:
        """Layers per LLM stage by ``how``, costed at the average bin; the first stage also runs the
        encoder when ``encoder_tp`` is given (colocated)."""
        key = (Module.LLM, tp, stages, round(bin_samples, 3), encoder_tp, how)
        if key not in self._splits:
            model = self.p.model
            tokens = bin_samples * self.mean_tokens
            shape = WorkShape(bin_samples, bin_samples * self.mean_tiles, tokens, tokens * self.mean_tokens,
                              bin_samples * self.mean_targets)
            layer = self._time(StageSpec(Module.LLM, 1, tp), shape)
            extra = [0.0] * stages
            extra[-1] += self._time(StageSpec(Module.LLM, 1, tp, last=True), shape) - layer
            if encoder_tp is not None:
                enc = StageSpec(Module.ENCODER, model.encoder.layers, encoder_tp, first=True, last=True)
                extra[0] += self._time(enc, WorkShape(bin_samples, bin_samples * self.mean_tiles))
            self._splits[key] = self._split(model.llm.layers, layer, extra, how)
        return self._splits[key]

    def encoder_split(self, tp: int, stages: int, chunk_tiles: float, how: Layers) -> tuple[int, ...]:
        key = (Module.ENCODER, tp, stages, round(chunk_tiles, 3), how)
        if key not in self._splits:
            shape = WorkShape(1, chunk_tiles)
            layer = self._time(StageSpec(Module.ENCODER, 1, tp), shape)
            extra = [0.0] * stages
            extra[0] += self._time(StageSpec(Module.ENCODER, 1, tp, first=True), shape) - layer
            extra[-1] += self._time(StageSpec(Module.ENCODER, 1, tp, last=True), shape) - layer
            self._splits[key] = self._split(self.p.model.encoder.layers, layer, extra, how)
        return self._splits[key]

    def _splits_of(self, space: Space, split: Callable[[Layers], tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The distinct splits a space allows, each as ``layers_per_stage`` (empty: even)."""
        out = []
        for how in space.layers:
            s = split(how)
            s = () if s == split(Layers.EVEN) else s
            if s not in out:
                out.append(s)
        return out

    def _pp_options(self, layers: int, options: tuple[int, ...], virtual: int = 1) -> list[int]:
        return [p for p in options if p * virtual <= layers]

    def plans(self, space: Space, placement: Placement,
              skip_split: Callable[[int], bool] | None = None) -> Iterator[list[Plan]]:
        """Plans of ``space`` with one placement, as lists alike but for recomputation (least
        first); ``skip_split(encoder_gpus)`` drops whole GPU splits of ``Encoder.FREE`` layouts."""
        placement = Placement(placement)
        if placement is Placement.COLOCATED:
            bases = self._colocated(space)
        elif placement is Placement.HETEROGENEOUS:
            bases = self._heterogeneous(space) if Encoder.PHASE in space.encoder else iter(())
        else:
            bases = self._disaggregated(space, skip_split or (lambda e: False))
        for base in bases:
            yield from variants(space, base, self.recompute)

    def _schedules(self, space: Space, ranks: int) -> Iterator[tuple[str, int]]:
        """(schedule, stages per rank) of a pipeline of ``ranks`` ranks; one rank runs only 1F1B."""
        if ranks == 1:
            yield "1F1B", 1
            return
        for kind in space.schedules:
            yield kind.name, kind.stages_per_rank or 2

    def _llm_layouts(self, space: Space, encoder_tp: Callable[[int], int | None]
                     ) -> Iterator[tuple[int, int, int, str, int, int, tuple[int, ...]]]:
        """(tp, pp, dp, schedule, virtual stages, microbatches, layer split) of every LLM layout on all
        the GPUs; the first stage's split costed with the encoder at ``encoder_tp(tp)`` (None: without)."""
        model = self.p.model
        for tp in self.llm_tp:
            for pp in self._pp_options(model.llm.layers, PP_OPTIONS):
                if self.n % (tp * pp) or pp > space.max_pp:
                    continue
                dp = self.n // (tp * pp)
                for schedule, virtual in self._schedules(space, pp):
                    if pp * virtual > model.llm.layers:
                        continue
                    for m in self.microbatches(space, dp, pp, schedule, virtual):
                        bin_samples = self.batch / (dp * m)
                        for split in self._splits_of(space, lambda how: self.llm_split(
                                tp, pp * virtual, bin_samples, encoder_tp(tp), how)):
                            yield tp, pp, dp, schedule, virtual, m, split

    def _colocated(self, space: Space) -> Iterator[Plan]:
        heads = self.p.model.encoder.heads
        for tp, pp, dp, schedule, virtual, m, split in self._llm_layouts(space, lambda tp: tp):
            if heads % tp == 0:
                yield Plan(encoder=ModulePlan(tp=tp, dp=dp), llm=ModulePlan(tp=tp, pp=pp, dp=dp, layers_per_stage=split),
                           placement=Placement.COLOCATED, microbatches=m, schedule=schedule, virtual_stages=virtual)

    def _heterogeneous(self, space: Space) -> Iterator[Plan]:
        """Every LLM layout, with the encoder on all the GPUs at every TP that tiles the LLM's."""
        for tp, pp, dp, schedule, virtual, m, split in self._llm_layouts(space, lambda tp: None):
            for etp in (t for t in self.enc_tp if t % tp == 0 or tp % t == 0):
                yield Plan(encoder=ModulePlan(tp=etp, dp=self.n // etp),
                           llm=ModulePlan(tp=tp, pp=pp, dp=dp, layers_per_stage=split),
                           placement=Placement.HETEROGENEOUS, microbatches=m, schedule=schedule,
                           virtual_stages=virtual)

    def encoder_gpu_options(self, llm_tp: int) -> list[int]:
        """GPUs the encoder may get: any count on small clusters, whole nodes from 4 nodes up, and
        at most ~32 choices on large ones (in whole nodes, or in whole TP groups on a few nodes of
        very many GPUs, where every count was a million choices to bound)."""
        quantum = self.per_node if self.n >= 4 * self.per_node else 1
        if self.n >= 32 * self.per_node:
            quantum = (self.n // 32) // self.per_node * self.per_node
        elif self.n // quantum > 32:
            quantum = max(llm_tp, (self.n // 32) // llm_tp * llm_tp)
        return [e for e in range(quantum, self.n, quantum) if e % llm_tp == 0]

    def _layouts(self, space: Space, skip_split: Callable[[int], bool]) -> Iterator[tuple[tuple[int, ...], Encoder]]:
        """(llm tp, pp, dp, encoder tp, pp, dp) of every disaggregated layout the space allows, and
        which kind of layout it is."""
        model, seen = self.p.model, set()
        for tp in self.llm_tp:
            for pp in self._pp_options(model.llm.layers, PP_OPTIONS):
                if pp > space.max_pp:
                    continue
                if Encoder.STAGE in space.encoder:  # Megatron: per replica, epp x etp + pp x tp GPUs
                    for etp in (t for t in self.enc_tp if t <= tp):
                        for epp in self._pp_options(model.encoder.layers, ENCODER_PP_OPTIONS):
                            per_replica = epp * etp + pp * tp
                            dp = self.n // per_replica
                            if self.n % per_replica == 0 and (dp * epp * etp) % tp == 0:
                                seen.add(key := (tp, pp, dp, etp, epp, dp))
                                yield key, Encoder.STAGE
                if Encoder.FREE not in space.encoder:
                    continue
                for enc_gpus in self.encoder_gpu_options(tp):
                    if (self.n - enc_gpus) % (tp * pp) or skip_split(enc_gpus):
                        continue
                    dp = (self.n - enc_gpus) // (tp * pp)
                    for etp in self.enc_tp:
                        for epp in self._pp_options(model.encoder.layers, ENCODER_PP_OPTIONS):
                            if enc_gpus % (etp * epp) == 0:
                                key = (tp, pp, dp, etp, epp, enc_gpus // (etp * epp))
                                if key not in seen:
                                    yield key, Encoder.FREE

    def _disaggregated(self, space: Space, skip_split: Callable[[int], bool]) -> Iterator[Plan]:
        if not space.encoder:
            return
        for (tp, pp, dp, etp, epp, edp), layout in self._layouts(space, skip_split):
            # Megatron's layouts with Megatron's splits; dflop's own with the balanced split only
            how = replace(space, layers=(Layers.BALANCED,)) if layout is Encoder.FREE else space
            # several stages per rank need colocated placement (Plan.problems)
            runs = {s: self.microbatches(space, dp, pp + epp, s, 1)
                    for s, virtual in self._schedules(space, pp + epp) if virtual == 1}
            for m in MICROBATCH_OPTIONS:
                schedules = [s for s, options in runs.items() if m in options]
                if not schedules:
                    continue
                bin_samples = self.batch / (dp * m)
                chunk = self.batch * self.mean_tiles / (edp * m)
                llm = self._splits_of(how, lambda h: self.llm_split(tp, pp, bin_samples, None, h))
                enc = self._splits_of(how, lambda h: self.encoder_split(etp, epp, chunk, h))
                for schedule in schedules:
                    for split in llm:
                        for esplit in enc:
                            yield Plan(encoder=ModulePlan(tp=etp, pp=epp, dp=edp, layers_per_stage=esplit),
                                       llm=ModulePlan(tp=tp, pp=pp, dp=dp, layers_per_stage=split),
                                       placement=Placement.DISAGGREGATED, microbatches=m, schedule=schedule)
