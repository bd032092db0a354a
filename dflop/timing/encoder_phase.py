"""What a heterogeneous encoder phase costs: its ENCODE and ENCODE_B ops, its all-to-alls, its reduction.

With heterogeneous placement every GPU of the job (or the first tp x dp) also
belongs to one encoder replica (``place``: replica x holds GPUs
``[x * tp, (x + 1) * tp)``), and the encoder's TP groups tile the LLM's; a rank
beyond the encoder's GPUs encodes nothing and holds none of its state. A rank (an LLM TP group) runs the encoder
work of every replica on its GPUs, so its ENCODE takes as long as the slowest
of them: the rank's next LLM op needs all its GPUs. Each sample is encoded by
one encoder replica (``routing.encoder_ranks``: its tiles balanced over the
replicas, independently of its LLM bin) and its embeddings travel to the LLM
stage-0 rank of its bin's replica; the all-to-all takes as long as the busiest
rank's sends or receives, pair by pair over the link between the two ranks.
The encoder's gradients are reduced over its own replicas after ENCODE_B, in
buckets that overlap its last chunk, as the LLM's overlap its last backward. A stage-0
rank holds the embeddings it receives and their gradients from the all-to-all
until ENCODE_B.

The phase keeps no activations through the LLM's pipeline: ENCODE runs its
samples in ``microbatches`` chunks, keeping only the embeddings it sends (and
the pixels), and ENCODE_B runs each chunk's forward again before its backward.
Keeping a whole step's encoder activations instead would hold up to
``microbatches`` times a microbatch's for the length of the pipeline: for
InternViT-6B on video, hundreds of GB per GPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from dflop.cost.comm import p2p_time
from dflop.cost.memory import layer_params, stage_params, state_bytes
from dflop.cost.overlap import bucket_lag, bucket_slowdown
from dflop.cost.protocol import StageSpec, WorkShape
from dflop.program.actions import Kind
from dflop.program.collectives import CollectiveSpec
from dflop.program.routing import encoder_ranks
from dflop.specs.hardware import TrainingSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module, Plan, place
from dflop.timing.dpcomm import NS, GroupComm, TimedCollective, dp_gpus, group_comm, to_ns
from dflop.workload.sample import SampleTable


@dataclass(frozen=True)
class EncoderWork:
    """One batch's encoder phase, per worker (``StepGraph.workers`` order)."""

    forward: np.ndarray
    """ns of each worker's ENCODE."""
    backward: np.ndarray
    """ns of each worker's ENCODE_B."""
    chunk_bytes: np.ndarray
    """Bytes per GPU one chunk holds while ENCODE or ENCODE_B runs it (nothing is held between them)."""
    embeddings: np.ndarray
    """Bytes per GPU a stage-0 rank holds from ENCODE to ENCODE_B: the embeddings it receives (every TP
    rank a whole copy) and their gradients."""
    flops: np.ndarray
    """Model FLOPs per GPU of ENCODE (ENCODE_B: twice as many, and ENCODE's again, recomputed)."""
    recompute_flops: np.ndarray
    """FLOPs of the plan's own recomputation inside a backward."""
    samples: np.ndarray
    """Samples (with images) the encoder replicas on the worker's GPUs encode, for traces."""
    tiles: np.ndarray
    exchange: int
    """ns of each all-to-all (embeddings forward, their gradients back: the same bytes)."""


def phase_spec(plan: Plan, model: MLLMSpec) -> StageSpec:
    """The whole encoder as one stage at the encoder's own tp, as every replica of the phase runs it."""
    return StageSpec(Module.ENCODER, model.encoder.layers, plan.encoder.tp, first=True, last=True,
                     recompute=plan.recompute)


def embedding_copies(training: TrainingSpec) -> int:
    """What a stage-0 rank holds of each embedding the all-to-all brings: it, and its gradient where
    the encoder trains."""
    return 1 if training.freeze_encoder else 2


def phase_state(plan: Plan, model: MLLMSpec, training: TrainingSpec) -> float:
    """Encoder weights, gradients and optimizer state per GPU holding a replica's share (weights alone
    for a frozen encoder)."""
    spec = phase_spec(plan, model)
    params = float(stage_params(model, spec))
    return float(sum(state_bytes(params, plan.encoder.tp, plan.encoder.dp, plan.zero, training,
                                 layer_params(model, Module.ENCODER), fp32_grads=plan.fp32_grads,
                                 frozen=params if training.freeze_encoder else 0.0)))


class EncoderPhase:
    """The batch-independent half: GPUs, links, model state and the encoder's reduction, built once per plan."""

    def __init__(self, builder) -> None:
        plan, model, cluster = builder.plan, builder.model, builder.cluster
        self.builder = builder
        self.spec = phase_spec(plan, model)
        gpu_map = place(plan)
        replicas = [gpu_map.gpus(Module.ENCODER, 0, j) for j in range(plan.encoder.dp)]
        workers = [gpus for group in builder.gpus for gpus in group]
        replica_of = {g: j for j, gpus in enumerate(replicas) for g in gpus}
        self.touch = [sorted(Counter(replica_of[g] for g in gpus if g in replica_of).items()) for gpus in workers]
        """Per worker: (encoder replica, its GPUs inside the worker) of every replica on its GPUs (none
        where the encoder runs on the job's first GPUs only)."""
        owner = {g: w for w, gpus in enumerate(workers) for g in gpus}
        self.host = np.array([owner[replica[0]] for replica in replicas], dtype=np.int64)
        """Per encoder replica: the worker its embeddings leave from."""
        self.first_stage = np.arange(plan.llm.dp, dtype=np.int64)
        """Per LLM replica: the worker of its stage 0 (group 0, the first ``dp`` workers)."""
        self.tp = builder.t.groups[0].tp
        self.node = np.array([cluster.node_of(gpus[0]) for gpus in workers])
        self.hardware = cluster.hardware
        params = float(stage_params(model, self.spec))
        r = plan.llm.dp  # every group has the LLM's replicas, its workers in order
        holds = np.array([any(self.touch[w] for w in range(g * r, (g + 1) * r)) for g in range(len(builder.gpus))])
        self.static_bytes = phase_state(plan, model, builder.training) * holds
        """Per group: the encoder replica's state, on the groups whose GPUs hold one."""
        self.comm: GroupComm | None = group_comm(plan, model, builder.training, cluster, params, plan.encoder.tp,
                                                 dp_gpus(replicas), Module.ENCODER, (0,), builder.cost)

    def work(self, batch: SampleTable, assignment: np.ndarray) -> EncoderWork:
        b = self.builder
        plan = b.plan
        rank = encoder_ranks(batch.tiles, plan.encoder.dp)
        tiles = np.bincount(rank, weights=batch.tiles.astype(float), minlength=plan.encoder.dp)
        samples = np.bincount(rank, weights=(batch.tiles > 0).astype(float), minlength=plan.encoder.dp)
        chunk = b.cost.stage_cost(self.spec, WorkShape(samples / b.m, tiles / b.m))  # as the phase runs them
        fields = {f: np.broadcast_to(np.asarray(getattr(chunk, f), dtype=float), tiles.shape)
                  for f in ("fwd", "bwd", "act_bytes", "transient_bytes", "forward_transient_bytes", "flops",
                            "recompute_flops")}
        for f in ("fwd", "bwd", "flops", "recompute_flops"):
            fields[f] = fields[f] * b.m

        def most(field: str) -> np.ndarray:
            return np.array([max((fields[field][j] for j, _ in mine), default=0.0) for mine in self.touch])

        def per_gpu(values: np.ndarray) -> np.ndarray:  # the worker's GPUs together, over its GPUs
            return np.array([sum(values[j] * n for j, n in mine) / self.tp for mine in self.touch])

        def held(values: np.ndarray) -> np.ndarray:  # what the replicas on the worker's GPUs encode
            return np.array([sum(values[j] for j, _ in mine) for mine in self.touch])

        fields["again"] = fields["fwd"] + fields["bwd"]  # ENCODE_B: each chunk's forward, then its backward
        fields["chunk"] = fields["act_bytes"] + np.maximum(fields["transient_bytes"], fields["forward_transient_bytes"])
        exchange, received = self._exchange(batch, assignment, rank)
        return EncoderWork(to_ns(most("fwd")), to_ns(most("again")), most("chunk"),
                           embedding_copies(b.training) * received,
                           per_gpu(fields["flops"]), per_gpu(fields["recompute_flops"]),
                           held(samples), held(tiles), exchange)

    def _exchange(self, batch: SampleTable, assignment: np.ndarray, rank: np.ndarray) -> tuple[int, np.ndarray]:
        """ns of one all-to-all (every image sample's embeddings from its encoder replica's worker to
        its LLM replica's stage-0 worker; the busiest worker's sends or receives, one after another),
        and the bytes each worker receives (its own included)."""
        b, hw = self.builder, self.hardware
        workers = len(self.touch)
        src = self.host[rank]
        dst = self.first_stage[assignment // b.m]
        nbytes = batch.image_tokens.astype(float) * b.model.llm.hidden * b.training.activation_bytes
        received = np.bincount(dst, weights=nbytes, minlength=workers)
        moved = (src != dst) & (nbytes > 0)
        pairs, at = np.unique(src[moved] * workers + dst[moved], return_inverse=True)
        pair_bytes = np.bincount(at, weights=nbytes[moved], minlength=len(pairs))
        sender, receiver = pairs // workers, pairs % workers
        within = self.node[sender] == self.node[receiver]
        seconds = p2p_time(pair_bytes, np.where(within, hw.intra_node_bandwidth, hw.inter_node_bandwidth) * self.tp,
                           np.where(within, hw.intra_node_latency, hw.inter_node_latency))
        busiest = max(np.bincount(sender, weights=seconds, minlength=workers).max(initial=0.0),
                      np.bincount(receiver, weights=seconds, minlength=workers).max(initial=0.0))
        return int(to_ns(busiest)), received

    def collective(self, spec: CollectiveSpec, work: EncoderWork, duration, slowdown: float) -> TimedCollective:
        """Price one of the phase's collectives; the encoder's reduction slows the ENCODE_B it overlaps
        (``duration``, per op and replica, in place), as ``dpcomm.reduction`` does the LLM's."""
        if spec.kind is not Kind.REDUCE_ENCODER_GRAD:
            return TimedCollective(spec.kind, -1, spec.op, work.exchange,
                                   np.zeros(len(self.touch), dtype=np.int64), spec.ops)
        seconds = self.comm.reduce + self.comm.gather
        lags = []
        for op in spec.ops:
            backward = duration[op] / NS
            last = backward / self.builder.m  # the gradients are whole only in the last chunk's backward
            lag = backward - last + bucket_lag(last, seconds, self.comm.buckets)
            duration[op] = duration[op] + to_ns(bucket_slowdown(backward, seconds, lag, slowdown))
            lags.append(to_ns(lag))
        return TimedCollective(spec.kind, -1, spec.op, int(to_ns(seconds)), np.concatenate(lags), spec.ops)

