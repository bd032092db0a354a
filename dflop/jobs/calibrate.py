"""Whether a profiled cost model fits the machine it is used on, and its calibration to it.

A profile records the machine it was measured on (``dflop.profile.profiler.machine_identity``);
this machine's identity is taken the same way, and a job that prices with a profile measured
elsewhere (or on a machine it does not name) says so, naming what differs. Calibrating measures a
few of the profile's shapes here (``dflop.profile.drift.calibrate``) and scales the cost model by
what they ran at (``dflop.cost.calibration``). The profiler's side (torch) is imported only when
called.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dflop.backends.base import ScheduledBatch
from dflop.cost.calibration import Calibration, calibrated
from dflop.cost.frozen import priced_by
from dflop.cost.profiled import ProfiledCostModel
from dflop.cost.protocol import CostModel
from dflop.cost.store import machine_difference, profile_machine
from dflop.errors import DflopError
from dflop.specs import presets
from dflop.specs.execution import CPU_THREADS
from dflop.specs.plan import Plan
from dflop.specs.progress import Progress

from dflop.jobs.setup import Setup, setup

CHECK = ("`dflop profile check` measures how far its times are off here; `dflop profile model` measures "
         "a profile of this machine")


def profile_device(cost: ProfiledCostModel) -> str | None:
    """The device this machine runs ``cost``'s profile on ('cpu', 'cuda'); None when it has none
    (a GPU's profile on a machine without that GPU)."""
    if cost.device == "cpu":
        return "cpu"
    from dflop.profile.profiler import device_name

    import torch

    return "cuda" if torch.cuda.is_available() and device_name("cuda") == cost.device else None


def machine_note(cost: CostModel, device: str | None = None) -> str:
    """'' when ``cost`` is not profiled or its profile was measured on this machine (on ``device``,
    by default the profile's own), or on a GPU this machine does not have (planning for a cluster from
    elsewhere: the profile is that GPU's, and nothing here can say otherwise); else the line naming
    what differs."""
    cost = priced_by(cost)
    if not isinstance(cost, ProfiledCostModel):
        return ""
    device = device or profile_device(cost)
    if device is None:
        return ""
    from dflop.profile.profiler import machine_identity

    here = machine_identity(device, CPU_THREADS)
    return machine_difference(profile_machine(cost.records), here)


def calibrate_cost(cost: CostModel, log: Callable[[str], None], sizes: dict[str, float | None] | None = None,
                   tps: dict[str, tuple[int, ...]] | None = None, progress: Progress | None = None,
                   lengths: dict[str, float | None] | None = None) -> tuple[CostModel, Calibration | None]:
    """(``cost`` scaled to this machine, what the check found); ``cost`` and None, with a line
    saying why, where it cannot be calibrated here. ``sizes``, ``tps`` and ``lengths``: per model,
    the microbatch size, the TP degrees and (an LLM) the sample length to measure at (default: the
    middle of the profile's grid, every TP degree)."""
    cost = priced_by(cost)
    if not isinstance(cost, ProfiledCostModel):
        log("dflop: no calibration: the analytical cost model holds no measured shapes to measure again")
        return cost, None
    device = profile_device(cost)
    if device is None:
        log(f"dflop: cannot calibrate: the profile was measured on {cost.device}, which this machine does not have")
        return cost, None
    from dflop.profile.drift import calibrate as measure

    names = (cost.model.encoder.name, cost.model.llm.name)
    if unknown := [n for n in names if n not in presets.names("encoders") + presets.names("llms")]:
        log(f"dflop: cannot calibrate: {unknown[0]} is not a model the profiler builds (a preset); predictions use "
            "the profile as recorded")
        return cost, None
    try:
        found = measure(cost.records, sizes or dict.fromkeys(names), device=device, tps=tps, llm=cost.model.llm.name,
                        progress=progress, lengths=lengths)
    except DflopError as exc:  # a model the profiler cannot build: the job goes on, said uncalibrated
        log(f"dflop: cannot calibrate: {exc}; predictions use the profile as recorded")
        return cost, None
    log(f"dflop: calibration: shapes ran {found.ratio:.2f}x the recorded time here ("
        + ", ".join(f"{part} {r:.2f}x" for part, r in found.ratios.items())
        + f"; {len(found.shapes)} shapes in {found.seconds:.1f} s); predictions scaled")
    return calibrated(cost, found), found


def microbatch_size(steps: list[ScheduledBatch], field: str) -> float:
    """The size of the microbatch the steps spend the median unit of ``field`` in (``llm_tokens`` or
    ``tiles``): where a check of the profile should measure it again (0 when the steps hold none)."""
    return weighted_median(np.concatenate([np.bincount(s.assignment, weights=getattr(s.batch, field))
                                           for s in steps]))


def weighted_median(sizes: np.ndarray) -> float:
    """The size the median unit falls in, each size counted as many times as it is large (0: none)."""
    sizes = np.sort(sizes[sizes > 0])
    return float(sizes[np.searchsorted(np.cumsum(sizes), sizes.sum() / 2)]) if len(sizes) else 0.0


def sample_lengths(cost: ProfiledCostModel, arms: list[tuple[Plan, list[ScheduledBatch]]]) -> dict[str, float | None]:
    """Per LLM of ``cost``: the length of the sample the arms' steps spend their median LLM token in,
    the per-sample length its blocks are measured at (None where they hold none)."""
    return {cost.model.llm.name: weighted_median(np.concatenate([step.batch.llm_tokens for _, arm in arms
                                                                 for step in arm]).astype(float)) or None}


def microbatch_sizes(cost: ProfiledCostModel, arms: list[tuple[Plan, list[ScheduledBatch]]]
                     ) -> tuple[dict[str, float | None], dict[str, tuple[int, ...]]]:
    """Per model of ``cost``: the arms' microbatch size (``microbatch_size``: LLM tokens, encoder
    tiles; None, the middle of the grid, where they hold none), and the TP degrees their plans run it at."""
    steps = [step for _, arm in arms for step in arm]
    tokens, tiles = microbatch_size(steps, "llm_tokens"), microbatch_size(steps, "tiles")
    encoder, llm = cost.model.encoder.name, cost.model.llm.name
    return ({encoder: tiles or None, llm: tokens or None},
            {encoder: tuple(sorted({p.encoder.tp for p, _ in arms})), llm: tuple(sorted({p.llm.tp for p, _ in arms}))})


def calibrate_for(cost: CostModel, arms: list[tuple[Plan, list[ScheduledBatch]]], log: Callable[[str], None],
                  progress: Progress | None = None) -> tuple[CostModel, Calibration | None]:
    """``calibrate_cost`` around what ``arms`` (plan, steps) run: their microbatch sizes and TP
    degrees (``microbatch_sizes``) and their LLM's sample length (``sample_lengths``); ``cost`` and
    None where it is not a profile."""
    cost = priced_by(cost)
    if not isinstance(cost, ProfiledCostModel):
        return cost, None
    sizes, tps = microbatch_sizes(cost, arms)
    return calibrate_cost(cost, log, sizes, tps, progress, sample_lengths(cost, arms))


def machine_warning(then: str) -> Callable[[CostModel], str]:
    """``setup``'s ``machine``: ``dflop: warning: <what differs>: <then>`` for a cost model whose profile
    was measured on another machine (``machine_note``), '' for any other."""
    def line(cost: CostModel) -> str:
        note = machine_note(cost)
        return f"dflop: warning: {note}: {then}" if note else ""
    return line


def planning_setup(config: Path | None, calibrate: bool, log: Callable[[str], None], **options: Any) -> Setup:
    """A planning job's (`dflop optimize`, `dflop simulate`) set-up: its first line warns of a profile
    measured elsewhere, pointing to what measures it here; with ``calibrate`` (`--calibrate`), its
    cost model calibrated at the middle of the profile's grid (the plan, whose microbatch sizes a run
    measures around, is not known yet), planning included. ``options``: ``setup``'s."""
    warning = machine_warning(CHECK + ("" if calibrate else " (--calibrate scales it to this machine)"))
    s = setup(config, log=log, machine=warning, **options)
    if not calibrate:
        return s
    cost, _ = calibrate_cost(s.system.cost, log)
    return replace(s, system=replace(s.system, cost=cost))
