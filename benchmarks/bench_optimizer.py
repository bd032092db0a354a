"""Optimizer: search time by cluster size, pruning, and what dflop gains over the best baseline.

Run: .venv/bin/python benchmarks/bench_optimizer.py [--quick]
Global batch: 8 samples per GPU, llava-ov mix, H100 nodes of 8, full recomputation.
Step times come from the optimizer's Monte-Carlo evaluation (same batches for every plan).
"""

from __future__ import annotations

import argparse
import time

from dflop.cost import AnalyticalCostModel, System
from dflop.plan.evaluate import PlanningProblem
from dflop.plan.search import optimize
from dflop.specs import ClusterSpec, TrainingSpec, presets
from dflop.workload import profile_mix


def problem(encoder: str, llm: str, gpus: int, mix: str = "llava-ov") -> tuple[PlanningProblem, int]:
    model = presets.model(encoder, llm)
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus))
    batch = 8 * gpus
    training = TrainingSpec(global_batch=batch, recompute="full")
    data = profile_mix(mix, 20000, model.encoder, seed=0).samples
    system = System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training))
    return PlanningProblem(system, data), batch


def search_times(sizes: tuple[int, ...]) -> None:
    print("search time (SigLIP-so400m + Qwen2.5-7B, llava-ov); targets: < 2 s at 8 GPUs, < 60 s at 1024")
    for gpus in sizes:
        p, batch = problem("siglip-so400m", "qwen2.5-7b", gpus)
        start = time.perf_counter()
        result = optimize(p, batch)
        seconds = time.perf_counter() - start
        s = result.stats["dflop"]
        print(f"  {gpus:>5} GPUs: {seconds:6.1f} s; dflop plans enumerated {s.enumerated}, too big {s.pruned_memory}, "
              f"bounded out {s.pruned_bound}, GPU splits skipped {s.pruned_splits}, beyond the budget "
              f"{s.not_evaluated}, evaluated {s.evaluated} ({s.batches} batch evaluations); "
              f"speedup {result.speedup:.2f}x")


def model_pairs(gpus: int) -> None:
    print(f"\n{gpus} H100s, llava-ov: dflop vs the best data-blind baseline, and the ideal bound "
          "(all compute spread evenly at the hardware's efficiency)")
    for encoder, llm in (("siglip-so400m", "qwen2.5-7b"), ("siglip-so400m", "qwen2.5-32b"),
                         ("siglip-so400m", "qwen2.5-72b"), ("internvit-6b", "qwen2.5-72b")):
        p, batch = problem(encoder, llm, gpus)
        r = optimize(p, batch)
        b = r.baseline
        space = next(k for k, v in r.baselines.items() if v is b)
        print(f"  {encoder} + {llm}:")
        print(f"    dflop    {r.best.mean:7.3f} s  bubble {sum(r.best.bubble) / r.best.n:6.1%}  idle "
              f"{sum(r.best.idle) / r.best.n:6.1%}  [{r.best.plan.describe()}]")
        print(f"    baseline {b.mean:7.3f} s  bubble {sum(b.bubble) / b.n:6.1%}  idle {sum(b.idle) / b.n:6.1%}  "
              f"[{space}: {b.plan.describe()}]")
        print(f"    speedup {r.speedup:.2f}x; dflop at {r.ideal_s / r.best.mean:.0%} of the ideal "
              f"{r.ideal_s:.3f} s (baseline at {r.ideal_s / b.mean:.0%})")


if __name__ == "__main__":
    args = argparse.ArgumentParser()
    args.add_argument("--quick", action="store_true", help="8 and 64 GPUs only")
    quick = args.parse_args().quick
    search_times((8, 64) if quick else (8, 64, 256, 1024))
    model_pairs(64)
