"""What the torch-backend benchmarks share: the tiny models on 2 local CPU processes (gloo, one
thread each, so the ranks never outnumber this machine's 2 cores), a data mix, and plans written
as short dicts."""

from __future__ import annotations

import argparse
from typing import Any


def parser(description: str, mix: str | None) -> argparse.ArgumentParser:
    """The shared options; ``--mix`` with ``mix`` as its default (none for a benchmark of several mixes)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--batch", type=int, default=16)
    if mix is not None:
        p.add_argument("--mix", default=mix)
    p.add_argument("--profiles", action="append", default=[], help="profile store folder(s)")
    p.add_argument("--json", help="also write the figures here")
    return p


def setup(args: argparse.Namespace) -> tuple[Any, Any, Any, str]:
    """(system, cost model, the mix's samples, the cost model's note) for 2 local CPU processes."""
    from dflop.cost import System
    from dflop.cost.select import select_cost_model
    from dflop.specs import ClusterSpec, TrainingSpec, presets
    from dflop.workload import profile_mix

    model = presets.model("tiny-vit", "tiny-llm")
    hardware = presets.hardware("cpu")
    training = TrainingSpec(global_batch=args.batch)
    cost, note = select_cost_model(model, hardware, training, args.profiles)
    system = System(model, ClusterSpec(hardware=hardware, nodes=1, gpus_per_node=2), training, cost)
    return system, cost, profile_mix(args.mix, 4000, model.encoder, seed=0).samples, note


def plan(fields: dict[str, Any]) -> Any:
    """A Plan from ``{"encoder": {...}, "llm": {...}, **other plan fields}``."""
    from dflop.specs import ModulePlan, Plan

    return Plan(encoder=ModulePlan(**fields["encoder"]), llm=ModulePlan(**fields["llm"]),
                **{k: v for k, v in fields.items() if k not in ("encoder", "llm")})
