"""Every kind of prediction dflop makes, compared exactly with figures frozen from an earlier tree.

What is frozen (``tests/golden/predictions.json``), on settings cheap enough for the suite:

- the optimizer (``optimize`` on a problem set up as ``benchmarks/bench_optimizer.py`` sets it
  up, with fewer samples, GPUs and batches): dflop's plan, its bins and step times, the runners-up,
  every baseline's plan and step times with its own rule and with dflop's bins, the speedup and
  its decomposition, the step times at the stated prediction error;
- the SimPy simulator (with and without link contention) and the fast evaluator on fixed bins
  of fixed batches, for a plan of every pipeline schedule, colocated and disaggregated, every ZeRO
  level: step times, bubble and idle fractions, per-rank busy time and peak memory; and
  ``simulate_pipeline`` on every registered schedule;
- ``dflop run`` (sim backend) on its embedded config, shrunk to 4 GPUs, 2000 samples and 3 steps:
  the plans chosen and every simulated and expected figure of its report;
- the cost models' op costs: the analytical model on H100 and the profiled model built from the
  shipped CPU profile, for a few stages and shapes;
- the torch backend's prediction for the tiny models of ``dflop run --backend torch``'s embedded
  config: the plans it trains and ``predicted_step_time_s`` of each (no process is started).

Why: a restructure that moves code (issue 29: a jobs layer, lowering as passes, a timing
package, derived plan facts) must leave every plan and every step time as it was, to the
nanosecond; this test says which figure moved. Floats are compared to ``ROUNDING`` (JSON keeps a
float's repr, which round-trips): the profiled model's fits run through the BLAS kernels of the
CPU's instruction set, which round the last bit apart from one CPU to another (an AMD EPYC's
AVX-512 kernels against the machine the figures were frozen on), and a restructure moves a figure
by far more; every input is seeded, the optimizer's bins come from its deterministic
heuristic, the simulator's bins are fixed, and ``dflop run`` uses the ``lpt`` solver: the
configured ``auto`` searches until a deadline, so its bins would depend on the machine's speed,
while with ``lpt`` a late solve's fallback is the very same answer (the optimizer's SimPy
confirmation uses the deterministic ``greedy`` solver, whose 0.5 s limit batches of 16 samples
never approach). Nothing depends on time, hash order or hypothesis.

The entry points used are imported below, in one place, so that moving one is a one-line change
here. The goldens are regenerated only on a deliberate change of the model (a cost, a schedule,
the search, the data): ``python tests/test_frozen_predictions.py`` rewrites them, and the diff
of that file is the change's effect on every figure, to be reviewed with it.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

# ---- the entry points (the one place to change when they move) -------------------------------
from dflop.backends import ScheduledBatch, get_backend
from dflop.cost import AnalyticalCostModel, StageSpec, System, WorkShape
from dflop.cost.select import prediction_error, select_cost_model
from dflop.jobs import optimize as jobs_optimize
from dflop.jobs import run as jobs_run
from dflop.jobs import setup as jobs_setup
from dflop.jobs import steps as jobs_steps
from dflop.plan.evaluate import PlanningProblem
from dflop.plan.search import optimize
from dflop.timing.evaluate import evaluate
from dflop.program.schedules import SCHEDULES, stages_per_rank
from dflop.timing.steps import CostedPlan
from dflop.sim import simulate_pipeline
from dflop.specs import ClusterSpec, ModulePlan, Plan, TrainingSpec, presets
from dflop.specs.plan import Recompute
from dflop.specs.run import DEFAULTS
from dflop.workload import profile_mix

GOLDEN = Path(__file__).parent / "golden" / "predictions.json"
pytestmark = pytest.mark.filterwarnings("ignore:profiled cost model.*extrapolating:UserWarning")


def fast_step_ns(runner: CostedPlan, batch: Any, assignment: np.ndarray) -> int:
    """The fast evaluator's step time (what the optimizer ranks plans by)."""
    return int(evaluate(runner.step(0, batch, assignment).timing).step_ns)


def torch_prediction(runner: CostedPlan, steps: list[ScheduledBatch]) -> list[float]:
    """``predicted_step_time_s`` of a torch run: the simulator (no memory counters) on the very
    steps the ranks train, as ``TorchBackend`` predicts them."""
    return [s["step_s"] for s in get_backend("sim", memory=False).run(runner, steps).steps]


def embedded_config(backend: str, folder: Path, **changes: Any) -> Path:
    """The embedded run config of ``backend`` with ``changes`` ({"section.key": value}), as a file."""
    config = yaml.safe_load(resources.files("dflop.specs").joinpath(DEFAULTS[backend]).read_text())
    for key, value in changes.items():
        section, name = key.split(".")
        config[section][name] = value
    path = folder / f"{backend}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def quiet(message: str) -> None:
    pass


# ---- turning answers into plain figures ------------------------------------------------------

def plain(value: Any) -> Any:
    """JSON's view of ``value`` (numpy scalars as Python numbers, tuples as lists)."""
    return json.loads(json.dumps(value, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def plan_figures(plan: Plan) -> dict[str, Any]:
    module = lambda p: {"tp": p.tp, "pp": p.pp, "dp": p.dp, "layers_per_stage": list(p.layers_per_stage)}  # noqa: E731
    return {"describe": plan.describe(), "encoder": module(plan.encoder), "llm": module(plan.llm),
            "placement": str(plan.placement), "microbatches": plan.microbatches, "schedule": plan.schedule,
            "virtual_stages": plan.virtual_stages, "zero": plan.zero, "hsdp": plan.hsdp,
            "fp32_grads": plan.fp32_grads, "recompute": str(plan.recompute)}


def estimate_figures(e: Any, at_error: dict[int, float]) -> dict[str, Any] | None:
    if e is None:
        return None
    return {"plan": plan_figures(e.plan), "batching": str(e.batching),
            "within": None if e.within is None else str(e.within), "expected_step_time_s": e.mean,
            "step_time_s": e.steps, "bubble": e.bubble, "idle": e.idle, "imbalance": e.imbalance, "mfu": e.mfu,
            "hfu": e.hfu, "peak_memory_bytes": e.peak_memory, "simulated_step_time_s": e.simulated,
            "infeasible": e.infeasible, "step_time_at_error_s": at_error.get(id(e))}


def optimize_figures(r: Any) -> dict[str, Any]:
    return {"best": estimate_figures(r.best, r.at_error),
            "alternatives": [estimate_figures(e, r.at_error) for e in r.alternatives],
            "baselines": [{"name": b.name, "best": estimate_figures(b.best, r.at_error),
                           "balanced": estimate_figures(b.balanced, r.at_error)} for b in r.baselines],
            "strongest": None if r.strongest is None else r.strongest.name, "speedup": r.speedup,
            "decomposition": r.decomposition, "ideal_step_time_s": r.ideal_s, "noise": r.noise,
            "at_error": r.speedup_at_error()}


# ---- the optimizer ---------------------------------------------------------------------------

OPTIMIZER = {  # name: (encoder, llm, data mix, GPUs, samples per GPU in the global batch)
    "internvit-6b + qwen2.5-7b, video-heavy, 8 gpus": ("internvit-6b", "qwen2.5-7b", "video-heavy", 8, 2),
    "siglip-so400m + qwen2.5-32b, image-heavy, 16 gpus": ("siglip-so400m", "qwen2.5-32b", "image-heavy", 16, 1),
}
SEARCH = {"first": 2, "most": 3, "budget": 8}
"""Fewer batches and evaluations than the optimizer's defaults: the same search, cheaper."""


def planning_problem(encoder: str, llm: str, mix: str, gpus: int, per_gpu: int) -> tuple[PlanningProblem, int]:
    """As ``benchmarks/bench_optimizer.py``'s ``problem``, with 2000 samples and ``per_gpu`` per GPU."""
    model = presets.model(encoder, llm)
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus))
    batch = per_gpu * gpus
    training = TrainingSpec(global_batch=batch)
    data = profile_mix(mix, 2000, model.encoder, seed=0).samples
    system = System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training))
    return PlanningProblem(system, data), batch


def optimizer_setting(name: str) -> dict[str, Any]:
    problem, batch = planning_problem(*OPTIMIZER[name])
    return optimize_figures(optimize(problem, batch, noise=prediction_error(problem.cost)[0], **SEARCH))


# ---- the simulator and the fast evaluator ----------------------------------------------------

SIM_MODEL = ("siglip-so400m", "qwen2.5-7b")
SIM_BATCH = 16


def colocated(tp: int, pp: int, dp: int, m: int, schedule: str = "1F1B", v: int | None = None,
              **options: Any) -> Plan:
    return Plan(encoder=ModulePlan(tp=tp, dp=dp), llm=ModulePlan(tp=tp, pp=pp, dp=dp), placement="colocated",
                microbatches=m, schedule=schedule, virtual_stages=stages_per_rank(schedule, v), **options)


SIM_PLANS = {  # on 2 nodes of 4 H100
    "GPipe pp4 dp2": colocated(1, 4, 2, 4, "GPipe", zero=0),
    "1F1B tp2 pp2 dp2": colocated(2, 2, 2, 4),
    "Interleaved1F1B tp2 pp2 v2 dp2": colocated(2, 2, 2, 4, "Interleaved1F1B", v=2),
    "LoopedBFS pp2 v2 dp4": colocated(1, 2, 4, 2, "LoopedBFS", v=2),
    "ZBH1 tp2 pp4": colocated(2, 4, 1, 8, "ZBH1", recompute="selective"),
    "InterleavedZeroBubble pp4 v2 dp2": colocated(1, 4, 2, 4, "InterleavedZeroBubble", v=2),
    "ZBVZeroBubble tp2 pp2 dp2": colocated(2, 2, 2, 4, "ZBVZeroBubble"),
    "DualPipeV tp4 pp2": colocated(4, 2, 1, 4, "DualPipeV"),
    "disaggregated 1F1B": Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(tp=2, pp=2, dp=1, layers_per_stage=(13, 15)),
                               placement="disaggregated", microbatches=4),
    "disaggregated ZBH1 encoder pp2": Plan(encoder=ModulePlan(pp=2), llm=ModulePlan(pp=2, dp=3),
                                           placement="disaggregated", microbatches=4, schedule="ZBH1",
                                           fp32_grads=True),
    "zero0 dp8": colocated(1, 1, 8, 2, zero=0),
    "zero1 tp2 dp4 fp32 grads": colocated(2, 1, 4, 2, zero=1, fp32_grads=True),
    "zero2 dp8": colocated(1, 1, 8, 2, zero=2),
    "zero3 dp8 recompute full": colocated(1, 1, 8, 2, zero=3, recompute="full"),
    "zero3 hsdp dp8": colocated(1, 1, 8, 2, zero=3, hsdp=True),
}


@lru_cache(maxsize=1)
def sim_inputs() -> tuple[System, list[Any]]:
    model = presets.model(*SIM_MODEL)
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=2, gpus_per_node=4)
    training = TrainingSpec(global_batch=SIM_BATCH)
    system = System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training))
    profile = profile_mix("llava-ov", 2000, model.encoder, seed=0)
    rng = np.random.default_rng(0)
    return system, [profile.sample(SIM_BATCH, rng, f"s{i}-") for i in range(2)]


def simulator_setting(name: str) -> dict[str, Any]:
    system, batches = sim_inputs()
    plan = SIM_PLANS[name].validate(system.cluster, system.model, SIM_BATCH)
    runner = CostedPlan(plan, system)
    steps = [ScheduledBatch(b, np.arange(len(b)) % plan.bins) for b in batches]
    m = get_backend("sim").run(runner, steps).metrics
    exact = get_backend("sim", contention=False, memory=False).run(runner, steps).metrics
    return {"plan": plan_figures(plan), "step_time_s": m.step_time_s, "bubble_fraction": m.bubble_fraction,
            "idle_fraction": m.idle_fraction, "idle_by_module": m.idle_by_module, "busy_s": m.busy_s,
            "idle_s": m.idle_s, "mfu": m.mfu, "hfu": m.hfu, "peak_memory_gib": m.peak_memory_gib, "oom": len(m.oom),
            "step_time_without_contention_s": exact.step_time_s,
            "fast_evaluator_step_ns": [fast_step_ns(runner, s.batch, s.assignment) for s in steps]}


def pipelines() -> dict[str, Any]:
    """``simulate_pipeline`` on every registered schedule, 2 ranks, 4 microbatches, seeded times."""
    out = {}
    for kind in SCHEDULES.values():
        v = stages_per_rank(kind.name, 2)
        rng = np.random.default_rng(1)
        f, b, w = (rng.uniform(1e-3, 4e-3, (2 * v, 4)) for _ in range(3))
        result = simulate_pipeline(f, b, bwd_weight=w if kind.splits_backward else None, schedule=kind.name,
                                   microbatches=4, virtual_stages=v, p2p=1e-4)
        out[kind.name] = {"step_time": result.step_time, "bubble_fraction": result.bubble_fraction}
    return out


# ---- dflop run, and the torch backend's prediction --------------------------------------------

def run_sim() -> dict[str, Any]:
    """`dflop run` on its embedded config, on 4 GPUs, 2000 samples, a global batch of 16, 3 steps."""
    with tempfile.TemporaryDirectory(prefix="dflop-frozen-") as tmp:
        config = embedded_config("sim", Path(tmp), **{"cluster.nodes": 1, "cluster.gpus_per_node": 4,
                                                      "training.global_batch": 16, "data.samples": 2000,
                                                      "scheduler.solver": "lpt"})
        r = jobs_run.run(get_backend("sim"), config, steps=3, out=Path(tmp) / "out", log=quiet)
    for x in (r, r["baseline"]):  # each step's time besides: the figures are the ones before it
        x["step_time_s"] = {k: v for k, v in x["step_time_s"].items() if k != "each"}
    arm = ("step_time_s", "throughput_samples_per_s", "bubble_fraction", "idle_fraction", "idle_by_module",
           "utilisation", "mfu", "hfu", "peak_memory_gib", "oom_events")
    return plain({"plan": r["plan"], "batching": r["batching"], **{k: r[k] for k in arm},
                  "baseline": {k: r["baseline"][k] for k in ("space", "batching", "plan") + arm},
                  "baselines": r["baselines"], "speedup": r["speedup"], "decomposition": r["decomposition"],
                  "expected": r["expected"], "prediction_error": r["prediction_error"], "cost_model": r["cost_model"]})


def torch_prediction_figures() -> dict[str, Any]:
    """The plans `dflop run --backend torch` trains on its embedded config (dflop's with its bins,
    the strongest baseline's with its rule) and the prediction of each one's steps."""
    with tempfile.TemporaryDirectory(prefix="dflop-frozen-") as tmp:
        config = embedded_config("torch", Path(tmp), **{"scheduler.solver": "lpt"})
        s = jobs_setup.setup(config, backend="torch", log=quiet)
    result = jobs_optimize.optimize(s)
    out = {"cost_model": s.system.cost.name}
    for name, e in (("dflop", result.best), ("baseline", result.strongest.best)):
        runner = CostedPlan(e.plan, s.system)
        steps, _ = jobs_steps.schedule_steps(s, runner, steps=s.config.steps, solver="lpt", batching=e.batching)
        out[name] = {"plan": plan_figures(e.plan), "batching": str(e.batching),
                     "expected_step_time_s": e.mean, "predicted_step_time_s": torch_prediction(runner, steps)}
    return plain(out)


# ---- the cost models -------------------------------------------------------------------------

SHAPES = {"one image": dict(samples=1, tiles=5, tokens=3700, sum_sq=3700.0 ** 2, targets=300),
          "four mixed": dict(samples=4, tiles=14, tokens=9000, sum_sq=4.1e7, targets=1500),
          "text only": dict(samples=8, tiles=0, tokens=4096, sum_sq=2.1e6, targets=4000)}
STAGES = {"llm whole": StageSpec("llm", 28, 1, first=True, last=True),
          "llm first half tp2": StageSpec("llm", 14, 2, first=True),
          "llm last stage tp4 recompute full": StageSpec("llm", 7, 4, last=True, recompute=Recompute.FULL),
          "encoder whole": StageSpec("encoder", 27, 1, first=True, last=True),
          "encoder tp2 recompute selective": StageSpec("encoder", 27, 2, first=True, last=True,
                                                       recompute=Recompute.SELECTIVE)}
TINY_SHAPES = {"one image": dict(samples=1, tiles=2, tokens=160, sum_sq=160.0 ** 2, targets=40),
               "two mixed": dict(samples=2, tiles=3, tokens=300, sum_sq=5.2e4, targets=90)}


def stage_figures(cost: Any, stage: StageSpec, shape: dict[str, float]) -> dict[str, float]:
    c = cost.stage_cost(stage, WorkShape(**shape))
    return {k: float(getattr(c, k)) for k in ("fwd", "bwd_input", "bwd_weight", "act_bytes", "flops",
                                              "transient_bytes", "recompute_flops")}


def cost_figures() -> dict[str, Any]:
    model, hardware = presets.model(*SIM_MODEL), presets.hardware("h100")
    analytical = AnalyticalCostModel(model, hardware, TrainingSpec(global_batch=SIM_BATCH))
    tiny, cpu = presets.model("tiny-vit", "tiny-llm"), presets.hardware("cpu")
    profiled, _ = select_cost_model(tiny, cpu, TrainingSpec(global_batch=8))
    tiny_layers = {"llm": tiny.llm.layers, "encoder": tiny.encoder.layers}
    tiny_stages = {f"{m} whole tp{tp}": StageSpec(m, tiny_layers[m], tp, first=True, last=True)
                   for m in ("encoder", "llm") for tp in (1, 2)}
    unit = profiled.fsdp_unit(2)
    return {"analytical": {f"{s} / {h}": stage_figures(analytical, stage, shape)
                           for s, stage in STAGES.items() for h, shape in SHAPES.items()},
            "profiled": {"name": profiled.name,
                         **{f"{s} / {h}": stage_figures(profiled, stage, shape)
                            for s, stage in tiny_stages.items() for h, shape in TINY_SHAPES.items()},
                         "fsdp_unit(2)": None if unit is None else [list(unit(p)) for p in (1e4, 1e6)]}}


# ---- freezing and comparing ------------------------------------------------------------------

SECTIONS = {"cost": cost_figures, "pipelines": pipelines, "run": run_sim, "torch_prediction": torch_prediction_figures}


def compute(section: str, key: str | None = None) -> Any:
    if section == "optimizer":
        return plain(optimizer_setting(key))
    if section == "simulator":
        return plain(simulator_setting(key))
    return plain(SECTIONS[section]())


def everything() -> dict[str, Any]:
    out = {"optimizer": {name: compute("optimizer", name) for name in OPTIMIZER},
           "simulator": {name: compute("simulator", name) for name in SIM_PLANS}}
    out.update({section: compute(section) for section in SECTIONS})
    return out


def difference(frozen: Any, now: Any, path: str) -> str | None:
    """Where ``now`` first differs from ``frozen`` ('path: frozen X, now Y'), None where equal."""
    if isinstance(frozen, dict) and isinstance(now, dict):
        for key in sorted(frozen.keys() | now.keys()):
            if key not in now or key not in frozen:
                return f"{path}/{key}: " + ("no longer given" if key not in now else "not frozen")
            if found := difference(frozen[key], now[key], f"{path}/{key}"):
                return found
        return None
    if isinstance(frozen, list) and isinstance(now, list) and len(frozen) == len(now):
        return next((d for i, (a, b) in enumerate(zip(frozen, now)) if (d := difference(a, b, f"{path}[{i}]"))),
                    None)
    if isinstance(frozen, float) and isinstance(now, float):
        same = math.isclose(frozen, now, rel_tol=ROUNDING, abs_tol=0.0)
    else:
        same = frozen == now and type(frozen) is type(now)
    return None if same else f"{path}: frozen {frozen!r}, now {now!r}"


ROUNDING = 1e-12
"""How far apart two CPUs' kernels may round a frozen float (relative): a few units in the last place
of a double (2.2e-16 each), carried through the sums of a step."""


@lru_cache(maxsize=1)
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


def check(section: str, key: str | None = None) -> None:
    frozen = golden()[section] if key is None else golden()[section][key]
    where = section if key is None else f"{section}/{key}"
    found = difference(frozen, compute(section, key), where)
    assert found is None, f"a frozen prediction changed: {found}"


def test_every_setting_is_frozen():
    assert set(golden()) == {"optimizer", "simulator", *SECTIONS}
    assert set(golden()["optimizer"]) == set(OPTIMIZER)
    assert set(golden()["simulator"]) == set(SIM_PLANS)


def test_a_moved_figure_is_found_and_a_kernel_s_rounding_is_not():
    step = {"plans": ["a", "b"], "step_s": [0.0017828208539080632, 2.0], "bins": [1, 2]}
    assert difference(step, {**step, "step_s": [0.0017828208539080628, 2.0]}, "x") is None  # 1 ulp apart
    assert difference(step, {**step, "step_s": [0.0017828208539080632, 2.0 + 1e-9]}, "x") == (
        "x/step_s[1]: frozen 2.0, now 2.000000001")  # a nanosecond of a step
    assert difference(step, {**step, "bins": [1.0, 2.0]}, "x") is not None  # a count is compared exactly
    assert difference(step, {**step, "plans": ["b", "a"]}, "x") is not None


@pytest.mark.parametrize("name", sorted(OPTIMIZER))
def test_optimizer(name):
    check("optimizer", name)


@pytest.mark.parametrize("name", sorted(SIM_PLANS))
def test_simulator(name):
    check("simulator", name)


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_section(section):
    check(section)


if __name__ == "__main__":  # rewrite the goldens
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(everything(), indent=1) + "\n")
    sys.exit(0)
