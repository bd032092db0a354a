"""Profile drift: is a stored profile still this machine's?

A profile is one machine measured at one time. A shared VM's speed moves with its
neighbours, a cluster's nodes differ, a driver or torch upgrade moves kernels; a cost
model fitted on the profile then prices every op too high or too low. Measuring a few of the profile's own shapes again, the
same way (processes, TP groups, dtype), says by how much, apart from anything the
simulator gets wrong: per model, each part (block, embeddings, head, projector) at
every stored TP degree, at a few grid sizes around a microbatch size.

It diagnoses, it does not correct: the parts of a profile move by different amounts,
and whole steps by less than their ops, so rescaling a profile part by part from a
check can bring the median step time closer while ordering the plans worse, and the
order of plans is what the optimizer needs. When a check says the profile is off,
measure it again. A run (and `--calibrate`) does rescale, by ``calibrate``'s quick check, the
predictions it reports (``dflop.cost.calibration``); it plans on the profile as recorded.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from dflop.cost.calibration import Calibration
from dflop.cost.store import ProfileStore, record_key
from dflop.errors import DflopError
from dflop.specs.progress import Progress
from dflop.profile.profiler import Grid, default_llm, device_name, profile_model, resolve
from dflop.specs.plan import Module


@dataclass(frozen=True)
class Remeasured:
    """One stored record and the same shape measured now (forward plus backward)."""

    record: dict[str, Any]
    now_ms: float

    @property
    def then_ms(self) -> float:
        return total_ms(self.record)


def total_ms(record: dict[str, Any]) -> float:
    """Forward plus backward of a record: what a step spends on the shape."""
    return record["fwd_ms"] + record["bwd_ms"]


@dataclass(frozen=True)
class Drift:
    """One model's shapes measured again, and how they were measured (as the profile was)."""

    model: str
    dtype: str
    processes: int
    threads: int
    shapes: tuple[Remeasured, ...]

    @property
    def ratio(self) -> float:
        return time_ratio(self.shapes)

    def parts(self) -> dict[tuple[int, str], float]:
        """Time now over time then per (TP degree, part): a machine that slowed evenly moves every
        part alike; parts that disagree say the profile's parts were measured at different speeds."""
        out: dict[tuple[int, str], list[Remeasured]] = {}
        for s in self.shapes:
            out.setdefault((s.record["tp"], s.record["phase"]), []).append(s)
        return {part: time_ratio(ss) for part, ss in sorted(out.items())}

    @property
    def measured_at(self) -> str:
        """When the re-measured records were measured (the earliest, as far as the store says)."""
        return min((s.record.get("measured_at", "?") for s in self.shapes), default="?")


def time_ratio(shapes: Iterable[Remeasured]) -> float:
    """Time now over time then, each summed: the large ops a step spends its time in weigh most, as
    they do in a predicted step."""
    shapes = list(shapes)
    return sum(s.now_ms for s in shapes) / sum(s.then_ms for s in shapes)


def overall_ratio(drifts: list[Drift]) -> float:
    """Time now over time then over every model's shapes."""
    return time_ratio(s for d in drifts for s in d.shapes)


POINTS = 3
"""Grid points per part measured again: each stored record carries its own noise, which one point
would pass on whole."""


def _around(values: set[int], points: int = 1, near: float | None = None) -> tuple[int, ...]:
    """``points`` consecutive values, centred on the one nearest ``near`` (default: the middle one)."""
    ordered = sorted(values)
    centre = (len(ordered) - 1) // 2 if near is None else min(range(len(ordered)),
                                                                key=lambda i: abs(ordered[i] - near))
    start = max(0, min(centre - (points - 1) // 2, len(ordered) - points))
    return tuple(ordered[start:start + points])


def probe_grid(kind: Module, records: list[dict[str, Any]], near: float | None = None,
               points: int = POINTS, length: float | None = None) -> Grid:
    """``points`` sizes of the grid the records were measured on (holdouts aside), centred on the one
    nearest ``near`` (LLM tokens or encoder tiles per microbatch; default the middle of the grid), every
    part at each; LLM blocks packed at the per-sample length measured at the centre size nearest
    ``length`` (default the middle one): attention's share of a block grows with it."""
    blocks = [r["shape"] for r in records if r["phase"] == "block" and not r.get("holdout")]
    if not blocks:
        raise DflopError(f"profile of {records[0]['model']}: no block records to measure again")
    if kind == Module.LLM:
        tokens = _around({s["tokens"] for s in blocks}, points, near)
        centre = tokens[(len(tokens) - 1) // 2]
        seq = _around({s["seq"] for s in blocks if s["tokens"] == centre}, 1, length)
        return Grid(tokens=tokens, seq=seq, tiles=(), holdout_llm=(), holdout_tiles=())
    return Grid(tokens=(), seq=(), tiles=_around({s["tiles"] for s in blocks}, points, near), holdout_llm=(),
                holdout_tiles=())


def measure_drift(records: list[dict[str, Any]], name: str, *, device: str = "cpu", llm: str | None = None,
                  tokens: float | None = None, tiles: float | None = None, repeats: int | None = None,
                  progress: Progress | None = None, tps: tuple[int, ...] | None = None,
                  points: int = POINTS, length: float | None = None) -> Drift:
    """Measure again, the way they were measured (dtype, processes, threads), a few of ``records``'
    shapes of model ``name`` on this machine's ``device``, around microbatches of ``tokens`` (an LLM,
    its samples about ``length`` tokens long) or ``tiles`` (an encoder) (see ``probe_grid``), at every
    stored TP degree (or those of ``tps`` that are stored, if any are)."""
    kind, spec = resolve(name)
    where = device_name(device)
    mine = [r for r in records if r["model"] == spec.name and r["device"] == where]
    if not mine:
        raise DflopError(f"--model {name}: the profile holds no records of it on {where}")
    dtype = Counter(r["dtype"] for r in mine).most_common(1)[0][0]
    mine = [r for r in mine if r["dtype"] == dtype]
    processes, threads = Counter(_measured_by(r) for r in mine).most_common(1)[0][0]
    mine = [r for r in mine if _measured_by(r) == (processes, threads)]
    stored = tuple(sorted({r["tp"] for r in mine if processes == 1 or processes % r["tp"] == 0}))
    tps = tuple(tp for tp in stored if tp in (tps or ())) or stored
    grid = probe_grid(kind, [r for r in mine if r["tp"] == tps[0]], tokens if kind == Module.LLM else tiles, points,
                      length)
    stored = {record_key(r): r for r in mine}
    with tempfile.TemporaryDirectory(prefix="dflop-drift-") as tmp:
        profile_model(spec.name, tmp, device=device, dtype=dtype, tps=tps, grid=grid, repeats=repeats,
                      llm=(llm or default_llm(spec.name)) if kind == Module.ENCODER else None, processes=processes,
                      threads=threads, progress=progress, again=False)
        now = ProfileStore.in_dir(tmp).read()
    shapes = tuple(Remeasured(stored[record_key(r)], total_ms(r))
                   for r in now if record_key(r) in stored)
    if not shapes:
        raise DflopError(f"--model {name}: the profile holds none of the shapes it was to measure again")
    return Drift(spec.name, dtype, processes, now[0]["threads"], shapes)


def _measured_by(record: dict[str, Any]) -> tuple[int, int | None]:
    """Processes and threads per process (None: not recorded, measured again at the default)."""
    return record.get("processes", 1), record.get("threads")


CALIBRATION_POINTS = 1
"""Sizes per part a run's calibration measures: the grid size nearest its microbatch (each one more
adds a second of measuring per part, and the larger of them several)."""
CALIBRATION_REPEATS = 3
"""Timed repeats per shape of a run's calibration: a few seconds in all, next to a run of minutes."""


def calibrate(records: list[dict[str, Any]], sizes: dict[str, float | None], *, device: str = "cpu",
              tps: dict[str, tuple[int, ...]] | None = None, llm: str | None = None,
              progress: Progress | None = None, lengths: dict[str, float | None] | None = None) -> Calibration:
    """The quick check a run makes before its first step (``dflop.cost.calibration``): per model of
    ``sizes`` (its name: LLM tokens or encoder tiles per microbatch, None for the middle of the grid),
    ``CALIBRATION_POINTS`` sizes of every part at the TP degrees of ``tps`` (the plan's), an LLM's
    blocks at the per-sample length nearest its ``lengths``, each ``CALIBRATION_REPEATS`` times,
    measured as the profile was."""
    start = time.perf_counter()
    shapes = []
    for name, size in sizes.items():
        kind, _ = resolve(name)
        d = measure_drift(records, name, device=device, llm=llm, tokens=size if kind == Module.LLM else None,
                          tiles=size if kind == Module.ENCODER else None, repeats=CALIBRATION_REPEATS,
                          progress=progress, tps=(tps or {}).get(name), points=CALIBRATION_POINTS,
                          length=(lengths or {}).get(name))
        shapes += [{"model": d.model, "module": s.record["module"], "tp": s.record["tp"], "part": s.record["phase"],
                    "shape": s.record["shape"], "then_ms": s.then_ms, "now_ms": s.now_ms} for s in d.shapes]
    return Calibration.of(shapes, time.perf_counter() - start)
