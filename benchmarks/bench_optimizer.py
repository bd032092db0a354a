"""Optimizer: dflop against every baseline people run, with the speedup's decomposition and MFU.

Run: .venv/bin/python benchmarks/bench_optimizer.py [--quick]
Each setting: 8 samples per GPU, H100 nodes of 8, the analytical cost model, recomputation chosen
per plan. Step times are the optimizer's Monte-Carlo means (the same sampled batches for every plan
and rule, fast evaluator, no SimPy confirmation). Baselines: Megatron-style and PyTorch-style plan
spaces, each with arrival-order, LLaVA modality-length and token-budget batching; "with dflop's bins"
is the strongest baseline's plan given dflop's balanced bins, which splits the speedup into a plan
gain and a balance gain. The last columns time the same choices when the world's per-sample costs
are off by the analytical model's stated prediction error (lognormal, sigma 0.2).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dflop.cost import AnalyticalCostModel, System
from dflop.cost.select import prediction_error
from dflop.plan.evaluate import PlanningProblem
from dflop.plan.report import OptimizeResult
from dflop.plan.search import optimize
from dflop.specs import ClusterSpec, TrainingSpec, presets
from dflop.workload import profile_mix

SETTINGS = (
    ("siglip-so400m", "qwen2.5-7b", "llava-ov", 8),
    ("siglip-so400m", "qwen2.5-7b", "llava-ov", 64),
    ("siglip-so400m", "qwen2.5-7b", "video-heavy", 256),
    ("siglip-so400m", "qwen2.5-7b", "llava-ov", 1024),
    ("siglip-so400m", "qwen2.5-32b", "image-heavy", 64),
    ("siglip-so400m", "qwen2.5-72b", "llava-ov", 128),
    ("internvit-6b", "qwen2.5-7b", "video-heavy", 32),
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


def row(name: str, r: OptimizeResult, seconds: float) -> tuple[str, str]:
    best, b = r.best, r.strongest
    mfu = float(np.mean(best.mfu))
    error = r.speedup_at_error()
    if b is None:
        main = f"| {name} | {best.mean:.3f} ({mfu:.0%}) | no baseline fits | | | | | {seconds:.0f} |"
    else:
        d = r.decomposition or {"plan_gain": float("nan"), "balance_gain": float("nan")}
        gain = "**none**" if r.speedup < 1.005 else f"{r.speedup:.2f}x"
        main = (f"| {name} | {best.mean:.3f} ({mfu:.0%}) | {b.name}: {b.best.mean:.3f} "
                f"({float(np.mean(b.best.mfu)):.0%}) | {gain} | {d['plan_gain']:.2f}x | {d['balance_gain']:.2f}x | "
                f"{error['speedup']:.2f}x ({error['plan_gain']:.2f} x {error['balance_gain']:.2f}) | {seconds:.0f} |")
    cells = []
    for base in r.baselines:
        cells.append("no plan" if base.best is None else f"{base.best.mean:.3f}")
    plans = f"| {name} | {best.plan.describe()} | " + (b.best.plan.describe() if b else "") + " |"
    return main, f"| {name} | " + " | ".join(cells) + " |\n" + plans


def main(quick: bool) -> None:
    mains, details, reasons = [], [], []
    for encoder, llm, mix, gpus in (QUICK if quick else SETTINGS):
        p, batch = problem(encoder, llm, gpus, mix)
        sigma, _ = prediction_error(p.cost)
        start = time.perf_counter()
        r = optimize(p, batch, noise=sigma)
        seconds = time.perf_counter() - start
        name = f"{SHORT[encoder]} + {SHORT[llm]}, {mix}, {gpus}"
        m, d = row(name, r, seconds)
        mains.append(m)
        details.append(d)
        reasons += [f"- {name}: {b.name}: {b.reason}" for b in r.baselines if b.best is None]
        print(f"{name}: {seconds:.0f} s; " + "; ".join(r.why[:2]), flush=True)
    print("\n| setting (H100) | dflop step s (MFU) | strongest baseline: step s (MFU) | speedup | plan gain | "
          "balance gain | at 20% error: speedup (plan x balance) | search s |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(mains))
    print("\nevery baseline's step time (s): Megatron arrival | modality-length | token-budget, then PyTorch the same;"
          " below each, dflop's plan | the strongest baseline's plan")
    print("\n| setting | M arrival | M modality | M tokens | P arrival | P modality | P tokens |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(details))
    if reasons:
        print("\nbaselines with no plan:\n" + "\n".join(reasons))


if __name__ == "__main__":
    args = argparse.ArgumentParser()
    args.add_argument("--quick", action="store_true", help="the first two settings only")
    main(args.parse_args().quick)
