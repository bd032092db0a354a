"""Which cost model to use: measured profiles when there are some for this device and both
modules, the analytical model otherwise, and always saying which."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterable

from dflop.cost.analytical import UNCALIBRATED_ERROR, AnalyticalCostModel
from dflop.cost.profiled import ProfiledCostModel
from dflop.cost.protocol import CostModel
from dflop.cost.store import load_records
from dflop.specs.hardware import HardwareSpec, TrainingSpec
from dflop.specs.models import MLLMSpec


def select_cost_model(model: MLLMSpec, hardware: HardwareSpec, training: TrainingSpec,
                      profiles: Iterable[str | Path] = (),
                      warn: Callable[[str], None] | None = None) -> tuple[CostModel, str]:
    """(cost model, a line saying which and why)."""
    records = [r for r in load_records(profiles, warn) if r["device"] in hardware.device_names]
    names = {"encoder": model.encoder.name, "llm": model.llm.name}
    for dtype in ("bfloat16", "float32", "float16"):
        mine = [r for r in records if r["dtype"] == dtype and r["model"] == names[r["module"]]]
        covered = {r["module"] for r in mine if r["phase"] == "block"}
        if covered == {"encoder", "llm"}:
            cost = ProfiledCostModel(model, hardware, training, mine, device=mine[0]["device"], dtype=dtype)
            err = cost.holdout_error()
            return cost, (f"cost model: {cost.name}, held-out error median {err['median']:.1%} "
                          f"on {err['shapes']} shapes")
    return (AnalyticalCostModel(model, hardware, training),
            f"cost model: analytical ({hardware.name}; no measured profile of {model.encoder.name} and "
            f"{model.llm.name} on this device)")



def prediction_error(cost: CostModel) -> tuple[float, str]:
    """(sigma, where it comes from) of the per-sample cost error to assume for ``cost``: the
    profiled model's median held-out error, or the analytical model's stated default."""
    if isinstance(cost, ProfiledCostModel):
        sigma = cost.prediction_error()
        if math.isfinite(sigma) and sigma > 0:
            return sigma, "median held-out error of the profiled model"
    return UNCALIBRATED_ERROR, "stated default for an uncalibrated analytical model"
