"""Optimizer: dflop against every baseline people run, with the speedup's decomposition and MFU.

Run: .venv/bin/python benchmarks/bench_optimizer.py [--quick] [--max-seconds S]
Each setting: 8 samples per GPU, H100 nodes of 8, the analytical cost model, recomputation chosen
per plan. Step times are the optimizer's Monte-Carlo means (the same sampled batches for every plan
and rule, fast evaluator, no SimPy confirmation). Baselines: Megatron-style and PyTorch-style plan
spaces, each with arrival-order, LLaVA modality-length and token-budget batching, and Megatron-LM's own
dp_balanced packing in the Megatron-style space; "with dflop's bins"
is the strongest baseline's plan given dflop's balanced bins, which splits the speedup into a plan
gain and a balance gain; where dflop's plan runs a heterogeneous encoder phase, a layout gain over
the best plan without one comes first. The last columns time the same choices when the world's
per-sample costs are off by the analytical model's stated prediction error (lognormal, sigma 0.2).
The searches spread over one worker process per usable core (``--workers``; the plans are the same
for any number).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dflop.cost import AnalyticalCostModel, System
from dflop.cost.select import prediction_error
from dflop.plan.evaluate import PlanningProblem
from dflop.plan.report import OptimizeResult
from dflop.plan.search import optimize, usable_cores
from dflop.schedule.batching import Batching
from dflop.specs import ClusterSpec, TrainingSpec, presets
from dflop.workload import profile_mix

SETTINGS = (
    ("siglip-so400m", "qwen2.5-7b", "llava-ov", 8),
    ("siglip-so400m", "qwen2.5-7b", "llava-ov", 64),
    ("siglip-so400m", "qwen2.5-7b", "video-heavy", 256),
    ("siglip-so400m", "qwen2.5-7b", "llava-ov", 1024),
    ("siglip-so400m", "qwen2.5-7b", "llava-ov", 8192),
    ("siglip-so400m", "qwen2.5-32b", "image-heavy", 64),
    ("siglip-so400m", "qwen2.5-72b", "llava-ov", 128),
    ("internvit-6b", "qwen2.5-7b", "video-heavy", 32),
    ("internvit-6b", "qwen2.5-7b", "video-heavy", 64),
    ("internvit-6b", "qwen2.5-72b", "llava-ov", 64),
)
QUICK = SETTINGS[:2]
SHORT = {"siglip-so400m": "SigLIP", "internvit-6b": "InternViT-6B", "qwen2.5-7b": "7B", "qwen2.5-32b": "32B",
         "qwen2.5-72b": "72B"}


def problem(encoder: str, llm: str, gpus: int, mix: str) -> tuple[PlanningProblem, int]:
    model = presets.model(encoder, llm)
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus))
    batch = 8 * gpus
    training = TrainingSpec(global_batch=batch)
    data = profile_mix(mix, 20000, model.encoder, seed=0).samples
    system = System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training))
    return PlanningProblem(system, data), batch


def x(gain: float | None) -> str:
    return f"{gain:.2f}x" if gain is not None else "n/a"


def rows(name: str, r: OptimizeResult, seconds: float) -> tuple[str, str, str]:
    """The setting's row in each table: the comparison, every baseline's step time, the plans."""
    best, b = r.best, r.strongest
    mfu = float(np.mean(best.mfu))
    if b is None:
        main = f"| {name} | {best.mean:.3f} ({mfu:.0%}) | no baseline fits | | | | | | {seconds:.0f} |"
    else:
        d = r.decomposition or {"layout_gain": None, "plan_gain": None, "balance_gain": None}
        e = r.speedup_at_error() or {"speedup": None, "plan_gain": None, "balance_gain": None}  # past a deadline
        gain = f"{r.speedup:.2f}x" + (" (none)" if r.speedup < 1.005 else "")
        main = (f"| {name} | {best.mean:.3f} ({mfu:.0%}) | {b.name}: {b.best.mean:.3f} "
                f"({float(np.mean(b.best.mfu)):.0%}) | {gain} | {x(d['layout_gain'])} | {x(d['plan_gain'])} | "
                f"{x(d['balance_gain'])} | {x(e['speedup'])} ({x(e['plan_gain'])} x {x(e['balance_gain'])}) | "
                f"{seconds:.0f} |")
    cells = ["no plan" if x.best is None else f"{x.best.mean:.3f}" for x in r.baselines]
    plans = f"| {name} | {best.plan.describe()} ({best.batching}) | " + (
        f"{b.best.plan.describe()} ({b.batching})" if b else "") + " |"
    return main, f"| {name} | " + " | ".join(cells) + " |", plans


def surviving(name: str, r: OptimizeResult) -> str:
    """The speedup against the strongest of the six older baselines and against all seven, and the share
    of the gain (speedup - 1) that is left once dp_balanced joins them."""
    def speedup(baselines: list) -> float | None:
        found = [b.best.mean for b in baselines if b.best is not None]
        return min(found) / r.best.mean if found else None

    before = speedup([b for b in r.baselines if b.batching is not Batching.DP_BALANCED])
    after = speedup(r.baselines)
    if before is None or after is None:
        return f"| {name} | {x(before)} | {x(after)} | n/a |"
    kept = f"{(after - 1) / (before - 1):.0%}" if before > 1.0005 else "no gain to keep"
    return f"| {name} | {x(before)} | {x(after)} | {kept} |"


def main(quick: bool, max_seconds: float | None = None, workers: int | None = None) -> None:
    workers = workers or usable_cores()
    print(f"searches spread over {workers} worker process{'es' if workers > 1 else ''}", flush=True)
    tables: list[list[str]] = [[], [], []]
    timings: list[str] = []
    survival: list[str] = []
    reasons = []
    for encoder, llm, mix, gpus in (QUICK if quick else SETTINGS):
        p, batch = problem(encoder, llm, gpus, mix)
        sigma, _ = prediction_error(p.cost)
        start = time.perf_counter()
        r = optimize(p, batch, noise=sigma, max_seconds=max_seconds, workers=workers)
        seconds = time.perf_counter() - start
        name = f"{SHORT[encoder]} + {SHORT[llm]}, {mix}, {gpus}"
        for table, line in zip(tables, rows(name, r, seconds)):
            table.append(line)
        reasons += [f"- {name}: {b.name}: {b.reason}" for b in r.baselines if b.reason]
        print(f"{name}: {seconds:.1f} s; " + "; ".join(r.why[:2]) + (f"; {r.not_searched}" if r.not_searched else ""),
              flush=True)
        timings.append(f"| {gpus} | {name} | {seconds:.1f} |")
        survival.append(surviving(name, r))
    print("\n| setting (H100) | dflop step s (MFU) | strongest baseline: step s (MFU) | speedup | layout gain | "
          "plan gain | balance gain | at 20% error: speedup (plan x balance) | search s |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(tables[0]))
    print("\nevery baseline's best step time (s), M: Megatron-style, P: PyTorch-style space\n")
    print("| setting | M arrival | M modality | M tokens | M dp-balanced | P arrival | P modality | P tokens |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(tables[1]))
    print("\n| setting | dflop's plan (bins) | the strongest baseline's plan (bins) |")
    print("|---|---|---|")
    print("\n".join(tables[2]))
    if reasons:
        print("\nbaselines with no plan, or whose plan does not fit with dflop's bins:\n" + "\n".join(reasons))
    print("\nhow much of dflop's gain over the six older baselines survives Megatron-LM's dp_balanced\n")
    print("| setting | speedup without dp-balanced | with it | gain kept |")
    print("|---|---|---|---|")
    print("\n".join(survival))
    print(f"\nsearch time (dflop's space and the seven baselines, {workers} worker processes), by GPUs\n")
    print("| GPUs | setting | search s |")
    print("|---|---|---|")
    print("\n".join(sorted(timings, key=lambda line: int(line.split("|")[1]))))


if __name__ == "__main__":
    args = argparse.ArgumentParser()
    args.add_argument("--quick", action="store_true", help="the first two settings only")
    args.add_argument("--max-seconds", type=float, help="each search's deadline (default: none)")
    args.add_argument("--workers", type=int, help="worker processes (default: one per usable core)")
    options = args.parse_args()
    main(options.quick, options.max_seconds, options.workers)
