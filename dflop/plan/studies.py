"""What-if studies, as functions a notebook calls: each returns one tidy record per point.

Every record carries step times with their MFU and HFU, the strongest
baseline (space x batching rule) and the speedup's decomposition.

- ``gpu_scaling``: dflop vs the strongest baseline as the cluster grows;
- ``mix_shift``: as the share of video (or any modality) in the data changes;
- ``model_pairs``: as the encoder/LLM compute ratio changes.

The global batch grows with the cluster (``samples_per_gpu``), as it does in
practice; each point runs the optimizer (dflop's space and the baselines') with
the fast evaluator. ``search`` options go to :func:`dflop.plan.search.optimize`
(a smaller ``budget``, ``first``/``most`` batches, other ``spaces``), so a
notebook can trade thoroughness for time and say so; a study's searches spread
over one worker process per usable core unless ``workers`` says otherwise.
"""

from __future__ import annotations

from typing import Any, Iterable

from dflop.cost.analytical import AnalyticalCostModel
from dflop.cost.system import System
from dflop.cost.flops import llm_layer_flops, vit_layer_flops
from dflop.plan.evaluate import PlanningProblem
from dflop.plan.report import OptimizeResult, score
from dflop.plan.search import optimize, usable_cores
from dflop.specs import presets
from dflop.specs.hardware import ClusterSpec, TrainingSpec
from dflop.workload.mixes import MixSpec, mix, synthesize, with_shares


def study_problem(encoder: str, llm: str, gpus: int, spec: MixSpec | str = "llava-ov", samples_per_gpu: int = 8,
                  hardware: str = "h100", seed: int = 0) -> tuple[PlanningProblem, int]:
    """One point of a study as a planning problem and its global batch, to look closer at its plans."""
    spec = mix(spec) if isinstance(spec, str) else spec
    model = presets.model(encoder, llm)
    per_node = min(8, gpus)
    cluster = ClusterSpec(hardware=presets.hardware(hardware), nodes=gpus // per_node, gpus_per_node=per_node)
    batch = samples_per_gpu * gpus
    training = TrainingSpec(global_batch=batch)
    data = synthesize(spec, 20000, model.encoder, seed)
    system = System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training))
    return PlanningProblem(system, data, seed), batch


def _record(result: OptimizeResult, **point: Any) -> dict[str, Any]:
    best, strongest = result.best, result.strongest
    n = best.n
    out = {**point, "dflop_step_s": score(best), "dflop_plan": best.plan.describe(),
           "dflop_placement": best.plan.placement, "dflop_bubble": sum(best.bubble) / n,
           "dflop_idle": sum(best.idle) / n, "dflop_mfu": sum(best.mfu) / n, "dflop_hfu": sum(best.hfu) / n,
           "ideal_step_s": result.ideal_s, "search_s": result.seconds}
    if strongest is not None:
        base = strongest.best
        out.update({"baseline": strongest.name, "baseline_step_s": score(base), "baseline_plan": base.plan.describe(),
                    "baseline_bubble": sum(base.bubble) / base.n, "baseline_idle": sum(base.idle) / base.n,
                    "baseline_mfu": sum(base.mfu) / base.n, "baseline_hfu": sum(base.hfu) / base.n,
                    "speedup": result.speedup, **(result.decomposition or {})})
    return out


def _search(problem: PlanningProblem, batch: int, options: dict[str, Any]) -> OptimizeResult:
    return optimize(problem, batch, **{"workers": usable_cores(), **options})


def gpu_scaling(gpus: Iterable[int], *, encoder: str = "siglip-so400m", llm: str = "qwen2.5-7b",
                data: str = "llava-ov", samples_per_gpu: int = 8, hardware: str = "h100",
                seed: int = 0, **search: Any) -> list[dict[str, Any]]:
    records = []
    for n in gpus:
        p, batch = study_problem(encoder, llm, n, data, samples_per_gpu, hardware, seed)
        records.append(_record(_search(p, batch, search), gpus=n, global_batch=batch, encoder=encoder, llm=llm))
    return records


def mix_shift(shares: Iterable[dict[str, float]], *, gpus: int = 32, encoder: str = "siglip-so400m",
              llm: str = "qwen2.5-7b", base: str = "llava-ov", samples_per_gpu: int = 8,
              hardware: str = "h100", seed: int = 0, **search: Any) -> list[dict[str, Any]]:
    """One point per modality share, e.g. ``[{"video": 0.1, "image": 0.9}, ...]``."""
    records = []
    for share in shares:
        spec = with_shares(mix(base), **share)
        p, batch = study_problem(encoder, llm, gpus, spec, samples_per_gpu, hardware, seed)
        records.append(_record(_search(p, batch, search), gpus=gpus,
                               **{f"share_{k}": v for k, v in spec.shares.items()}))
    return records


def compute_ratio(problem: PlanningProblem) -> float:
    """Encoder FLOPs over LLM FLOPs of the data's average sample: how comparable the two loads are."""
    model, data = problem.model, problem.data
    tokens = float(data.llm_tokens.mean())
    square = float((data.llm_tokens.astype(float) ** 2).mean())
    encoder = vit_layer_flops(model.encoder, float(data.tiles.mean())).total * model.encoder.layers
    llm = llm_layer_flops(model.llm, tokens, square).total * model.llm.layers
    return float(encoder / llm)


def model_pairs(pairs: Iterable[tuple[str, str]], *, gpus: int = 64, data: str = "llava-ov",
                samples_per_gpu: int = 8, hardware: str = "h100", seed: int = 0, **search: Any) -> list[dict[str, Any]]:
    records = []
    for encoder, llm in pairs:
        p, batch = study_problem(encoder, llm, gpus, data, samples_per_gpu, hardware, seed)
        records.append(_record(_search(p, batch, search), gpus=gpus, encoder=encoder, llm=llm,
                               encoder_to_llm_flops=compute_ratio(p)))
    return records
