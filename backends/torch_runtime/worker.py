"""One torch rank's whole run: join the process group, build its stages, warm up, then execute every
step's graph and the optimizer step, checkpointing every K steps.

Every rank lowers each step's graph itself from the step's schedule (the same
deterministic function the simulator uses), so nothing but the schedules ever
crosses from the launcher to the ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from dflop.backends.torch_runtime.cpu_process import grow_heap, set_up_cpu_process
from dflop.timing.dpcomm import shard_degree
from dflop.program.schedules import splits_backward
from dflop.program.lowering import lower_step
from dflop.program.stepgraph import Worker, build_workers
from dflop.program.template import Template, build_template
from dflop.specs.execution import Device, ExecutionSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module, Plan, place
from dflop.workload.chat import Encoded
from dflop.workload.sample import SampleTable

from dflop.backends.torch_runtime import checkpoint
from dflop.backends.torch_runtime.decoding import Decoded, Media, decoded_steps
from dflop.backends.torch_runtime.hf_checkpoint import load_stages, open_checkpoint
from dflop.backends.torch_runtime.model import build_stage
from dflop.backends.torch_runtime.progress import ProgressFile
from dflop.backends.torch_runtime.recompute import block_runner
from dflop.backends.torch_runtime.parallel import (Groups, RankLayout, fully_shard_stage, local, make_optimizer,
                                                   tensor_parallel)
from dflop.backends.torch_runtime.runtime import CONNECTION_LOST, Clock, EncoderPhase, RankStep, RankState
from dflop.backends.torch_runtime.shapes import StepData


@dataclass(frozen=True, kw_only=True)
class TorchOptions(ExecutionSpec):
    """The execution spec of the run config, and what the launcher adds for this run."""

    seed: int = 0
    """Initial weights and synthetic inputs."""
    weights: str = ""
    """A Hugging Face checkpoint folder the initial weights come from instead of the seed (a run
    config's ``model: {checkpoint: DIR}``); a plain LLM's encoder keeps its seeded weights."""
    checkpoint_dir: str = ""
    resume: bool = False
    """Continue from the newest complete checkpoint in checkpoint_dir that has steps left after it
    (from step 0 when there is none)."""
    resume_from: str = ""
    """The checkpoint the ranks start from: that one, or else ``init_from``, found and checked by the
    launcher before any rank starts (set by the backend)."""
    progress_dir: str = ""
    """Folder where every rank keeps the node it is at, to name it if the rank dies."""
    fail_at: tuple[int, str, str] = (-1, "", "")
    """(step, node label, raise or exit): fail there on rank 0 (tests of failure handling)."""


@dataclass
class Payload:
    """What the launcher hands every rank."""

    plan: Plan
    model: MLLMSpec
    batches: list[SampleTable]
    assignments: list[Any]
    options: TorchOptions
    gpus_per_node: int
    """Of the planned cluster: where HSDP's shard groups end."""
    texts: list[dict[str, Encoded]] | None = None
    """Real samples: each step's token ids and targets by sample id, tokenized by the launcher
    before any rank starts (None: synthetic inputs)."""
    freeze_encoder: bool = False
    """The recipe's frozen encoder (``TrainingSpec.freeze_encoder``): its weights take no gradient."""


@dataclass
class RankResult:
    rank: int
    worker: int
    tp_index: int
    start_step: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    """Per step: node times (node -> (start ns, end ns)), end ns, loss part, optimizer ns, the
    seconds the rank spent making its inputs before it (``inputs_s``: waiting for its pixels
    included) and that decoding them took where it ran (``decode_s``: in a worker, ahead, with
    ``decode_workers``), and the samples it skipped (id -> why: their media failed to decode)."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """Full parameters at the end (only when asked, for tests)."""
    weights_read: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """What this rank read from the checkpoint of ``TorchOptions.weights``: tensor name -> shape read."""
    warmup: tuple[int, float] | None = None
    """(step, seconds): the step whose graph ran once untimed before the first step (``warm_up``)."""


def _stage_modules(plan: Plan, model: MLLMSpec, template: Template, worker: int, seed: int,
                   device: torch.device, dtype: torch.dtype) -> tuple[dict[int, nn.Module], nn.Module | None]:
    w = build_workers(template)[worker]
    stages: dict[int, nn.Module] = {}
    layers = plan.stage_layers(w.module, model)
    offset = 0 if w.module is Module.ENCODER else template.encoder_stages
    for s in w.stages:
        stages[s + offset] = build_stage(model, w.module, s, layers, seed).to(device=device, dtype=dtype)
    encoder = None
    if plan.strategy.carries_encoder(w.module, w.stages) or holds_phase_replica(plan, w.gpus[0]):
        encoder = build_stage(model, Module.ENCODER, 0, (model.encoder.layers,), seed).to(device=device, dtype=dtype)
    return stages, encoder


def holds_phase_replica(plan: Plan, gpu: int) -> bool:
    """Whether a heterogeneous plan's encoder has a replica on ``gpu`` (the job's first tp x dp GPUs)."""
    return plan.heterogeneous and gpu < plan.encoder.gpus


def named_parameters(stages: dict[int, nn.Module], encoder: nn.Module | None,
                     template: Template) -> dict[str, nn.Parameter]:
    out: dict[str, nn.Parameter] = {}
    for s, module in stages.items():
        kind, local_stage = template.module_stage(s)
        for name, p in module.named_parameters():
            out[f"{kind}.s{local_stage}.{name}"] = p
    if encoder is not None:
        for name, p in encoder.named_parameters():
            out[f"encoder.s0.{name}"] = p
    return out


def _setup(payload: Payload, rank: int, device: torch.device) -> tuple[RankState, Groups, Template, Any, dict]:
    plan, model, opts = payload.plan, payload.model, payload.options
    template = build_template(plan, frozen_encoder=payload.freeze_encoder)
    layout = RankLayout.of(build_workers(template), rank)
    groups = Groups(plan, layout, device.type)
    tied = model.llm.tie_embeddings and plan.stages("llm") > 1
    first, last = _llm_end_groups(template)
    if tied and first is not last:  # embedding and head on different ranks: a group per pair
        gpus = place(plan)
        groups.tied_embedding_groups([gpus.gpus(Module.LLM, first.rank, x) for x in range(first.replicas)],
                                     [gpus.gpus(Module.LLM, last.rank, x) for x in range(last.replicas)])
    dtype = getattr(torch, opts.dtype.value)
    stages, encoder = _stage_modules(plan, model, template, layout.worker, opts.seed, device, dtype)
    gw = build_workers(template)[layout.worker]
    mesh = groups.mesh_of(gw.module)
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    mp = plan.module(gw.module)
    shards = shard_degree(plan, payload.gpus_per_node, mp.dp, mp.tp)
    ckpt = open_checkpoint(opts.weights) if opts.weights else None
    read: dict[str, tuple[int, ...]] = {}
    kinds = [template.module_stage(s)[0] for s in stages] + ([Module.ENCODER] if encoder is not None else [])
    for kind, module in zip(kinds, list(stages.values()) + ([encoder] if encoder is not None else [])):
        tensor_parallel(module, tp_mesh, mp.tp)
        if ckpt is not None:  # after TP (a rank reads its shards only), before FSDP (which shards what it read)
            read.update(load_stages(ckpt, [(kind, module)]))
        module.run_block = block_runner(plan.recompute, splits_backward(plan.schedule))
        if kind is Module.ENCODER and payload.freeze_encoder:
            module.requires_grad_(False)
        if plan.strategy.runs_as_fsdp2 and mp.dp > 1:
            fully_shard_stage(module, groups.fsdp_mesh(gw.module, shards),
                              reshard_after_forward=plan.strategy.reshards_after_forward)
    phase = None
    if plan.heterogeneous:  # the encoder is this rank's replica of a phase of its own, not part of a stage
        gpus = place(plan)
        mesh = groups.meshes[Module.ENCODER]["dp"]
        # with tp 1, encoder replica j is rank j: the reduction over the first ranks, the all-to-all over all
        replica = rank // plan.encoder.tp if encoder is not None else -1
        phase = EncoderPhase(encoder, replica, dist.group.WORLD, mesh.get_group() if encoder is not None else None,
                             tuple(gpus.gpus(Module.LLM, 0, r)[0] for r in range(plan.llm.dp)))
    worker = RankState(layout.worker, layout, stages, None if phase else encoder, dp_mesh.get_group(), device,
                       opts.seed, model.encoder.image_size, model.llm.vocab, plan.strategy, phase)
    optimizer = make_optimizer(worker.parameters(), plan.strategy, worker.dp_group, opts)
    info = {"tied": tied, "gw": gw, "dtype": dtype, "read": read}
    return worker, groups, template, optimizer, info


def _llm_end_groups(template: Template):  # noqa: ANN202 - (Group, Group)
    """The template groups holding the LLM's first and last stages (one group under V placement)."""
    llm = [g for g in template.groups if g.module is Module.LLM]
    last_stage = max(s for g in llm for s in g.stages)
    return (next(g for g in llm if 0 in g.stages), next(g for g in llm if last_stage in g.stages))


def _sync_tied_embedding(worker: RankState, groups: Groups, template: Template, gw) -> None:  # noqa: ANN001
    """The embedding (first LLM stage) and the head (last LLM stage) are one matrix: their gradients
    are added, on the rank when it holds both (V placement), across ranks otherwise."""
    tied = []
    for s, module in worker.stages.items():
        if template.module_stage(s)[0] is Module.LLM:
            tied += [p for p in (module.embed.weight if module.first else None,
                                 module.head.weight if module.last else None) if p is not None]
    tied = [p for i, p in enumerate(tied) if p.grad is not None and all(p is not q for q in tied[:i])]
    if len(tied) == 2:
        total = local(tied[0].grad) + local(tied[1].grad)
        for p in tied:
            local(p.grad).copy_(total)
    elif tied and (gw.replica, worker.layout.tp_index) in groups.tied:
        dist.all_reduce(local(tied[0].grad), group=groups.tied[(gw.replica, worker.layout.tp_index)])


def run_rank(payload: Payload, keep_parameters: bool = False) -> RankResult:
    """The body of one rank (spawned locally or under torchrun; the process group is set up here)."""
    opts = payload.options
    device = torch.device("cpu" if opts.device is Device.CPU else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    kept = device.type == "cpu" and set_up_cpu_process()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl",
                                timeout=datetime.timedelta(seconds=opts.timeout_s))
    rank = dist.get_rank()
    worker, groups, template, optimizer, info = _setup(payload, rank, device)
    named = named_parameters(worker.stages, worker.phase.encoder if worker.phase else worker.colocated_encoder,
                             template)
    model = payload.model
    saved = checkpoint.keyed(named, model.llm.tie_embeddings)
    start = checkpoint.load(Path(opts.resume_from), saved, optimizer)["step"] if opts.resume_from else 0
    folder = Path(opts.checkpoint_dir) if opts.checkpoint_dir else None
    result = RankResult(rank, worker.graph_worker, worker.layout.tp_index, start, weights_read=info["read"])
    meta = {**checkpoint.identity(opts.seed, model), "plan": payload.plan.describe()}
    trained = checkpoint.TrainedBatches(payload.batches)  # what each checkpoint records it was trained on
    progress = ProgressFile(Path(opts.progress_dir), rank) if opts.progress_dir else None

    def prepared(step: int, decoded: Decoded | None = None, skip: dict[str, str] | None = None,
                 synthetic: bool = False) -> RankStep:
        """Step ``step`` (without the samples ``skip`` names) with every input its forwards read made
        (images decoded, or taken from ``decoded``; tokens, positions; with ``synthetic``, drawn from
        the samples' ids in the same shapes), and the seconds that took."""
        began = time.perf_counter()
        batch, assignment = payload.batches[step], np.asarray(payload.assignments[step])
        if skip:
            keep = np.flatnonzero(~np.isin(batch.ids.astype(str), list(skip)))
            batch, assignment = batch.take(keep), assignment[keep]
        texts = None if synthetic or payload.texts is None else payload.texts[step]
        data = StepData(payload.plan, batch, assignment, texts)
        run = RankStep(worker, lower_step(template, batch, assignment), data, step, Clock(device), dtype=info["dtype"],
                       hidden={Module.LLM: model.llm.hidden, Module.ENCODER: model.encoder.hidden},
                       patches=model.encoder.patches_per_tile, progress=progress, gpus_per_node=payload.gpus_per_node,
                       decoded=decoded.pixels if decoded is not None else None)
        if opts.fail_at[0] == step and rank == 0 and not synthetic:
            run.fail = (opts.fail_at[1], opts.fail_at[2])
        run.prepare()
        run.inputs_s = time.perf_counter() - began
        run.decode_s = decoded.seconds if decoded is not None else 0.0
        return run

    def warm_up(step: int) -> tuple[int, float]:
        """Run step ``step``'s graph once, untimed, on synthetic inputs of its shapes, beside as much
        memory as the AdamW moments this rank's optimizer has yet to make take (it makes them at its
        first step), and drop its gradients: the weights and the optimizer stay as they were. The
        memory a fresh process faults in over its first steps, its caches and its groups' first
        collectives, which a long run pays once and a profile's warm-up excludes, are then not in
        the timed steps."""
        began = time.perf_counter()
        run = prepared(step, synthetic=True)
        run.warmup = True
        moments = [torch.zeros_like(local(p)) for p in checkpoint.stateless_params(optimizer) for _ in range(2)]
        run.run()
        del moments
        optimizer.zero_grad(set_to_none=True)
        if kept:
            grow_heap(HEAP_HEADROOM)
        with _between_steps(run, "barrier"):
            dist.barrier()
        return step, time.perf_counter() - began

    steps = range(start, len(payload.batches))
    if opts.warmup and steps:
        result.warmup = warm_up(heaviest_step(payload, steps))
    media = _rank_media(payload, info["gw"], worker.colocated_encoder is not None, steps,
                        worker.phase.replica if worker.phase else None)
    for step, decoded, waited in _decoded(media, steps, opts.decoders):
        run = prepared(step, decoded)
        run.inputs_s += waited
        skipped: dict[str, str] = {}
        with _between_steps(run, "barrier"):
            if payload.texts is None:
                dist.barrier()
            else:  # real media: a barrier that also tells every rank what could not be fed
                skipped = _undecodable_anywhere(run.undecodable)
        if skipped:  # every rank makes the step again without those samples (decoding here what it feeds
            # then: the samples' routing may change), the same step everywhere
            first, run = run, prepared(step, skip=skipped)
            run.inputs_s, run.decode_s = run.inputs_s + first.inputs_s, first.decode_s
            with _between_steps(run, "barrier"):
                dist.barrier()
        clock = run.clock
        clock.mark()
        run.run()
        if info["tied"]:
            with _between_steps(run, "tied-embedding"):
                _sync_tied_embedding(worker, groups, template, info["gw"])
        opt_start = clock.mark()
        with _between_steps(run, "optimizer"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = clock.mark()
        marks = clock.resolve()
        result.steps.append({"step": step, "nodes": {n: (marks[a], marks[b]) for n, a, b in run.times},
                             "optimizer": (marks[opt_start], marks[end]), "end": marks[end], "loss": run.loss,
                             "inputs_s": run.inputs_s, "decode_s": run.decode_s, "skipped": skipped})
        if folder is not None and opts.checkpoint_every and (step + 1) % opts.checkpoint_every == 0:
            checkpoint.save(folder, step + 1, saved, optimizer, {**meta, "batches": trained.upto(step + 1)})
    if keep_parameters:
        result.parameters = {n: _full(p).detach().cpu().clone() for n, p in named.items()}
    dist.barrier()
    return result


HEAP_HEADROOM = 1.5
"""What a CPU rank's heap is grown to after the warm-up, times its size then: the steps of a run
that follow one step's warm-up grow it by up to a third more (their blocks fall between those that
outlive a step)."""


def heaviest_step(payload: Payload, steps: range) -> int:
    """The step of ``steps`` whose largest microbatch holds the most activations (tokens times hidden
    size times layers, the LLM's and the encoder's added): the one that grows a rank's memory most."""
    llm, encoder = payload.model.llm, payload.model.encoder

    def size(step: int) -> tuple[float, float]:
        b, assignment = payload.batches[step], np.asarray(payload.assignments[step])
        volume = (b.llm_tokens * (llm.hidden * llm.layers)
                  + b.tiles * (encoder.patches_per_tile * encoder.hidden * encoder.layers)).astype(float)
        per_bin = np.bincount(assignment, weights=volume)
        return float(per_bin.max(initial=0.0)), float(per_bin.sum())

    return max(steps, key=size)


def _undecodable_anywhere(mine: dict[str, str]) -> dict[str, str]:
    """Every rank's samples whose media it could not make into inputs (id -> why), the same on
    every rank: gathered from all (a rank decodes only the samples it encodes)."""
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for part in everyone for k, v in sorted((part or {}).items())}


def _rank_media(payload: Payload, gw: Worker, colocated: bool, steps: range,
                phase: int | None = None) -> dict[int, Media] | None:
    """Per step, the media of the samples whose pixels this rank feeds (``StepData.pixel_rows`` of its
    template worker ``gw``; ``colocated``: it runs the encoder inside LLM stage 0; ``phase``: its encoder
    replica of a heterogeneous plan), none on a rank that holds no module's first stage; None for
    synthetic inputs (nothing to decode)."""
    if payload.texts is None:
        return None
    media: dict[int, Media] = {}
    for step in steps:
        data = StepData(payload.plan, payload.batches[step], np.asarray(payload.assignments[step]), payload.texts[step])
        if phase is not None:
            rows = data.phase_rows(phase)
        elif 0 in gw.stages:
            rows = data.pixel_rows(gw.module, gw.replica, colocated)
        else:
            rows = np.zeros(0, dtype=np.int64)
        media[step] = {i: data.text[i].images for i in map(str, data.batch.ids[rows]) if data.text[i].images}
    return media


def _decoded(media: dict[int, Media] | None, steps: range, workers: int,
             ) -> Iterator[tuple[int, Decoded | None, float]]:
    """(step, its media decoded, the seconds the caller waited for them) in order: by ``workers``
    processes ahead of the caller where the rank feeds any pixels (``decoding.decoded_steps``);
    (step, None, 0) for synthetic inputs (``media`` None)."""
    if media is None:
        yield from ((step, None, 0.0) for step in steps)
        return
    for item, waited in decoded_steps(media, steps, workers if any(media.values()) else 0):
        yield item.step, item, waited


@contextlib.contextmanager
def _between_steps(run: RankStep, what: str) -> Iterator[None]:
    """A collective outside the step graph fails as a node does: one line naming the rank, the step
    and the ranks lost (a peer dies between two steps as often as inside one)."""
    run.at(what)
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - named, then re-raised for the launcher
        lost = any(m in str(exc) for m in CONNECTION_LOST)  # else no peer is to blame: name none
        others = [r for r in range(dist.get_world_size()) if r != dist.get_rank()] if lost else []
        raise run.failed(f"in {what}", others, exc) from exc


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def rank_entry(payload: Payload, keep_parameters: bool) -> RankResult:
    """The function the local launcher runs in every process (an ``ActionFailed`` names the rank, step
    and node; the launcher reports its message), the process group torn down either way."""
    try:
        return run_rank(payload, keep_parameters)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer is gone; nothing left to tear down cleanly
                pass
