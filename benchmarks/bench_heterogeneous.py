"""Heterogeneous encoder phase against the encoder inside LLM stage 0, in the simulator.

Run: .venv/bin/python benchmarks/bench_heterogeneous.py
Each setting: the optimizer's plan and strongest baseline (as in bench_optimizer: 8 samples per GPU,
H100 nodes of 8, the analytical cost model); then the same LLM layout with the encoder on every GPU
with its own tp and dp (heterogeneous placement, ZeRO at most 1, the plan's recomputation or full
where that does not fit), every encoder tp that fits. All plans are timed by the fast evaluator on
the same sampled batches with dflop's balanced bins (the baseline with its own rule). The optimizer
searches heterogeneous plans too (its layout gain: bench_optimizer); this table shows, where it
chooses none, how far the best of them with its LLM layout is from its choice, and why.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from bench_optimizer import SHORT, problem
from dflop.plan.evaluate import BatchPool, Estimate, Evaluator
from dflop.plan.search import optimize
from dflop.schedule.batching import Batching
from dflop.specs import GIB, ModulePlan
from dflop.specs.plan import Placement, Plan, Recompute

SETTINGS = (
    ("siglip-so400m", "qwen2.5-7b", "llava-ov", 64),
    ("internvit-6b", "qwen2.5-7b", "video-heavy", 32),
    ("internvit-6b", "qwen2.5-7b", "video-heavy", 64),
    ("siglip-so400m", "qwen2.5-72b", "llava-ov", 128),
)
BATCHES = 8


def variants(plan: Plan) -> list[Plan]:
    """Heterogeneous plans with ``plan``'s LLM layout: every encoder tp, the plan's recomputation and full."""
    gpus = plan.llm.gpus
    out = []
    for tp in (1, 2, 4, 8):
        for recompute in dict.fromkeys((plan.recompute, Recompute.FULL)):
            if gpus % tp == 0:
                out.append(replace(plan, encoder=ModulePlan(tp=tp, dp=gpus // tp), placement=Placement.HETEROGENEOUS,
                                   zero=min(plan.zero, 1), hsdp=False, recompute=recompute))
    return out


def shown(plan: Plan) -> str:
    """The plan in one table cell (its description separates parts with bars)."""
    return plan.describe().replace(" | ", "; ")


def timed(evaluator: Evaluator, plan: Plan, batching: Batching) -> tuple[Estimate, bool]:
    """The plan's estimate, and whether it fits (memory, and bins within their caps)."""
    estimate = evaluator.extend(Estimate(plan, batching, 0.0), BATCHES)
    return estimate, estimate.peak_memory <= evaluator.p.cluster.hardware.usable_memory_bytes and not estimate.infeasible


def main() -> None:
    rows = []
    for encoder, llm, mix, gpus in SETTINGS:
        p, batch = problem(encoder, llm, gpus, mix)
        start = time.perf_counter()
        r = optimize(p, batch)
        evaluator = Evaluator(p, BatchPool(p.data, batch, seed=1))
        mine, _ = timed(evaluator, r.best.plan, Batching.BALANCED)
        theirs = timed(evaluator, r.strongest.best.plan, r.strongest.batching)[0] if r.strongest else None
        tried = [timed(evaluator, plan, Batching.BALANCED) for plan in variants(r.best.plan)
                 if not plan.problems(p.cluster, p.model, batch)]
        found = [e for e, fits in tried if fits]
        name = f"{SHORT[encoder]} + {SHORT[llm]}, {mix}, {gpus}"
        print(f"{name}: {time.perf_counter() - start:.1f} s; {len(found)} of {len(tried)} heterogeneous plans fit",
              flush=True)
        if not found:
            least = min((e.peak_memory for e, _ in tried), default=float("nan")) / GIB
            usable = p.cluster.hardware.usable_memory_bytes / GIB
            rows.append(f"| {name} | {mine.mean:.3f} ({float(np.mean(mine.mfu)):.0%}) | none fits ({len(tried)} "
                        f"tried, least peak {least:.0f} of {usable:.0f} GiB) | | | | {shown(r.best.plan)} | |")
            continue
        best = min(found, key=lambda e: e.mean)
        gain = mine.mean / best.mean
        base = f"{theirs.mean:.3f}" if theirs else "none fits"
        over = f"{theirs.mean / best.mean:.2f}x" if theirs else "n/a"
        rows.append(f"| {name} | {mine.mean:.3f} ({float(np.mean(mine.mfu)):.0%}) | "
                    f"{best.mean:.3f} ({float(np.mean(best.mfu)):.0%}) | "
                    f"{gain:.2f}x" + (" (none)" if gain < 1.005 else "") + f" | {base} | {over} | "
                    f"{shown(r.best.plan)} | {shown(best.plan)} |")
    print(f"\nstep s (MFU), mean of {BATCHES} batches, fast evaluator, H100; layout gain: dflop's plan over the best "
          "heterogeneous plan with its LLM layout\n")
    print("| setting | dflop's plan | best heterogeneous | layout gain | strongest baseline | heterogeneous over it "
          "| dflop's plan | heterogeneous plan |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
