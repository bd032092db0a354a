"""Hardware, cluster and training-recipe specs.

Every hardware figure (peak FLOP/s, memory, link bandwidths, the efficiency
curve) is data in a spec, loaded from ``presets/hardware.yaml`` or a user file;
no module uses a hardware constant of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from dflop.specs.limits import MAX_GLOBAL_BATCH, MAX_GPUS
from dflop.specs.loading import check_numbers, limit, require

GIB = 1024**3
BYTES = limit(0, 64)
"""Bounds of a per-parameter or per-element byte count (fp64 Adam state is 24)."""


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One accelerator model and the links around it."""

    name: str
    peak_flops: float = field(metadata=limit(1e9, 1e18))
    """Dense bf16 FLOP/s (no sparsity). The bounds (a CPU core to far beyond any accelerator)
    catch a figure given in other units, such as TFLOP/s."""
    memory_gib: float = field(metadata=limit(0.1, 1e5))
    """Device memory as the runtime reports it, in GiB."""
    reserved_fraction: float = 0.08
    """Share of memory the plan may not use (CUDA context, NCCL buffers, fragmentation)."""
    hbm_bandwidth: float = field(metadata=limit(1e6, 1e15))
    """Device-memory bandwidth, bytes/s."""
    intra_node_bandwidth: float = field(metadata=limit(1e6, 1e15))
    """Per-GPU, per-direction bandwidth to a GPU in the same node (NVLink), bytes/s."""
    inter_node_bandwidth: float = field(metadata=limit(1e6, 1e15))
    """Per-GPU bandwidth to a GPU in another node (one NIC per GPU), bytes/s."""
    intra_node_latency: float = field(default=5.0e-6, metadata=limit(0, 1))
    inter_node_latency: float = field(default=1.0e-5, metadata=limit(0, 1))
    efficiency: tuple[tuple[float, float], ...]
    """Achieved fraction of peak as a function of the FLOPs of one kernel-sized unit of work
    (one layer on one GPU): points (flops, fraction), interpolated in log(flops)."""
    comm_slowdown: float = 0.0
    """Fraction by which compute slows while a communication kernel runs beside it (NCCL's kernels
    take SMs and memory bandwidth from the GEMMs they overlap)."""
    plausible_mfu: float = 1.0
    """The highest model-FLOPs utilisation a training step plausibly reaches on this device; a
    prediction above it is flagged (the efficiency curve is an assumption until calibrated)."""
    device_names: tuple[str, ...] = ()
    """Names the runtime reports for this device (torch.cuda.get_device_name(), or 'cpu'):
    measured profiles from these devices apply to this hardware."""
    source: str = ""
    calibrated_from: str = ""
    """The measurement ``efficiency`` was refitted from (a `make gpu-check` results file); empty: the
    curve is an assumption, and its predictions carry ``UNCALIBRATED_ERROR``."""

    def __post_init__(self) -> None:
        check_numbers(self)
        require(0 <= self.reserved_fraction < 1,
                f"reserved_fraction: must be in [0, 1), got {self.reserved_fraction}")
        require(0 <= self.comm_slowdown < 1, f"comm_slowdown: must be in [0, 1), got {self.comm_slowdown}")
        require(0 < self.plausible_mfu <= 1, f"plausible_mfu: must be in (0, 1], got {self.plausible_mfu}")
        require(len(self.efficiency) >= 1, "efficiency: needs at least one (flops, fraction) point")
        xs = [p[0] for p in self.efficiency]
        require(xs[0] >= 1, f"efficiency: flops must be at least 1, got {xs[0]}")
        require(all(a < b for a, b in zip(xs, xs[1:])),
                "efficiency: flops must increase from point to point")
        require(all(0 < p[1] <= 1 for p in self.efficiency),
                "efficiency: every fraction must be in (0, 1]")
        fractions = [p[1] for p in self.efficiency]
        require(all(a <= b for a, b in zip(fractions, fractions[1:])),
                "efficiency: fractions must not decrease as work grows")
        # Time = flops / (peak * e(flops)) must still grow with flops, or more work would finish
        # sooner: with e linear in log10(flops) that holds when e > slope / ln(10) on every segment.
        for (x0, e0), (x1, e1) in zip(self.efficiency, self.efficiency[1:]):
            slope = (e1 - e0) / (np.log10(x1) - np.log10(x0))
            require(e0 > slope / np.log(10),
                    f"efficiency: rises too steeply between {x0:g} and {x1:g} FLOPs "
                    "(more work would take less time)")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * (1.0 - self.reserved_fraction)

    def achieved(self, flops: Any) -> Any:
        """Achieved fraction of peak for units of work of ``flops`` each (array-friendly)."""
        xs = np.log10([p[0] for p in self.efficiency])
        ys = np.array([p[1] for p in self.efficiency])
        return np.interp(np.log10(np.maximum(flops, 1.0)), xs, ys)

    def compute_time(self, flops: Any, unit_flops: Any | None = None) -> Any:
        """Seconds to run ``flops`` at the efficiency of units of ``unit_flops`` (default: one unit)."""
        unit = flops if unit_flops is None else unit_flops
        return np.asarray(flops, dtype=float) / (self.peak_flops * self.achieved(unit))


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Nodes of identical GPUs; GPU ``g`` sits on node ``g // gpus_per_node``."""

    hardware: HardwareSpec
    nodes: int = field(metadata=limit(1, MAX_GPUS))
    gpus_per_node: int = field(metadata=limit(1, MAX_GPUS))

    def __post_init__(self) -> None:
        check_numbers(self)
        require(self.gpus <= MAX_GPUS, f"nodes: {self.nodes} nodes of {self.gpus_per_node} GPUs are more than "
                                       f"{MAX_GPUS} GPUs")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def with_gpus(self, gpus: int) -> "ClusterSpec":
        """The same hardware with ``gpus`` GPUs (whole nodes when gpus >= gpus_per_node)."""
        per_node = min(self.gpus_per_node, gpus)
        require(gpus % per_node == 0,
                f"gpus: {gpus} is not a whole number of {per_node}-GPU nodes")
        return ClusterSpec(hardware=self.hardware, nodes=gpus // per_node, gpus_per_node=per_node)

    def resized(self, *, gpus: int | None = None, nodes: int | None = None) -> "ClusterSpec":
        """The same hardware with another GPU and/or node count (``--gpus``, ``--nodes``): nodes
        alone keep the GPUs per node, GPUs alone keep whole nodes, both set the GPUs per node."""
        if nodes is None:
            return self if gpus is None else self.with_gpus(gpus)
        if gpus is None:
            return ClusterSpec(hardware=self.hardware, nodes=nodes, gpus_per_node=self.gpus_per_node)
        require(gpus % nodes == 0, f"gpus: {gpus} GPUs do not split evenly over {nodes} nodes")
        return ClusterSpec(hardware=self.hardware, nodes=nodes, gpus_per_node=gpus // nodes)


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """What one optimizer step trains on and how state is stored.

    Byte counts default to mixed-precision Adam as accounted in the ZeRO paper
    (Rajbhandari et al., 2020): 2 (bf16 weights) + 2 (bf16 gradients) + 12
    (fp32 master weights, Adam m and v) = 16 bytes per parameter.
    """

    global_batch: int = field(metadata=limit(1, MAX_GLOBAL_BATCH))
    """Samples per optimizer step, over all data-parallel replicas."""
    weight_bytes: int = field(default=2, metadata=BYTES)
    grad_bytes: int = field(default=2, metadata=BYTES)
    optimizer_bytes: int = field(default=12, metadata=BYTES)
    activation_bytes: int = field(default=2, metadata=BYTES)
    recompute: Literal["auto", "none", "selective", "full"] = "auto"
    """Activation recomputation the planner may use: 'auto' lets it choose per plan (the least that
    fits, in every space searched); a mode fixes it for every plan of every space."""
    bucket_params: int = field(default=40_000_000, metadata=limit(1, None))
    """Parameters per gradient bucket of the data-parallel reduction (Megatron's default bucket size):
    the first bucket's reduction starts once the backward has produced it."""
    freeze_encoder: bool = False
    """The vision encoder and its projector are frozen (LLaMA-Factory's ``freeze_vision_tower`` and
    ``freeze_multi_modal_projector``, ms-swift's ``freeze_vit`` and ``freeze_aligner``, LLaVA's
    first stage for the tower): they run forward only, keep no activations, no gradients and no
    optimizer state, and nothing of theirs is reduced over data parallelism."""

    def __post_init__(self) -> None:
        check_numbers(self)
