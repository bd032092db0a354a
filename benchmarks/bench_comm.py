"""Point-to-point and all-reduce between local processes (gloo), fitted to the alpha-beta model.

Run: .venv/bin/python benchmarks/bench_comm.py [--ranks 2]

The `cpu` hardware preset prices communication between the torch backend's local
CPU processes with ``intra_node_latency`` and ``intra_node_bandwidth``; this measures
them the way the backend uses them (one thread per process, tensors of the sizes a
tiny model's activations and gradients have) and prints the fitted figures next to
the preset's, so the data in ``dflop/specs/hardware.yaml`` can be checked or replaced.
"""

from __future__ import annotations

import argparse
import time
import uuid

import numpy as np

SIZES = [2**k for k in range(10, 24, 2)]  # 1 KiB .. 8 MiB (float32 elements * 4)


def _measure(repeats: int) -> dict[str, list[tuple[int, float]]]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, list[tuple[int, float]]] = {"p2p": [], "allreduce": []}
    for nbytes in SIZES:
        t = torch.ones(nbytes // 4)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)
            times.append((time.perf_counter() - start) / 2)  # one way of a ping-pong
        out["p2p"].append((nbytes, float(np.median(times))))
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        out["allreduce"].append((nbytes, float(np.median(times))))
    dist.destroy_process_group()
    return out if rank == 0 else {}


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of t = latency + bytes / bandwidth, least squares."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    return max(float(intercept), 0.0), 1.0 / max(float(slope), 1e-15)


def main() -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from dflop.cost.comm import p2p_time, ring_allreduce_time
    from dflop.specs import presets

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.ranks, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, start_method="spawn")
    measured = elastic_launch(config, _measure)(args.repeats)[0]
    cpu = presets.hardware("cpu")
    latency, bandwidth = fit(measured["p2p"])
    print(f"gloo between {args.ranks} local processes, one thread each (median of {args.repeats})")
    print(f"{'bytes':>10} {'p2p ms':>9} {'preset':>9} {'allreduce ms':>13} {'preset':>9}")
    for (n, p2p), (_, ar) in zip(measured["p2p"], measured["allreduce"]):
        model_p2p = float(p2p_time(n, cpu.intra_node_bandwidth, cpu.intra_node_latency))
        model_ar = float(ring_allreduce_time(n, args.ranks, cpu.intra_node_bandwidth, cpu.intra_node_latency))
        print(f"{n:>10} {p2p * 1e3:9.3f} {model_p2p * 1e3:9.3f} {ar * 1e3:13.3f} {model_ar * 1e3:9.3f}")
    ar_latency, ar_bandwidth = fit([(n * 2 * (args.ranks - 1) / args.ranks, t) for n, t in measured["allreduce"]])
    print(f"fit p2p: latency {latency * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s "
          f"(preset: {cpu.intra_node_latency * 1e6:.0f} us, {cpu.intra_node_bandwidth / 1e9:.2f} GB/s)")
    print(f"fit all-reduce (ring volume): latency {ar_latency * 1e6:.0f} us for {2 * (args.ranks - 1)} steps, "
          f"bandwidth {ar_bandwidth / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
