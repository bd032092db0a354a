"""The interpreter of one worker's list in a step graph, with real tensors.

One handler per node kind, as torch's ``_PipelineScheduleRuntime._step_microbatches``
runs its lowered actions: a forward feeds its stage the microbatch's inputs
(synthetic pixels or tokens, a local stage's output, or what a receive
brought), keeps what the backward needs and hands its output on; a backward
runs autograd from the output's gradient (whole, or split into input and weight
gradients for zero-bubble schedules with torch's own ``stage_backward_input`` /
``stage_backward_weight``); sends and receives are torch's asynchronous
point-to-point (a receive is waited for just before its consumer, sends at the
end of the step); the bridge moves each sample's image tokens between the
encoder replica that encoded it and the LLM replica that owns it; REDUCE_GRAD
sums gradients over data parallelism where FSDP2 does not (ZeRO-0/1), and
UNSHARD marks FSDP2's gathers. A heterogeneous encoder phase runs on every rank:
ENCODE without autograd, one ``all_to_all_single`` each way (embeddings to the
LLM's first stage, their gradients back), ENCODE_B recomputing before its
backward, and REDUCE_ENCODER_GRAD over every encoder replica.

Every node is timed (monotonic nanoseconds on CPU, CUDA events on GPU). A
failure names the rank, the step and the node, and shows the worker's list
with the failing node marked (what torch's ``_format_pipeline_order`` does).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from dflop.errors import DflopError
from dflop.models.llm import pack
from dflop.program.actions import Kind
from dflop.program.stepgraph import Node, StepGraph
from dflop.specs.plan import Module, Strategy
from dflop.workload.pixels import MediaError

from dflop.backends.torch_runtime.model import Sequence, pack_sequence, sample_inputs
from dflop.backends.torch_runtime.parallel import RankLayout, all_reduce_grads
from dflop.backends.torch_runtime.progress import WARMUP, lost_ranks
from dflop.backends.torch_runtime.shapes import StepData


NAMED = 8
"""Peers a failure names at most (a node lost in a large job takes many ranks with it)."""
CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
"""How gloo says that the process at the other end of a link is gone."""


class ActionFailed(DflopError):
    """One node of the step graph failed on one rank; the message names both."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class Clock:
    """Node start and end times: monotonic nanoseconds, or CUDA events read after the step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.monotonic_ns())
        return len(self.marks) - 1

    def resolve(self) -> list[int]:
        """Every mark in ns since the first one (the step's start)."""
        if not self.cuda:
            return [m - self.marks[0] for m in self.marks]
        torch.cuda.synchronize()
        first = self.marks[0]
        return [int(first.elapsed_time(m) * 1e6) for m in self.marks]


@dataclass
class RankState:
    """What one rank holds across steps: its stage modules, its layout, its groups."""

    graph_worker: int
    layout: RankLayout
    stages: dict[int, nn.Module]
    """Program stage -> module."""
    colocated_encoder: nn.Module | None
    dp_group: Any
    device: torch.device
    seed: int
    image_size: int
    vocab: int
    strategy: Strategy
    phase: "EncoderPhase | None" = None
    """Heterogeneous placement: the encoder replica this rank also runs, in a phase of its own."""

    def pipeline_parameters(self) -> list[nn.Parameter]:
        """The trained parameters of its pipeline stages (a colocated encoder's included, unless frozen)."""
        mods = list(self.stages.values()) + ([self.colocated_encoder] if self.colocated_encoder is not None else [])
        seen: dict[int, nn.Parameter] = {}
        for m in mods:
            for p in m.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter its optimizer updates."""
        encoder = self.phase.encoder if self.phase is not None else None
        phase = [p for p in encoder.parameters() if p.requires_grad] if encoder is not None else []
        return self.pipeline_parameters() + phase


@dataclass
class EncoderPhase:
    """A rank's part in a heterogeneous plan's encoder phase: its encoder replica (None and -1 on a
    rank beyond the encoder's GPUs, which still takes part in the all-to-all), the group of the
    all-to-all (every rank), the group its gradients are reduced over (every replica; None beyond
    them), and the rank of each LLM replica's first stage."""

    encoder: nn.Module | None
    replica: int
    group: Any
    reduce_group: Any
    first_stage: tuple[int, ...]
    """Per LLM replica: the torch rank of its stage 0 (where its samples' embeddings go)."""


@dataclass
class RankStep:
    """One step on one rank: walk the worker's nodes, keeping what forwards leave for backwards."""

    w: RankState
    graph: StepGraph
    data: StepData
    step: int
    clock: Clock
    saved: dict[tuple[int, int], tuple[list[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    grads: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)
    """Gradient of a stage's input (what its backward sends upstream)."""
    param_groups: dict[tuple[int, int], list] = field(default_factory=dict)
    received: dict[int, tuple[Any, torch.Tensor]] = field(default_factory=dict)
    """Receive node -> (work, buffer)."""
    bridged: dict[tuple[int, int], dict[int, torch.Tensor]] = field(default_factory=dict)
    """(stage, microbatch) -> peer worker -> the image tokens received from it (leaves)."""
    sends: list[Any] = field(default_factory=list)
    recv_marks: dict[int, int] = field(default_factory=dict)
    """Receive node -> the mark of its posting (its end is marked when its consumer waits)."""
    loss: float = 0.0
    times: list[tuple[int, int, int]] = field(default_factory=list)
    """(node, start mark, end mark)."""
    dtype: torch.dtype = torch.float32
    hidden: dict[Module, int] = field(default_factory=dict)
    """Hidden size of each module (what crosses a stage boundary)."""
    patches: int = 0
    """Encoder sequence length of one tile."""
    progress: Any = None
    """Where this rank writes the node it is at (``ProgressFile``), to be read if it dies."""
    fail: tuple[str, str] = ("", "")
    """(node label, how: raise or exit): fail there (tests of failure handling)."""
    cache: dict = field(default_factory=dict)
    """Inputs made by ``prepare`` before the step."""
    gpus_per_node: int = 0
    """Of the planned cluster, to name the node of a peer a failure involves (0: name none)."""
    decoded: dict[str, torch.Tensor | str] | None = None
    """Pixels decoded ahead (``decoding.decode``), by sample id: a sample's tiles, or why they did not
    decode; every sample whose pixels this rank feeds is there. None: decoded here, by :meth:`prepare`."""
    warmup: bool = False
    """The step's graph run untimed before the first step (``worker.run_rank``'s warm-up): where it
    is and how it failed say so."""
    inputs_s: float = 0.0
    """Seconds the rank spent making its inputs (:meth:`prepare`, waiting for its pixels included)."""
    decode_s: float = 0.0
    """Seconds decoding its pixels took where it ran: in a worker, ahead; in the rank (no workers),
    within ``inputs_s``."""
    undecodable: dict[str, str] = field(default_factory=dict)
    """Samples whose media this rank could not make into inputs: id -> why."""
    exchange: dict[str, Any] = field(default_factory=dict)
    """A heterogeneous encoder phase's tensors: its embeddings, what the all-to-all brought, the
    per-microbatch leaves the LLM's first stage read, the gradients going back."""

    @property
    def t(self):  # noqa: ANN201 - Template
        return self.graph.template

    def replica(self, worker: int | None = None) -> int:
        return self.graph.workers[self.w.graph_worker if worker is None else worker].replica

    def handlers(self) -> dict[Kind, Callable[[int, Node], None]]:
        """One handler per node kind, as torch's ``_step_microbatches`` dispatches its actions: a
        compute or collective node waits for the receives it reads and is timed; a send is timed
        from its start; a receive is posted (its end is marked when its consumer waits for it).
        OVERLAP_F_B has none: the step graph holds its halves as two nodes."""
        after_inputs = {Kind.F: self.forward, Kind.B: self.backward, Kind.I: self.backward, Kind.W: self.weight,
                        Kind.REDUCE_GRAD: self.reduce_grad, Kind.UNSHARD: self.sharded, Kind.RESHARD: self.sharded,
                        Kind.ENCODE: self.encode, Kind.ALL_TO_ALL_F: self.exchange_forward,
                        Kind.ALL_TO_ALL_B: self.exchange_backward, Kind.ENCODE_B: self.encode_backward,
                        Kind.REDUCE_ENCODER_GRAD: self.reduce_encoder_grad}
        table = {kind: self._timed(run, wait=True) for kind, run in after_inputs.items()}
        for kind in Kind:
            if kind.is_send:
                table[kind] = self._timed(self.send, wait=False)
            elif kind.is_recv:
                table[kind] = self.receive
        return table

    def _timed(self, run: Callable[[int, Node], None], wait: bool) -> Callable[[int, Node], None]:
        def timed(n: int, node: Node) -> None:
            if wait:
                self.wait_inputs(n)
            start = self.clock.mark()
            run(n, node)
            self.times.append((n, start, self.clock.mark()))
        return timed

    def run(self) -> None:
        handlers = self.handlers()
        for n in self.graph.order[self.w.graph_worker]:
            node = self.graph.nodes[n]
            self.at(self.graph.labels[n])
            if self.fail[0] == self.graph.labels[n]:
                self.inject_failure()
            try:
                if node.kind not in handlers:
                    raise DflopError(f"the torch runtime has no handler for {node.kind.value} nodes")
                handlers[node.kind](n, node)
            except ActionFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - named, then re-raised for the launcher
                raise self.failure(n, exc) from exc
        for work in self.sends:
            work.wait()

    def at(self, label: str) -> None:
        """Write where this rank is (``label``: a node, or what it does between two steps) to its
        progress file, if it keeps one: read to name where it stopped if it dies."""
        if self.progress is not None:
            self.progress.write(self.step, f"{WARMUP} {label}" if self.warmup else label)

    def inject_failure(self) -> None:
        if self.fail[1] == "exit":
            os._exit(17)  # dies without a word, as a killed process does
        raise RuntimeError("injected failure")

    def failure(self, n: int, exc: BaseException) -> ActionFailed:
        ids = self.graph.order[self.w.graph_worker]
        lines = [f"{'>>' if i == n else '  '} {self.graph.labels[i]}" for i in ids]
        return self.failed(f"node {self.graph.labels[n]}", self.peers_of(n), exc, self.graph.nodes[n], "\n".join(lines))

    def failed(self, where: str, peers: list[int], exc: BaseException, node: Node | None = None,
               details: str = "") -> ActionFailed:
        """The one-line error of this rank failing ``where`` (a node of the step graph, or a collective
        between steps) while it exchanged with ``peers``."""
        what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if node is not None and (isinstance(exc, torch.OutOfMemoryError) or "out of memory" in what.lower()):
            what = f"out of memory ({self.shape_of(node)}): {what}"
        return ActionFailed(f"rank {self.w.layout.rank} (w{self.w.graph_worker}) failed at step {self.step}"
                            f"{' (its graph run as the warm-up)' if self.warmup else ''}, "
                            f"{where}{self.peers_named(peers, what)}: {type(exc).__name__}: {what}", details=details)

    def peers_of(self, n: int) -> list[int]:
        """The ranks node ``n`` exchanges with: a send's receivers, a receive's sender (also while its
        consumer waits for it: its end is not marked yet), a gradient reduction's replicas."""
        node, layout = self.graph.nodes[n], self.w.layout
        if node.kind.is_send:
            return layout.send_to(node.peer)
        if node.kind is Kind.REDUCE_GRAD and not self.w.strategy.runs_as_fsdp2:
            return [r for r in dist.get_process_group_ranks(self.w.dp_group) if r != layout.rank]
        if node.kind in (Kind.ALL_TO_ALL_F, Kind.ALL_TO_ALL_B, Kind.REDUCE_ENCODER_GRAD):
            group = self.w.phase.reduce_group if node.kind is Kind.REDUCE_ENCODER_GRAD else self.w.phase.group
            return [r for r in dist.get_process_group_ranks(group) if r != layout.rank] if group is not None else []
        waiting = [n] if node.kind.is_recv else [d for d in self.graph.inputs[n] if d in self.recv_marks][:1]
        return [layout.recv_from(self.graph.nodes[d].peer) for d in waiting]

    def peers_named(self, peers: list[int], what: str) -> str:
        """', lost rank 2 (node 1)' when the connection to a peer broke (the peer died, or its node:
        the ranks really gone, see ``lost_ranks``), ', with rank 2 (node 1)' for another failure of a
        communication; '' otherwise."""
        if not peers:
            return ""
        lost = any(m in what for m in CONNECTION_LOST)
        if lost and self.progress is not None:
            peers = lost_ranks(self.progress.folder, peers)
            self.progress.record_lost(peers)
        per_node = self.gpus_per_node
        names = ", ".join(f"rank {r}" + (f" (node {r // per_node})" if per_node else "") for r in peers[:NAMED])
        more = f" and {len(peers) - NAMED} more" if len(peers) > NAMED else ""
        return f", {'lost' if lost else 'with'} {names}{more}"

    def shape_of(self, node: Node) -> str:
        if node.microbatch < 0:
            return "no microbatch"
        module, stage = self.t.module_stage(node.stage)
        rows = self.rows(module, node.microbatch)
        return (f"{module} stage {stage}, microbatch {node.microbatch}: {len(rows)} samples, "
                f"{int(self.data.batch.tiles[rows].sum())} tiles, {int(self.data.batch.llm_tokens[rows].sum())} tokens")

    # ---- shapes -----------------------------------------------------------------------------------

    def rows(self, module: Module, k: int) -> np.ndarray:
        if module is Module.LLM:
            return self.data.llm_rows(self.replica(), k)
        return self.data.encoder_rows(self.replica(), k)

    def prepare(self) -> None:
        """Make every input this worker's forwards read (pixels, tokens, packed positions) before the
        step starts, as a data loader would: generating them is not the step's work. The pixels are
        those of ``decoded`` when given (decoded ahead), else decoded here."""
        for n in self.graph.order[self.w.graph_worker]:
            node = self.graph.nodes[n]
            if node.kind is Kind.ENCODE:
                for chunk in self.data.phase_chunks(self.w.phase.replica):
                    self.inputs_of(chunk, pixels=True)
            if node.kind is not Kind.F:
                continue
            module, stage = self.t.module_stage(node.stage)
            rows = self.rows(module, node.microbatch)
            if module is Module.LLM:
                self.sequence(rows)
                if stage == 0 and self.w.colocated_encoder is not None:
                    self.inputs_of(rows[self.data.batch.tiles[rows] > 0], pixels=True)
            elif stage == 0:
                self.inputs_of(rows, pixels=True)

    def inputs_of(self, rows: np.ndarray, pixels: bool) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        key = ("inputs", rows.tobytes(), pixels)
        if key not in self.cache:
            self.cache[key] = self._make_inputs(rows, pixels)
        return self.cache[key]

    def _make_inputs(self, rows: np.ndarray, pixels: bool) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        b = self.data.batch
        pix, text = [], []
        here = pixels and self.decoded is None
        for i in rows:
            try:
                p, tok = sample_inputs(self.w.seed, str(b.ids[i]), int(b.tiles[i]), int(b.text_tokens[i]),
                                       self.w.image_size, self.w.vocab, need_pixels=here, text=self.data.text)
                if pixels and not here:
                    p = self.decoded_pixels(str(b.ids[i]))
            except MediaError as exc:  # the step is made again without it, on every rank (worker._undecodable_anywhere)
                self.undecodable[str(b.ids[i])] = str(exc)
                p, tok = torch.zeros(int(b.tiles[i]), 3, self.w.image_size, self.w.image_size), torch.zeros(0)
            if p is not None and len(p):
                pix.append(p)
            text.append(tok)
        dev = self.w.device
        if not pixels:
            return None, text
        shape = (0, 3, self.w.image_size, self.w.image_size)
        return (torch.cat(pix) if pix else torch.zeros(shape)).to(device=dev, dtype=self.dtype), text

    def decoded_pixels(self, sample_id: str) -> torch.Tensor:
        """The tiles of ``sample_id`` decoded ahead (none for a sample without media); a ``MediaError``
        where they did not decode."""
        if sample_id not in self.decoded and not self.data.text[sample_id].images:
            return torch.zeros(0, 3, self.w.image_size, self.w.image_size)
        if sample_id not in self.decoded:
            raise DflopError(f"rank {self.w.layout.rank}, step {self.step}: sample {sample_id!r} feeds pixels here, "
                             "but its media were not decoded ahead (StepData.pixel_rows or phase_rows left it out)")
        got = self.decoded[sample_id]
        if isinstance(got, str):
            raise MediaError(got)
        return got

    def sequence(self, rows: np.ndarray) -> tuple[Sequence, torch.Tensor, torch.Tensor, torch.Tensor]:
        key = ("sequence", rows.tobytes())
        if key not in self.cache:
            self.cache[key] = self._make_sequence(rows)
        return self.cache[key]

    def _make_sequence(self, rows: np.ndarray) -> tuple[Sequence, torch.Tensor, torch.Tensor, torch.Tensor]:
        _, text = self.inputs_of(rows, pixels=False)
        seq = pack_sequence(self.data.image_tokens(rows), text, self.data.target_masks(rows), self.data.layouts(rows))
        positions, cu = pack(seq.lengths, device=self.w.device) if seq.lengths else (
            torch.zeros(0, dtype=torch.long, device=self.w.device), torch.zeros(1, dtype=torch.int32,
                                                                                  device=self.w.device))
        tokens = torch.cat(text).to(self.w.device) if text else torch.zeros(0, dtype=torch.long, device=self.w.device)
        return seq, positions, cu, tokens

    def hidden_shape(self, module: Module, stage: int, k: int, replica: int) -> tuple[int, ...]:
        """Shape of the activation entering module-local ``stage`` (> 0) of ``replica`` in microbatch k."""
        if module is Module.LLM:
            rows = self.data.llm_rows(replica, k)
            return (int(self.data.batch.llm_tokens[rows].sum()), self.hidden[Module.LLM])
        rows = self.data.encoder_rows(replica, k)
        return (int(self.data.batch.tiles[rows].sum()), self.patches, self.hidden[Module.ENCODER])

    # ---- communication ----------------------------------------------------------------------------

    def peer_tensor_shape(self, node: Node) -> tuple[int, ...]:
        """Shape of what a receive brings (the sender computes the same from the same schedule)."""
        module, stage = self.t.module_stage(node.stage)
        k = node.microbatch
        if node.kind in (Kind.BRIDGE_RECV_F, Kind.BRIDGE_RECV_B):
            j, r = ((self.replica(node.peer), self.replica()) if node.kind is Kind.BRIDGE_RECV_F
                    else (self.replica(), self.replica(node.peer)))
            rows = self.data.bridge_rows(j, r, k)
            return (int(self.data.batch.image_tokens[rows].sum()), self.hidden[Module.LLM])
        if node.kind is Kind.RECV_F:
            return self.hidden_shape(module, stage, k, self.replica())
        return self.hidden_shape(module, stage + 1, k, self.replica())  # RECV_B: gradient of our output

    def receive(self, n: int, node: Node) -> None:
        self.recv_marks[n] = self.clock.mark()
        self.post_receive(n, node)

    def post_receive(self, n: int, node: Node) -> None:
        buf = torch.empty(self.peer_tensor_shape(node), device=self.w.device, dtype=self.dtype)
        src = self.w.layout.recv_from(node.peer)
        self.received[n] = (dist.irecv(buf, src=src) if buf.numel() else None, buf)

    def wait_inputs(self, n: int) -> None:
        """Wait for the receives this node reads, marking each one's end."""
        for d in self.graph.inputs[n]:
            if d in self.received:
                work, _ = self.received[d]
                if work is not None:
                    work.wait()
                self.times.append((d, self.recv_marks.pop(d), self.clock.mark()))

    def received_tensor(self, d: int) -> torch.Tensor:
        return self.received.pop(d)[1]

    def send(self, n: int, node: Node) -> None:
        tensor = self.outgoing(node).detach().contiguous()
        if tensor.numel():
            for dst in self.w.layout.send_to(node.peer):
                self.sends.append(dist.isend(tensor, dst=dst))

    def outgoing(self, node: Node) -> torch.Tensor:
        s, k = node.stage, node.microbatch
        if node.kind is Kind.SEND_F:
            return self.outputs[(s, k)]
        if node.kind is Kind.SEND_B:
            return self.grads[(s, k)]
        if node.kind is Kind.BRIDGE_SEND_F:  # the image tokens of the samples the peer owns
            r = self.replica(node.peer)
            rows = self.data.bridge_rows(self.replica(), r, k)
            return self.outputs[(s, k)].index_select(0, self.token_rows(self.rows(Module.ENCODER, k), rows))
        # BRIDGE_SEND_B: the gradient of the image tokens that peer encoder replica sent us
        return self.bridged[(s, k)][node.peer].grad

    def token_rows(self, layout_rows: np.ndarray, subset: np.ndarray) -> torch.Tensor:
        """Positions, in a tensor of ``layout_rows``' image tokens laid end to end, of ``subset``'s tokens."""
        counts = self.data.batch.image_tokens[layout_rows]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        where = {int(r): i for i, r in enumerate(layout_rows)}
        parts = [np.arange(starts[where[int(r)]], starts[where[int(r)]] + counts[where[int(r)]]) for r in subset]
        idx = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return torch.from_numpy(idx.astype(np.int64)).to(self.w.device)

    # ---- compute ----------------------------------------------------------------------------------

    def stage_input(self, n: int, module: Module, s: int, k: int) -> torch.Tensor:
        """Input of a non-first stage: the local previous stage's output, or what a receive brought
        (no gradient flows into a frozen encoder's)."""
        if (s - 1, k) in self.outputs and (s - 1) in self.w.stages:
            x = self.outputs[(s - 1, k)].detach()
        else:
            recv = next(d for d in self.graph.inputs[n] if self.graph.nodes[d].kind is Kind.RECV_F)
            x = self.received_tensor(recv)
        return x.requires_grad_(x.is_floating_point() and not self.frozen(module))

    def frozen(self, module: Module) -> bool:
        """``module`` runs forward only (a frozen encoder): nothing of it needs a gradient."""
        return module is Module.ENCODER and self.t.frozen_encoder

    def image_tokens(self, n: int, s: int, k: int, rows: np.ndarray) -> tuple[torch.Tensor | None, list]:
        """The bin's image tokens, in bin order: encoded here (colocated) or brought by the bridge."""
        if self.w.colocated_encoder is not None:
            enc_rows = rows[self.data.batch.tiles[rows] > 0]
            # no images: nothing to encode (with FSDP every replica still runs it: its gathers are collective)
            if not len(enc_rows) and not self.w.strategy.runs_as_fsdp2:
                return None, []
            pixels, _ = self.inputs_of(enc_rows, pixels=True)
            with torch.set_grad_enabled(not self.frozen(Module.ENCODER)):
                return self.w.colocated_encoder(pixels, self.data.tiles(enc_rows), self.data.image_tokens(enc_rows),
                                                self.data.images(enc_rows)), []
        if self.w.phase is not None:  # what the all-to-all brought, one leaf per microbatch
            return self.phase_input(rows)
        total = int(self.data.batch.image_tokens[rows].sum())
        image = torch.zeros(total, self.hidden[Module.LLM], device=self.w.device, dtype=self.dtype)
        leaves = {}
        for d in self.graph.inputs[n]:
            node = self.graph.nodes[d]
            if node.kind is Kind.BRIDGE_RECV_F:
                msg = self.received_tensor(d).requires_grad_(not self.frozen(Module.ENCODER))
                leaves[node.peer] = msg
                sent = self.data.bridge_rows(self.replica(node.peer), self.replica(), k)
                image = image.index_copy(0, self.token_rows(rows, sent), msg)
        self.bridged[(s, k)] = leaves
        return image, [] if self.frozen(Module.ENCODER) else list(leaves.values())

    def forward(self, n: int, node: Node) -> None:
        s, k = node.stage, node.microbatch
        module, local_stage = self.t.module_stage(s)
        stage = self.w.stages[s]
        rows = self.rows(module, k)
        if module is Module.LLM:
            seq, positions, cu, tokens = self.sequence(rows)
            if local_stage == 0:
                x, inputs = self.image_tokens(n, s, k, rows)
                out = stage(x, seq, positions, cu, text=tokens, loss_scale=1.0 / max(self.data.targets, 1))
            else:
                x = self.stage_input(n, module, s, k)
                inputs = [x]
                out = stage(x, seq, positions, cu, loss_scale=1.0 / max(self.data.targets, 1))
            if stage.last:
                self.loss += float(out.detach())
        else:
            if local_stage == 0:
                x, _ = self.inputs_of(rows, pixels=True)
                inputs = []
            else:
                x = self.stage_input(n, module, s, k)
                inputs = [x]
            with torch.set_grad_enabled(not self.frozen(module)):
                out = stage(x, self.data.tiles(rows), self.data.image_tokens(rows), self.data.images(rows))
        if not self.frozen(module):  # a frozen stage has no backward to save anything for
            self.saved[(s, k)] = (inputs, out)
        self.outputs[(s, k)] = out

    def output_grad(self, n: int, s: int, k: int, out: torch.Tensor) -> torch.Tensor | None:
        """Gradient of a stage's output: none for the loss; the local next stage's input gradient; or
        what the receives brought (the bridge assembles one per LLM replica)."""
        if out.dim() == 0:
            return None
        if (s + 1, k) in self.grads and (s + 1) in self.w.stages:
            return self.grads[(s + 1, k)]
        grad = None
        for d in self.graph.inputs[n]:
            node = self.graph.nodes[d]
            if node.kind is Kind.RECV_B:
                return self.received_tensor(d)
            if node.kind is Kind.BRIDGE_RECV_B:
                if grad is None:
                    grad = torch.zeros_like(out)
                sent = self.data.bridge_rows(self.replica(), self.replica(node.peer), k)
                grad = grad.index_copy(0, self.token_rows(self.rows(Module.ENCODER, k), sent), self.received_tensor(d))
        return grad if grad is not None else torch.zeros_like(out)

    def backward(self, n: int, node: Node) -> None:
        from torch.distributed.pipelining._backward import stage_backward_input

        s, k = node.stage, node.microbatch
        inputs, out = self.saved[(s, k)]
        grad = self.output_grad(n, s, k, out)
        if node.kind is Kind.B:
            if out.requires_grad:
                torch.autograd.backward(out, grad_tensors=grad)
            self.saved.pop((s, k))
        elif not inputs:  # as torch does: nothing to send upstream, so W runs the whole backward
            self.param_groups[(s, k)] = (None, grad)
        else:
            params = [p for p in self.w.stages[s].parameters() if p.requires_grad]
            _, groups = stage_backward_input([out], None if grad is None else [grad], inputs, iter(params))
            self.param_groups[(s, k)] = (params, groups)
        if inputs:
            self.grads[(s, k)] = inputs[0].grad
        self.outputs.pop((s, k), None)

    def weight(self, n: int, node: Node) -> None:
        from torch.distributed.pipelining._backward import stage_backward_weight

        params, groups = self.param_groups.pop((node.stage, node.microbatch))
        _, out = self.saved.pop((node.stage, node.microbatch))
        if params is None:  # a first stage: its deferred whole backward (``groups`` is the output's grad)
            if out.requires_grad:
                torch.autograd.backward(out, grad_tensors=groups)
        else:
            stage_backward_weight(iter(params), groups)

    def reduce_grad(self, n: int, node: Node) -> None:
        """ZeRO-0/1: the step graph has one REDUCE_GRAD per worker, after the worker's last compute
        op (the backward whose buckets it overlaps in the cost model): every gradient of the step
        is complete there, and this sums them over data parallelism (ZeRO-1's optimizer then
        updates its shard and broadcasts). ZeRO-2 has one after every backward, and ZeRO-3 none:
        both run as FSDP2, which reduce-scatters each unit's gradients in its own backward hooks
        as that backward produces them, so the node only marks where the plan expects it."""
        if not self.w.strategy.runs_as_fsdp2:
            all_reduce_grads(self.w.pipeline_parameters(), self.w.dp_group)

    # ---- a heterogeneous encoder phase --------------------------------------------------------------

    def phase_run(self, rows: np.ndarray) -> torch.Tensor:
        """The encoder replica on ``rows``: their image tokens, laid end to end."""
        pixels, _ = self.inputs_of(rows, pixels=True)
        return self.w.phase.encoder(pixels, self.data.tiles(rows), self.data.image_tokens(rows),
                                    self.data.images(rows))

    def encode(self, n: int, node: Node) -> None:
        """ENCODE: this replica's samples, chunk by chunk, keeping only their embeddings (ENCODE_B runs
        each chunk again before its backward)."""
        with torch.no_grad():
            outs = [self.phase_run(c) for c in self.data.phase_chunks(self.w.phase.replica)]
        self.exchange["encoded"] = torch.cat(outs) if outs else torch.zeros(0, self.hidden[Module.LLM],
                                                                            device=self.w.device, dtype=self.dtype)

    def routes(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Rows this replica sends to each rank, and rows each rank sends here, in the all-to-all's order
        (by rank, each in its sender's batch order): the same on every rank, from the schedule alone."""
        phase, data = self.w.phase, self.data
        world = dist.get_world_size(phase.group)
        b = data.batch
        dest = np.asarray(phase.first_stage)[data.assignment // data.m]
        moved = np.flatnonzero((b.tiles > 0) & (b.image_tokens > 0))  # every image sample, in batch order

        def by_rank(rows: np.ndarray, rank: np.ndarray) -> list[np.ndarray]:
            """``rows`` split by ``rank[row]``, 0 to world - 1, each part in batch order."""
            ordered = rows[np.argsort(rank[rows], kind="stable")]
            return np.split(ordered, np.cumsum(np.bincount(rank[rows], minlength=world))[:-1])

        return (by_rank(moved[data.phase_replica[moved] == phase.replica], dest),
                by_rank(moved[dest[moved] == self.w.layout.rank], data.phase_replica))

    def exchange_forward(self, n: int, node: Node) -> None:
        """ALL_TO_ALL_F: every replica's embeddings to the LLM stage-0 rank of their samples' bins."""
        out_rows, in_rows = self.routes()
        tokens = self.data.batch.image_tokens
        mine = self.data.phase_rows(self.w.phase.replica)
        order = self.token_rows(mine, np.concatenate(out_rows)) if len(mine) else torch.zeros(0, dtype=torch.long)
        send = self.exchange["encoded"].index_select(0, order.to(self.w.device))
        splits = ([int(tokens[r].sum()) for r in out_rows], [int(tokens[r].sum()) for r in in_rows])
        got = torch.empty(sum(splits[1]), self.hidden[Module.LLM], device=self.w.device, dtype=self.dtype)
        dist.all_to_all_single(got, send.contiguous(), splits[1], splits[0], group=self.w.phase.group)
        self.exchange.update(received=got, received_rows=np.concatenate(in_rows), order=order, splits=splits,
                             leaves=[])

    def phase_input(self, rows: np.ndarray) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The image tokens of an LLM bin's ``rows`` from what the all-to-all brought, as one leaf (its
        gradient goes back through ALL_TO_ALL_B)."""
        have = self.exchange["received_rows"]
        b = self.data.batch
        want = rows[(b.image_tokens[rows] > 0) & (b.tiles[rows] > 0)]  # as ``routes`` sends them
        idx = self.token_rows(have, want) if len(want) else torch.zeros(0, dtype=torch.long, device=self.w.device)
        if self.frozen(Module.ENCODER):  # no gradient goes back
            return self.exchange["received"].index_select(0, idx), []
        leaf = self.exchange["received"].index_select(0, idx).requires_grad_(True)
        self.exchange["leaves"].append((leaf, idx))
        return leaf, [leaf] if len(want) else []

    def exchange_backward(self, n: int, node: Node) -> None:
        """ALL_TO_ALL_B: the gradients of what ALL_TO_ALL_F brought, back to the replicas that encoded it."""
        got = self.exchange["received"]
        grad = torch.zeros_like(got)
        for leaf, idx in self.exchange["leaves"]:
            if leaf.grad is not None:
                grad.index_add_(0, idx, leaf.grad)
        send_splits, recv_splits = self.exchange["splits"]
        back = torch.empty(sum(send_splits), got.shape[1], device=self.w.device, dtype=self.dtype)
        dist.all_to_all_single(back, grad, send_splits, recv_splits, group=self.w.phase.group)
        encoded = self.exchange["encoded"]
        self.exchange["grad"] = torch.zeros_like(encoded).index_copy(0, self.exchange["order"].to(self.w.device), back)

    def encode_backward(self, n: int, node: Node) -> None:
        """ENCODE_B: each chunk's forward again, then its backward from its embeddings' gradients."""
        grad, at = self.exchange["grad"], 0
        for chunk in self.data.phase_chunks(self.w.phase.replica):
            out = self.phase_run(chunk)
            part = grad[at:at + len(out)]
            at += len(out)
            if out.requires_grad:
                torch.autograd.backward(out, grad_tensors=part)

    def reduce_encoder_grad(self, n: int, node: Node) -> None:
        """REDUCE_ENCODER_GRAD: the encoder's gradients summed over its replicas (a rank beyond the
        encoder's GPUs has none)."""
        if self.w.phase.encoder is not None:
            all_reduce_grads(list(self.w.phase.encoder.parameters()), self.w.phase.reduce_group)

    def sharded(self, n: int, node: Node) -> None:
        """UNSHARD (ZeRO-3, before every forward and backward): FSDP2 gathers a unit's weights in
        its forward and backward pre-hooks (prefetching the next unit), so the gather this node
        stands for runs inside the op it feeds; the node marks where the plan expects it."""

