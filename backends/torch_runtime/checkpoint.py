"""Checkpoints with torch.distributed.checkpoint: model, optimizer, step and the run's seed.

Tensors are keyed by their name in the whole model (``llm.s1.blocks.3.q.weight``),
optimizer states by the parameter's name and the state's (``...q.weight::exp_avg``),
so every rank saves what it holds (data-parallel replicas hold the same keys, and
DCP writes each once; FSDP shards and ZeRO partitions are saved as they are) and
loads back exactly what it holds. A checkpoint is complete only once its
``meta.json`` exists: it is written last, by rank 0, after everyone's data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dflop.errors import DflopError
from dflop.specs.loading import load_json

META = "meta.json"


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
        tmp = path / (META + ".tmp")
        tmp.write_text(json.dumps({**meta, "step": step}))
        tmp.replace(path / META)
    dist.barrier()
    return path


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint in ``folder``."""
    done = sorted(p for p in folder.glob("step-*") if (p / META).exists())
    return done[-1] if done else None


def load(path: Path, named: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    meta = load_json(path / META)
    _materialise(optimizer)
    state = state_dict(named, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:  # noqa: BLE001 - a checkpoint of another plan, or a damaged one
        raise DflopError(f"{path}: cannot resume from this checkpoint ({str(exc).splitlines()[0]})") from None
    with torch.no_grad():
        for n, p in named.items():
            p.data.copy_(state["model"][n])
    inner_state = _owned_state(optimizer)
    names = {id(p): n for n, p in named.items()}
    for p, states in inner_state.items():
        for key in states:
            states[key] = state["optim"][f"{names[id(p)]}::{key}"]
    return meta
