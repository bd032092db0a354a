"""How a real run executes (the torch backend): device, precision, optimizer, timeouts, checkpoints.

The plan says what runs where; this says how the processes run it. A run
config holds it under ``execution:``; the simulator ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from dflop.specs.limits import MAX_SECONDS, MAX_STEPS
from dflop.specs.loading import check_numbers, limit, require


MIN_TIMEOUT_S = 10.0
"""The shortest timeout_s: the ranks join their process group within it, and processes started
together still import torch seconds apart on a busy machine; below it a run fails to form."""

MAX_DECODE_WORKERS = 64
"""The most decoding processes a rank starts (``decode_workers``)."""

CPU_THREADS = 1
"""Torch threads per CPU rank, and per process of a CPU profile that prices one: ranks of more
threads than their share of the cores slow each other unpredictably."""


class Device(str, Enum):
    CPU = "cpu"
    """One process per simulated GPU, gloo, one thread each."""
    CUDA = "cuda"
    """One process per GPU, NCCL."""

    def __str__(self) -> str:
        return self.value


class DType(str, Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT64 = "float64"
    """For checking a distributed run against the sequential one without rounding noise."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class ExecutionSpec:
    device: Device = Device.CPU
    dtype: DType = DType.FLOAT32
    lr: float = field(default=1e-3, metadata=limit(high=1.0))
    """AdamW learning rate."""
    adam_eps: float = field(default=1e-8, metadata=limit(high=1.0))
    """AdamW's epsilon (Megatron's ``--adam-eps``): the floor under each gradient's running magnitude."""
    weight_decay: float = field(default=0.0, metadata=limit(0, 1.0))
    timeout_s: float = field(default=120.0, metadata=limit(MIN_TIMEOUT_S, MAX_SECONDS))
    """Point-to-point and collective timeout: a lost peer fails the run after this at the latest."""
    checkpoint_every: int = field(default=0, metadata=limit(0, MAX_STEPS))
    """Save a checkpoint (torch.distributed.checkpoint) every this many steps; 0: never."""
    init_from: str = ""
    """A checkpoint another run saved (``checkpoint_every``) to start this run from: its step folder
    (``.../step-NNNNNN``), a folder of them (its newest complete one) or a run's output folder (its
    dflop arm's newest). The run begins at the checkpoint's step with its weights and optimizer
    states, resharded onto this run's plan (Megatron's ``--load``, torchtitan's ``initial_load_path``);
    empty: from the seed. Relative to the config's folder."""
    decode_workers: int | None = field(default=None, metadata=limit(0, MAX_DECODE_WORKERS))
    """Processes per rank (torch DataLoader workers) that decode its real images and videos, up to 2
    steps a worker ahead of the step running, off its critical path; 0: the rank decodes them itself,
    at each step's turn, before the step. None: 2 on GPUs, whose ranks leave CPU cores free; 0 on
    CPU, whose ranks are the cores (a worker would take a rank's time)."""
    calibrate: bool = True
    """Before the first step, measure a few of the profile's shapes here and scale the run's reported
    predictions by what they ran at (``dflop.cost.calibration``): a profile measured on another machine
    prices every step off by the ratio between the two."""
    warmup: bool = True
    """Before the first timed step, run the heaviest step's graph once on every rank, untimed and
    without an update (torchtitan's and Megatron's benchmarks skip their first iterations alike): a
    fresh process's first steps fault in its memory, which a long run pays once and a profile's
    measurement, warmed up, does not price."""

    def __post_init__(self) -> None:
        check_numbers(self)
        for name, kind in (("device", Device), ("dtype", DType)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                names = ", ".join(m.value for m in kind)
                require(value in [m.value for m in kind], f"{name}: {value!r} is not one of {names}")
                object.__setattr__(self, name, kind(value))
        require(self.decode_workers is None or type(self.decode_workers) is int,
                f"decode_workers: expected a whole number of processes, got {self.decode_workers!r}")
        require(self.lr > 0, f"lr: must be positive, got {self.lr}")
        require(self.adam_eps > 0, f"adam_eps: must be positive, got {self.adam_eps}")

    @property
    def decoders(self) -> int:
        """``decode_workers``, its default resolved for the device."""
        if self.decode_workers is not None:
            return self.decode_workers
        return 2 if self.device is Device.CUDA else 0
