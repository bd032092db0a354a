"""Which cost model to use: measured profiles when there are some for this device and both
modules, the analytical model otherwise, and always saying which."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterable

from dflop.cost.analytical import UNCALIBRATED_ERROR, AnalyticalCostModel
from dflop.cost.frozen import priced_by
from dflop.cost.profiled import ProfiledCostModel
from dflop.cost.protocol import CostModel
from dflop.cost.store import architecture_mismatch, load_sourced
from dflop.specs.hardware import HardwareSpec, TrainingSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import MODULES, Module


def select_cost_model(model: MLLMSpec, hardware: HardwareSpec, training: TrainingSpec,
                      profiles: Iterable[str | Path] = (),
                      warn: Callable[[str], None] | None = None) -> tuple[CostModel, str]:
    """(cost model, a line saying which and why). Records are matched by model name and then by
    architecture: a profile of a model of the same name but other widths (a config's own
    ``tiny-llm``, 4096 wide) would price it dozens of times too fast, so it is not used."""
    specs = {Module.ENCODER: model.encoder, Module.LLM: model.llm}
    usable, other = [], ""
    for r, where in load_sourced(profiles, warn):
        if r["device"] not in hardware.device_names or r["model"] != specs[r["module"]].name:
            continue
        mismatch = architecture_mismatch(r, specs[r["module"]])
        if not mismatch:
            usable.append((r, where))
        elif not other:
            other = f"the profile of {r['model']} in {where} was measured on another architecture ({mismatch})"
    for dtype in ("bfloat16", "float32", "float16"):
        mine = [r for r, _ in usable if r["dtype"] == dtype]
        covered = {r["module"] for r in mine if r["phase"] == "block"}
        if covered == set(MODULES):
            cost = ProfiledCostModel(model, hardware, training, mine, device=mine[0]["device"], dtype=dtype)
            err = cost.holdout_error()
            sources = sorted({where for r, where in usable if r["dtype"] == dtype})
            return cost, (f"cost model: {cost.name} from {', '.join(sources)}, "
                          f"held-out error median {err['median']:.1%} on {err['shapes']} shapes")
    return (AnalyticalCostModel(model, hardware, training),
            f"cost model: analytical ({hardware.name}; " + (other or f"no measured profile of {model.encoder.name} "
                                                             f"and {model.llm.name} on this device") + ")")



def prediction_error(cost: CostModel) -> tuple[float, str]:
    """(sigma, where it comes from) of the per-sample cost error to assume for ``cost``: the
    profiled model's median held-out error, or the analytical model's stated default."""
    cost = priced_by(cost)
    if isinstance(cost, ProfiledCostModel):
        sigma = float(cost.holdout_error()["median"])
        if math.isfinite(sigma) and sigma > 0:
            return sigma, "median held-out error of the profiled model"
    return UNCALIBRATED_ERROR, "stated default for an uncalibrated analytical model"
