"""Communication times from link bandwidth and latency (alpha-beta model).

A collective's bandwidth depends on where its GPUs are: inside one node it runs
over NVLink; across nodes, NCCL runs one ring per NIC, so a group with g GPUs in
each of its nodes moves g times one NIC's bandwidth between nodes (and never
more than NVLink carries), at the network's latency.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import numpy as np

from dflop.specs.hardware import ClusterSpec


def p2p_time(nbytes: Any, bandwidth: float, latency: float) -> Any:
    """One point-to-point transfer; nothing to send costs nothing."""
    nbytes = np.asarray(nbytes, dtype=float)
    return np.where(nbytes > 0, latency + nbytes / bandwidth, 0.0)


def ring_allreduce_time(nbytes: Any, ranks: int, bandwidth: float, latency: float) -> Any:
    """Ring all-reduce of ``nbytes`` per rank: 2(n-1)/n of the data crosses each link, in
    2(n-1) latency-bound steps. Reduce-scatter plus all-gather (sequence parallelism,
    ZeRO) moves the same volume."""
    if ranks <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=float))
    nbytes = np.asarray(nbytes, dtype=float)
    volume = 2.0 * (ranks - 1) / ranks * nbytes / bandwidth
    return np.where(nbytes > 0, volume + 2.0 * (ranks - 1) * latency, 0.0)


def allgather_time(nbytes: Any, ranks: int, bandwidth: float, latency: float) -> Any:
    """Ring all-gather (or reduce-scatter) producing ``nbytes`` per rank: half an all-reduce."""
    return 0.5 * ring_allreduce_time(nbytes, ranks, bandwidth, latency)


def reduce_scatter_time(nbytes: Any, ranks: int, bandwidth: float, latency: float) -> Any:
    """Ring reduce-scatter of ``nbytes`` per rank (each rank keeps 1/ranks of the reduced data)."""
    return allgather_time(nbytes, ranks, bandwidth, latency)


def collective_link(cluster: ClusterSpec, gpus: Sequence[int]) -> tuple[float, float]:
    """(bandwidth per rank, latency) of a ring collective over ``gpus``."""
    hw = cluster.hardware
    per_node = Counter(cluster.node_of(g) for g in gpus)
    if len(per_node) <= 1:
        return hw.intra_node_bandwidth, hw.intra_node_latency
    return min(hw.intra_node_bandwidth, min(per_node.values()) * hw.inter_node_bandwidth), hw.inter_node_latency
