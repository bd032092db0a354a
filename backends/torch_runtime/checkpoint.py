"""Checkpoints with torch.distributed.checkpoint: model, optimizer, step and the run's seed.

Tensors are keyed by their name in the whole model (``llm.s1.blocks.3.q.weight``),
optimizer states by the parameter's name and the state's (``...q.weight::exp_avg``),
so every rank saves what it holds (data-parallel replicas hold the same keys, and
DCP writes each once; FSDP shards and ZeRO partitions are saved as they are) and
loads back exactly what it holds. A checkpoint is complete only once its
``meta.json`` exists: it is written last, by rank 0, after everyone's data.

A resume starts from a checkpoint the launcher has checked first (:func:`resume_point`:
its ``meta.json`` agrees with its folder, the run's steps, seed and plan, and every data
file its index names is there, whole), so a damaged or foreign checkpoint is one line
naming it before any rank starts; what only loading finds (a corrupt tensor, a model of
another shape) is one line too, from the rank (torch raises ``CheckpointException``, a
``BaseException``, so it is caught by name).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dflop.errors import DflopError
from dflop.specs.loading import load_json, save_json
from dflop.specs.plan import Plan

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


def _materialise(optimizer: torch.optim.Optimizer) -> None:
    """AdamW creates its state at its first step; a resumed run needs it before, to load into."""
    state = _owned_state(optimizer)
    for p in _owned_params(optimizer):
        if p not in state or not state[p]:
            state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}


def state_dict(named: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    names = {id(p): n for n, p in named.items()}
    optim = {}
    for p, states in _owned_state(optimizer).items():
        for key, value in states.items():
            optim[f"{names[id(p)]}::{key}"] = value
    return {"model": {n: p.data for n, p in named.items()}, "optim": optim}


def save(folder: Path, step: int, named: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
         meta: dict[str, Any]) -> Path:
    import torch.distributed.checkpoint as dcp

    path = folder / f"step-{step:06d}"
    dcp.save(state_dict(named, optimizer), checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        save_json(path / META, {**meta, "step": step})
    dist.barrier()
    return path


def identity(seed: int, plan: Plan) -> dict[str, Any]:
    """What a checkpoint's ``meta.json`` holds besides its step, and a resume checks: the run's seed
    and plan (a checkpoint of another cannot be loaded into this one, or trains another run)."""
    return {"seed": seed, "plan": plan.describe()}


def resume_point(folder: Path, steps: int, expect: dict[str, Any]) -> Path | None:
    """The newest complete checkpoint in ``folder`` with steps left after it (one at the last step
    has nothing left to measure: the run then repeats the steps after the one before, which end
    with the same parameters), None when there is none. Every complete checkpoint's ``meta.json``
    is checked (its step is its folder's, within the run's ``steps``; its ``expect`` fields, the
    seed and plan, are the run's), and the chosen one's data files; DflopError naming the first
    file that is wrong."""
    done = []
    for path in sorted(folder.glob("step-*")):
        match = STEP.fullmatch(path.name)
        if match is None or not (path / META).exists():
            continue
        step = int(match.group(1))
        _check_meta(path, step, steps, expect)
        done.append((step, path))
    usable = [path for step, path in done if step < steps]
    if usable:
        _check_files(usable[-1])
    return usable[-1] if usable else None


def _check_meta(path: Path, step: int, steps: int, expect: dict[str, Any]) -> None:
    meta = load_json(path / META)
    where = path / META
    if not isinstance(meta, dict):
        raise DflopError(f"{where}: not a checkpoint's meta.json (expected an object with 'step')")
    if type(meta.get("step")) is not int or meta["step"] != step:
        raise DflopError(f"{where}: 'step': expected {step}, the step of its folder {path.name}, "
                         f"got {meta.get('step')!r}")
    if not 1 <= step <= steps:
        raise DflopError(f"{path}: a checkpoint after step {step}, but the run has {steps} steps")
    for key, value in expect.items():
        if meta.get(key) != value:
            raise DflopError(f"{where}: {key!r}: this checkpoint was saved with {meta.get(key)!r}, "
                             f"the run has {value!r}")


def _check_files(path: Path) -> None:
    """The index (``.metadata``) is readable and every byte range it names lies in a file that is there."""
    from torch.distributed.checkpoint import FileSystemReader

    index = path / ".metadata"
    if not index.exists():
        raise DflopError(f"{index}: missing: the checkpoint has no index of its data, it cannot be loaded")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: pickle raises many kinds
        raise DflopError(f"{index}: unreadable ({_reason(exc)})") from None
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


def load(path: Path, named: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    meta = load_json(path / META)
    _materialise(optimizer)
    state = state_dict(named, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a damaged checkpoint, or another model's
        raise DflopError(f"{path}: cannot resume from this checkpoint ({_reason(exc)})") from None
    with torch.no_grad():
        for n, p in named.items():
            p.data.copy_(state["model"][n])
    inner_state = _owned_state(optimizer)
    names = {id(p): n for n, p in named.items()}
    for p, states in inner_state.items():
        for key in states:
            states[key] = state["optim"][f"{names[id(p)]}::{key}"]
    return meta


def _reason(exc: BaseException) -> str:
    """What went wrong in a few words: the error's first sentence (torch's go on with advice that
    does not apply); for a CheckpointException, the first failing rank's own error (its message
    names the rank set and holds tracebacks)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))[0]
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "").split(". ")[0]
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
