"""Checkpoints with torch.distributed.checkpoint: model, optimizer, step and the run's seed.

Tensors are keyed by their name in the whole model (``llm.blocks.3.q.weight``: no
stage index, a layer keeps its global index, a tied head is the embedding), optimizer
states by the parameter's key and the state's (``...q.weight::exp_avg``), so every rank
saves what it holds (data-parallel replicas hold the same keys, and DCP writes each
once; FSDP shards, tensor-parallel shards and ZeRO partitions are saved as they are)
and loads back exactly what it holds. The keys are the same under every plan, so a
checkpoint saved under one plan loads under another (pp2 -> dp2, tp2, ...): DCP
reshards from each tensor's global shape. A checkpoint is complete only once its
``meta.json`` exists: it is written last, by rank 0, after everyone's data.

A resume starts from a checkpoint the launcher has checked first (:func:`resume_point`:
its ``meta.json`` agrees with its folder, the run's steps, seed and model, and every data
file its index names is there, whole), and so does a new run that starts from another
run's checkpoint (:func:`check_start`: the same, and the global batches it was trained on,
``meta.json``'s ``batches``, are the new run's first ones), so a damaged or foreign
checkpoint is one line naming it before any rank starts; what only loading finds (a
corrupt tensor, a model of another shape) is one line too, from the rank (torch raises
``CheckpointException``, a ``BaseException``, so it is caught by name).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from dflop.errors import DflopError
from dflop.specs.loading import first_difference, load_json, save_json, shown, to_mapping
from dflop.specs.models import MLLMSpec
from dflop.workload.sample import SampleTable

from dflop.backends.torch_runtime.model import whole_model_name

META = "meta.json"
STEP = re.compile(r"step-(\d{6})")
"""A checkpoint folder's name: the steps done when it was saved."""


def _owned_state(optimizer: torch.optim.Optimizer) -> dict:
    """Per parameter, its optimizer state (ZeRO: only the partition this rank updates)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps a local optimizer
    return inner.state


def _owned_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    inner = getattr(optimizer, "optim", optimizer)
    return [p for group in inner.param_groups for p in group["params"]]


def stateless_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters this rank's optimizer updates (ZeRO: its partition) whose state it has not made
    yet: AdamW makes it at its first step (a resumed run's is loaded before)."""
    state = _owned_state(optimizer)
    return [p for p in _owned_params(optimizer) if not state.get(p)]


def _materialise(optimizer: torch.optim.Optimizer) -> None:
    """AdamW creates its state at its first step; a resumed run needs it before, to load into."""
    state = _owned_state(optimizer)
    for p in _owned_params(optimizer):
        if p not in state or not state[p]:
            state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}


def keyed(named: dict[str, nn.Parameter], tied: bool) -> dict[str, list[nn.Parameter]]:
    """A rank's parameters (named as :func:`~dflop.backends.torch_runtime.worker.named_parameters`
    names them) by checkpoint key; a tied embedding and head on one rank share a key (their values
    are equal: one initial matrix, one summed gradient)."""
    out: dict[str, list[nn.Parameter]] = {}
    for name, p in named.items():
        out.setdefault(whole_model_name(name, tied), []).append(p)
    return out


def state_dict(params: dict[str, list[nn.Parameter]], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP saves and loads in place: one tensor a key (the first parameter holding it)."""
    names = {id(p): k for k, ps in params.items() for p in ps}
    optim: dict[str, Any] = {}
    for p, states in _owned_state(optimizer).items():
        for key, value in states.items():
            optim.setdefault(f"{names[id(p)]}::{key}", value)
    return {"model": {k: ps[0].data for k, ps in params.items()}, "optim": optim}


def save(folder: Path, step: int, params: dict[str, list[nn.Parameter]], optimizer: torch.optim.Optimizer,
         meta: dict[str, Any]) -> Path:
    import torch.distributed.checkpoint as dcp

    path = folder / f"step-{step:06d}"
    dcp.save(state_dict(params, optimizer), checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        save_json(path / META, {**meta, "step": step})
    dist.barrier()
    return path


def identity(seed: int, model: MLLMSpec) -> dict[str, Any]:
    """What a resume checks in a checkpoint's ``meta.json`` (which also holds its step and the plan
    it was saved under): the run's seed and model, its numbers (not the file they were read from).
    A checkpoint of another model, or of another seed's run, trains another run; one of another
    plan continues this one (the keys are plan-free, DCP reshards)."""
    spec = json.loads(json.dumps(to_mapping(model)))
    for part in spec.values():
        if isinstance(part, dict):
            part.pop("source", None)
    return {"seed": seed, "model": spec}


class TrainedBatches:
    """The digest of a run's first k global batches (each sample's id and shape, in order): what a
    checkpoint after step k records as ``batches``, so that a run starting from it can tell that its
    own steps draw the same samples (with the same seed, they do exactly when the data and the
    global batch are the same). For k increasing, each batch is hashed once."""

    def __init__(self, batches: Iterable[SampleTable]) -> None:
        self._batches = iter(batches)
        self._hash = hashlib.sha256()
        self._done = 0

    def upto(self, k: int) -> str:
        """The digest of batches 0 to k - 1 (k at least the last one asked for)."""
        if k < self._done:
            raise ValueError(f"batches are digested in order: asked for {k}, {self._done} digested")
        for batch in itertools.islice(self._batches, k - self._done):
            self._hash.update(json.dumps(batch.columns(), sort_keys=True).encode())
            self._done += 1
        return self._hash.hexdigest()


def _complete(folder: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint (its ``meta.json`` written) in ``folder``, oldest first."""
    return [(int(m.group(1)), p) for p in sorted(folder.glob("step-*"))
            if (m := STEP.fullmatch(p.name)) and (p / META).exists()]


def newest(folder: Path) -> Path | None:
    """The complete checkpoint of the most steps in ``folder``, if any."""
    done = _complete(folder)
    return done[-1][1] if done else None


def resume_point(folder: Path, steps: int, expect: dict[str, Any]) -> Path | None:
    """The newest complete checkpoint in ``folder`` with steps left after it (one at the last step
    has nothing left to measure: the run then repeats the steps after the one before, which end
    with the same parameters), None when there is none. Every complete checkpoint's ``meta.json``
    is checked (its step is its folder's, within the run's ``steps``; its ``expect`` fields, the
    seed and model, are the run's), and the chosen one's data files; DflopError naming the first
    file that is wrong."""
    done = _complete(folder)
    for step, path in done:
        _check_meta(path, step, steps, expect)
    usable = [path for step, path in done if step < steps]
    if usable:
        check_files(usable[-1])
    return usable[-1] if usable else None


def _check_meta(path: Path, step: int, steps: int, expect: dict[str, Any]) -> None:
    meta = _read_meta(path, step)
    if not 1 <= step <= steps:
        raise DflopError(f"{path}: a checkpoint after step {step}, but the run has {steps} steps")
    _agree(path / META, meta, expect)


def _read_meta(path: Path, step: int) -> dict[str, Any]:
    """The ``meta.json`` of the checkpoint folder ``path`` (of step ``step``): an object whose step is its folder's."""
    meta = load_json(path / META)
    where = path / META
    if not isinstance(meta, dict):
        raise DflopError(f"{where}: not a checkpoint's meta.json (expected an object with 'step')")
    if type(meta.get("step")) is not int or meta["step"] != step:
        raise DflopError(f"{where}: 'step': expected {step}, the step of its folder {path.name}, "
                         f"got {meta.get('step')!r}")
    return meta


def _agree(where: Path, meta: dict[str, Any], expect: dict[str, Any]) -> None:
    """Refuse, naming the first field, a ``meta.json`` whose ``expect`` fields are not the run's."""
    for key, value in expect.items():
        if found := first_difference(meta.get(key), value, key):
            field, old, new = found
            raise DflopError(f"{where}: {field!r}: this checkpoint was saved with {shown(old)}, "
                             f"the run has {shown(new)}")


def check_start(path: Path, steps: int, expect: dict[str, Any], trained: Callable[[int], str]) -> int:
    """The step at which a new run of ``steps`` steps starting from the complete checkpoint ``path``
    (``step-NNNNNN``) begins, checked before any rank starts: its ``meta.json`` agrees with its
    folder; it leaves a step to train; its ``expect`` fields (:func:`identity`: seed and model) are
    the run's; it was trained on the run's first global batches (``trained(k)``: the digest of the
    run's first k, :class:`TrainedBatches`), so every step after it draws the samples the saving
    run drew; its data files are there, whole. Why: a run continues a checkpoint only where it is
    the saving run's continuation. DflopError naming the file and the field."""
    step = int(STEP.fullmatch(path.name).group(1))
    meta = _read_meta(path, step)
    if step >= steps:
        raise DflopError(f"{path}: a checkpoint after step {step}, but this run has {steps} steps: none is left "
                         "to train after it (give more steps, or an earlier checkpoint)")
    _agree(path / META, meta, expect)
    if "batches" not in meta:
        raise DflopError(f"{path / META}: 'batches': missing (a dflop that did not record the global batches "
                         "a checkpoint was trained on saved it)")
    if meta["batches"] != trained(step):
        raise DflopError(f"{path / META}: 'batches': this checkpoint was trained on other global batches than "
                         f"this run's first {step} (another data set, data preset or global batch: the steps "
                         "after it would draw other samples)")
    check_files(path)
    return step


def check_files(path: Path) -> None:
    """The index (``.metadata``) is readable and every byte range it names lies in a file that is there."""
    from torch.distributed.checkpoint import FileSystemReader

    index = path / ".metadata"
    if not index.exists():
        raise DflopError(f"{index}: missing: the checkpoint has no index of its data, it cannot be loaded")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: pickle raises many kinds
        raise DflopError(f"{index}: unreadable ({reason(exc)})") from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise DflopError(f"{index}: not a checkpoint's index (it names no data files)")
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        data = path / name
        if not data.is_file():
            raise DflopError(f"{data}: missing (the checkpoint's index names it)")
        if data.stat().st_size < size:
            raise DflopError(f"{data}: truncated: {data.stat().st_size} bytes, the checkpoint's index needs {size}")


def load(path: Path, params: dict[str, list[nn.Parameter]], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    meta = load_json(path / META)
    _materialise(optimizer)
    state = state_dict(params, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a damaged checkpoint, or another model's
        raise DflopError(f"{path}: cannot resume from this checkpoint ({reason(exc)})") from None
    with torch.no_grad():
        for k, ps in params.items():
            for p in ps:
                p.data.copy_(state["model"][k])
    names = {id(p): k for k, ps in params.items() for p in ps}
    for p, states in _owned_state(optimizer).items():
        for key in states:
            loaded = state["optim"][f"{names[id(p)]}::{key}"]  # a tied pair's second holder: its own copy
            states[key] = loaded if states[key] is loaded else loaded.clone()
    return meta


def reason(exc: BaseException) -> str:
    """What went wrong in a few words: the error's first sentence (torch's go on with advice that
    does not apply); for a CheckpointException, the first failing rank's own error (its message
    names the rank set and holds tracebacks)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))[0]
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "").split(". ")[0]
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
