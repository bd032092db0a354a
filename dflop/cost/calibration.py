"""Calibration: a profile measured elsewhere, priced at the speed of the machine that uses it.

A profile is one machine's times; on another CPU (or GPU, driver, torch) the same shapes run at
another speed, and every prediction made from the profile is off by that ratio. A run measures a
few of the profile's own shapes here (``dflop.profile.drift.calibrate``, around its microbatch
sizes) and scales the profile's times by what it found before it reports a prediction.

Per part (module and phase: blocks, embeddings, head, projector), not one ratio: across CPUs the
parts move by different amounts (a block's GEMMs with the instruction set, an embedding's gather and
a head's cross-entropy with memory bandwidth), and one ratio over the measured shapes, one of each
part per size, would weigh an embedding as much as a block, which a step runs once per layer. Each
part's ratio is its shapes' times summed, now over then, so its larger shapes (the ones a step
spends its time in) weigh most. A part the check does not measure (FSDP2's units) moves by the
overall ratio.

Only what the profile measured is scaled: communication the cost model prices from the hardware
spec stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from dflop.cost.profiled import ProfiledCostModel


def part_name(module: str, phase: str) -> str:
    """A part's key in ``Calibration.ratios``: ``llm block``, ``encoder embed``..."""
    return f"{module} {phase}"


@dataclass(frozen=True)
class Calibration:
    """What a quick check of a profile's shapes found on this machine."""

    ratios: dict[str, float]
    """Per part (``part_name``): its shapes' time here over their time in the profile."""
    ratio: float
    """Over every shape measured: how much slower (above 1) or faster this machine runs them."""
    seconds: float
    """What measuring them took."""
    shapes: tuple[dict[str, Any], ...]
    """Each shape measured: model, module, tp, part, shape, then_ms (the profile's), now_ms (here)."""

    @classmethod
    def of(cls, shapes: Iterable[dict[str, Any]], seconds: float) -> "Calibration":
        shapes = tuple(shapes)
        totals: dict[str, list[float]] = {}
        for s in shapes:
            total = totals.setdefault(part_name(s["module"], s["part"]), [0.0, 0.0])
            total[0] += s["now_ms"]
            total[1] += s["then_ms"]
        return cls({name: now / then for name, (now, then) in sorted(totals.items())},
                   sum(s["now_ms"] for s in shapes) / sum(s["then_ms"] for s in shapes), seconds, shapes)

    def ratio_of(self, module: str, phase: str) -> float:
        """The ratio a part's times are scaled by: its own, else the overall one."""
        return self.ratios.get(part_name(module, phase), self.ratio)

    def to_json(self) -> dict[str, Any]:
        return {"ratios": dict(self.ratios), "ratio": self.ratio, "seconds": self.seconds, "shapes": list(self.shapes)}


def scale_records(records: Iterable[dict[str, Any]], calibration: Calibration) -> list[dict[str, Any]]:
    """``records`` with their forward and backward times scaled by their part's ratio (memory as measured)."""
    return [{**r, "fwd_ms": r["fwd_ms"] * calibration.ratio_of(r["module"], r["phase"]),
             "bwd_ms": r["bwd_ms"] * calibration.ratio_of(r["module"], r["phase"])} for r in records]


def calibrated(cost: ProfiledCostModel, calibration: Calibration) -> ProfiledCostModel:
    """``cost`` fitted on its records scaled by ``calibration``: a part scaled by r is priced r times
    its time at every shape (the fit weighs relative error, so a group scaled whole fits scaled whole)."""
    return ProfiledCostModel(cost.model, cost.hardware, cost.training, scale_records(cost.records, calibration),
                             device=cost.device, dtype=cost.dtype)
