"""How long profiling a model will take, said before it starts.

Each shape of the grid costs the FLOPs of its forward and backward (three forwards) for
every timed sample (the probes, the warm-up and the repeats), at the hardware preset's peak
and efficiency curve, and at least the profiler's minimum sample time. On a CPU this is an
order of magnitude, not a promise: the ``cpu`` preset's peak is an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflop.cost import flops as F
from dflop.profile.profiler import (GRIDS, MIN_SAMPLE_MS, PROBES, REPEATS, WARMUP, default_llm, jobs,
                                    packed_lengths, resolve)
from dflop.specs import presets
from dflop.specs.hardware import HardwareSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module

WARN_S = 600.0
"""Estimates above this many seconds come with a warning."""


@dataclass(frozen=True)
class Estimate:
    seconds: float
    shapes: int
    largest_flops: float
    """Forward FLOPs of the grid's largest block."""


def _forward_flops(kind: Module, spec, pair: MLLMSpec | None, phase: str, shape: dict[str, int], tp: int) -> float:
    if kind == Module.LLM:
        tokens, seq = shape["tokens"], shape.get("seq", 0)
        if phase == "block":
            sum_sq = sum(n * n for n in packed_lengths(tokens, seq))
            return float(F.llm_layer_flops(spec, tokens, sum_sq).total) / tp
        return float(F.llm_head_flops(spec, tokens)) / tp if phase == "head" else 0.0
    tiles = shape["tiles"]
    if phase == "block":
        return float(F.vit_layer_flops(spec, tiles).total) / tp
    if phase == "embed":
        return float(F.vit_embedding_flops(spec, tiles))
    return float(F.projector_flops(pair, tiles))


def profile_estimate(name: str, hardware: HardwareSpec, *, device: str = "cpu", grid: str | None = None,
                     tps: tuple[int, ...] = (1,), repeats: int | None = None, llm: str | None = None) -> Estimate:
    """Seconds that ``dflop profile model`` needs for every shape of the grid (less what a store has)."""
    kind, spec = resolve(name)
    chosen = GRIDS[grid or ("gpu" if device == "cuda" else "cpu")]
    pair = MLLMSpec(encoder=spec, llm=presets.llm(llm or default_llm(spec.name))) if kind == Module.ENCODER else None
    samples = PROBES + WARMUP + (repeats or REPEATS[device])
    floor = 3 * MIN_SAMPLE_MS[device] / 1e3
    seconds, shapes, largest = 0.0, 0, 0.0
    for tp in tps:
        for phase, shape, _, _, _ in jobs(kind, spec, pair, tp, chosen, torch.float32, "cpu"):
            forward = _forward_flops(kind, spec, pair, phase, shape, tp)
            seconds += samples * max(float(hardware.compute_time(3 * forward)), floor)
            shapes += 1
            if phase == "block":
                largest = max(largest, forward)
    return Estimate(seconds, shapes, largest)


def duration(seconds: float) -> str:
    """Rounded for a reader: '40 s', '7 min', '6 h 8 min'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60} min"
