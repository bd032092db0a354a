"""The model profiler: one block's forward and backward time and memory over a grid of shapes.

Per module it measures a transformer block (encoder: by tiles; LLM: by packed
tokens and by per-sample length, so attention's quadratic part separates from
the linear part) and the fixed parts (patch embedding and projector; token
embedding and LM head with the loss), each with warm-up and repeats, keeping
the median and the spread (p90 - p10 over the median).

Time: on CUDA, CUDA events; on CPU, wall time. Memory: on CUDA, the
allocator's peak during forward above what was allocated before; on CPU, the
bytes of the distinct tensors autograd keeps for backward, parameters
excluded: the activation memory one microbatch holds until its backward.

Measured "the way the backend runs": with ``processes`` > 1, as many processes
measure the very same shapes in lock-step (a barrier before every shape) and
only the first one records, so every figure carries the slowdown of ranks that
share the machine's cores, caches and memory bandwidth, as the backend's
one-process-per-core ranks do (a rank alone on the machine runs faster than one
beside a busy peer, so a profile of one process would price the backend's steps
short). Each record says how many processes measured it.
On CPU every process is set up as the backend's ranks are
(``dflop.backends.torch_runtime.cpu_process``): ``CPU_THREADS`` torch threads whatever the environment
says (threads that outnumber the cores wait on each other erratically), and
freed memory kept in the process rather than handed back to the system and
faulted in again on the next repeat. Records say both.

Tensor parallelism with ``processes`` > 1 runs in real TP groups: the
processes split into gloo groups of ``tp``, each block is split with torch's
tensor-parallel API exactly as the backend splits it (``dflop.models.parallel``)
and the fixed parts stay replicated, as the backend keeps them. Such records say
``tp_comm: measured``: the collectives, and DTensor's dispatch around them, are
in the figures (DTensor's backward all-reduces the input gradient of each of
q, k, v, gate and up apart, more than the two collectives per direction a
Megatron model prices), and the cost model adds none of its own. Alone
(``processes`` 1, and on a GPU) a TP degree is measured as one shard of the
block and its collectives are modelled (``tp_comm: modelled``).

With ``fsdp`` (lock-step processes only) it also measures what FSDP2 adds to a
unit, the way the backend runs ZeRO-2/3 (``dflop.models.parallel.shard_unit``
over a data-parallel group of all the processes): per unit (the block, and each
fixed part) the time its forward (``fwd_ms``: the weights' all-gather) and its
backward (``bwd_ms``: the gradients' reduce-scatter) take beyond the same unit
unsharded, phase ``fsdp_unit``, shape ``params`` and ``shards``. On gloo that is
several times what the collectives' bytes cost at the fitted bandwidth (FSDP2's
hooks, copy-in and copy-out), and on a CPU whose cores all compute it hides
behind nothing; the cost model prices a sharded plan's units from these
(``ProfiledCostModel.fsdp_unit``).

Every record is appended to the store as soon as it is measured; shapes
already in the store are skipped, so an interrupted run resumes where it
stopped. A few shapes between grid points are measured too and marked
``holdout``: the profiled cost model never fits on them and reports its error
on them.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import platform
import statistics
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dflop.cost.profiled import off_their_neighbours
from dflop.cost.store import FSDP_UNIT, ProfileStore, TPComm, architecture, record_key, tp_comm_of
from dflop.backends.torch_runtime.cpu_process import set_up_cpu_process, start_method
from dflop.errors import DflopError
from dflop.models.llm import DecoderBlock, RMSNorm, pack, shard, wide
from dflop.models.parallel import shard_unit, split_blocks
from dflop.models.vit import PatchEmbed, Projector, VisionBlock
from dflop.specs import presets
from dflop.specs.models import EncoderSpec, LLMSpec, MLLMSpec
from dflop.specs.plan import Module
from dflop.specs.progress import Progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIN_SAMPLE_MS = {"cpu": 20.0, "cuda": 1.0}
REPEATS = {"cpu": 7, "cuda": 20}
"""Timed repeats per shape unless told otherwise."""
WARMUP = 2
UNIT_REPEATS = 3
"""An FSDP2 unit's collectives are timed this many times the repeats of a shape."""
PROBES = 2
"""Runs before the warm-up whose times are not recorded: a cold one, which also measures the
activation memory, and a warm one that sizes the inner loop."""


@dataclass(frozen=True)
class Grid:
    tokens: tuple[int, ...]
    seq: tuple[int, ...]
    """Per-sample lengths the tokens are packed into."""
    tiles: tuple[int, ...]
    holdout_llm: tuple[tuple[int, int], ...]
    holdout_tiles: tuple[int, ...]


GRIDS = {
    "cpu": Grid(tokens=(128, 256, 512, 1024, 2048, 4096, 8192, 16384), seq=(64, 256, 1024, 4096),
                tiles=(1, 2, 4, 8, 16, 32, 64, 128, 256), holdout_llm=((384, 128), (1536, 512), (6144, 2048)),
                holdout_tiles=(3, 12, 48)),
    "gpu": Grid(tokens=(1024, 2048, 4096, 8192, 16384, 32768), seq=(512, 2048, 8192), tiles=(1, 4, 8, 16, 32, 64),
                holdout_llm=((3072, 1024), (6144, 2048), (12288, 4096)), holdout_tiles=(6, 12, 24)),
    "quick": Grid(tokens=(64, 256), seq=(64, 256), tiles=(1, 4), holdout_llm=((128, 64),), holdout_tiles=(2,)),
}


def resolve(name: str) -> tuple[Module, EncoderSpec | LLMSpec]:
    key = name.strip().lower()
    if key in presets.names("encoders"):
        return Module.ENCODER, presets.encoder(key)
    if key in presets.names("llms"):
        return Module.LLM, presets.llm(key)
    known = presets.names("encoders") + presets.names("llms")
    raise DflopError(f"unknown model '{name}' (known: {', '.join(known)})")


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def machine_identity(device: str, threads: int) -> dict[str, Any]:
    """Where shapes are measured, as plain data (``dflop.cost.store.MACHINE_FIELDS``): the same
    shapes run at another speed on another CPU model or instruction set (the ATen kernels torch
    picked), core count, memory, torch or Python, or on another GPU, clock, driver, CUDA or NCCL; a
    profile records it so that a machine that uses the profile can say where it differs.
    ``threads``: torch threads per measuring process. Taken once per profiling session."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    identity: dict[str, Any] = {"cpu": _cpu_model() or platform.processor() or platform.machine(),
                                "capability": torch.backends.cpu.get_cpu_capability(), "cores": cores,
                                "threads": threads, "memory_gib": _memory_gib(),
                                "torch": torch.__version__, "python": platform.python_version()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        identity |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                     "driver": _nvidia_driver(), "cuda": torch.version.cuda,
                     "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                     **gpu_clocks(str(props.uuid))}
    return identity


def _cpu_model() -> str | None:
    """The CPU's model name (Linux: /proc/cpuinfo), None where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "Processor"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _memory_gib() -> float | None:
    """Total memory in GiB (to a tenth), None where the OS does not say."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _nvml() -> Any:
    """NVML (``pynvml``, from ``nvidia-ml-py`` in the ``gpu`` extra), initialised; None where it is
    not installed or finds no driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no NVML, no driver: the identity says nothing of what it would read
        return None


def gpu_clocks(uuid: str) -> dict[str, int]:
    """The highest SM and memory clocks in MHz of the GPU with CUDA's ``uuid`` (looked up by it: NVML
    numbers cards in PCI order, whatever ``CUDA_VISIBLE_DEVICES`` says), {} where NVML cannot say.
    One GPU name comes at more than one clock (board power, OEM variants), each its own speed."""
    nvml = _nvml()
    if nvml is None:
        return {}
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        return {"sm_clock_mhz": int(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)),
                "memory_clock_mhz": int(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM))}
    except Exception:  # a card that does not report them
        return {}


def _nvidia_driver() -> str | None:
    """The NVIDIA driver's version (from NVML, where it is installed), None otherwise."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        version = nvml.nvmlSystemGetDriverVersion()
    except Exception:
        return None
    return version.decode() if isinstance(version, bytes) else version


def require_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise DflopError("--device cuda: this machine has no CUDA device (use --device cpu)")


def check_device(device: str, dtype: str) -> torch.dtype:
    require_device(device)
    if dtype not in DTYPES:
        raise DflopError(f"--dtype {dtype}: unknown (known: {', '.join(DTYPES)})")
    if device == "cpu" and dtype == "float16":
        raise DflopError("--dtype float16 is not supported for training on cpu (use float32 or bfloat16)")
    if device == "cuda" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise DflopError("--dtype bfloat16: this GPU has no bfloat16 support (use float16 or float32)")
    return DTYPES[dtype]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@contextmanager
def saved_bytes(module: nn.Module) -> Iterator[list[int]]:
    """Bytes of the distinct storages autograd saves while in this context (parameters excluded)."""
    params = {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        yield total


def packed_lengths(tokens: int, seq: int) -> list[int]:
    """The sample lengths of a profiled LLM block shape: ``tokens`` packed as samples of ``seq``, the
    last one shorter when ``seq`` does not divide ``tokens``."""
    return [seq] * (tokens // seq) + ([tokens % seq] if tokens % seq else [])


class Timer:
    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), out
        begin = time.perf_counter_ns()
        out = fn()
        return (time.perf_counter_ns() - begin) / 1e6, out


def _spread(values: list[float]) -> float:
    ordered = sorted(values)
    lo, hi = ordered[int(0.1 * (len(ordered) - 1))], ordered[int(round(0.9 * (len(ordered) - 1)))]
    return (hi - lo) / statistics.median(values)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out if out.dim() == 0 else out.float().pow(2).mean()


def measure(module: nn.Module, make_inputs: Callable[[], tuple], device: str, warmup: int,
            repeats: int, group: Any = None) -> dict[str, float]:
    """Median forward and backward ms, their spread, and the activation bytes of one forward.

    Fast ops run ``inner`` times inside each timed sample (enough for MIN_SAMPLE_MS), so that
    timer resolution and scheduling noise do not dominate sub-millisecond measurements; ``inner``
    comes from a second, warm forward (the first one sets up DTensor's dispatch and runs several
    times slower, which would leave one run per sample and gloo's jitter in the median).
    The ranks of a TP ``group`` agree on ``inner`` (the largest), as they must run the same collectives."""
    timer = Timer(device)
    inputs = make_inputs()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _, out = timer(lambda: module(*inputs))
        memory = float(torch.cuda.max_memory_allocated() - before)
    else:
        with saved_bytes(module) as saved:
            _, out = timer(lambda: module(*inputs))
        memory = float(saved[0])
    _loss(out).backward()
    once, out = timer(lambda: module(*inputs))
    _loss(out).backward()
    inner = _inner(once, device, group)
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        batches = [make_inputs() for _ in range(inner)]
        t_fwd, outs = timer(lambda: [module(*x) for x in batches])
        losses = [_loss(o) for o in outs]
        t_bwd, _ = timer(lambda: [loss.backward() for loss in losses])
        module.zero_grad(set_to_none=True)
        if i >= warmup:
            fwd.append(t_fwd / inner)
            bwd.append(t_bwd / inner)
    return {"fwd_ms": statistics.median(fwd), "bwd_ms": statistics.median(bwd),
            "fwd_spread": _spread(fwd), "bwd_spread": _spread(bwd), "memory_bytes": memory,
            "inner": inner}


def _inner(once_ms: float, device: str, group: Any) -> int:
    """Runs per timed sample for an op of ``once_ms``: enough for MIN_SAMPLE_MS; the ranks of a
    ``group`` agree on the largest, as they must run the same collectives."""
    inner = max(1, math.ceil(MIN_SAMPLE_MS[device] / max(once_ms, 1e-3)))
    if group is None:
        return inner
    agreed = torch.tensor([inner])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return int(agreed.item())


def measure_fsdp_unit(pair: nn.ModuleDict, make_inputs: Callable[[], tuple], device: str, warmup: int,
                      repeats: int, group: Any) -> dict[str, float]:
    """What FSDP2 adds to one unit's forward and backward, as the backend runs ZeRO-2: the median
    forward and backward of ``pair["sharded"]`` (``shard_unit``'d over ``group``, kept gathered from
    its forward to its backward, resharded after it) less those of ``pair["plain"]``, the same unit
    unsharded, the two taking turns so that a drifting machine slows both alike. The forward's share
    is the weights' all-gather, the backward's the gradients' reduce-scatter and the release; both
    hold FSDP2's hooks and copies. Every microbatch runs both, one forward then one backward, as
    timed here. The ranks of ``group`` agree on the inner loop, as in ``measure``."""
    timer = Timer(device)

    def run(module: nn.Module, inner: int) -> tuple[float, float]:
        fwd = bwd = 0.0
        for _ in range(inner):
            inputs = make_inputs()
            t_fwd, out = timer(lambda: module(*inputs))
            loss = _loss(out)
            t_bwd, _ = timer(loss.backward)
            fwd, bwd = fwd + t_fwd, bwd + t_bwd
        module.zero_grad(set_to_none=True)
        return fwd / inner, bwd / inner

    for module in pair.values():  # the root's lazy initialisation, then a warm one
        run(module, 1)
    inner = _inner(sum(run(pair["plain"], 1)) + sum(run(pair["sharded"], 1)), device, group)
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "sharded": []}
    for i in range(warmup + UNIT_REPEATS * repeats):  # a few ms each: cheap, and noisier than compute
        for name in ("plain", "sharded") if i % 2 else ("sharded", "plain"):
            figures = run(pair[name], inner)
            if i >= warmup:
                times[name].append(figures)
    median = {name: [statistics.median(t[k] for t in rows) for k in (0, 1)] for name, rows in times.items()}
    return {"fwd_ms": max(median["sharded"][0] - median["plain"][0], 0.0),
            "bwd_ms": max(median["sharded"][1] - median["plain"][1], 0.0),
            "fwd_spread": _spread([t[0] for t in times["sharded"]]),
            "bwd_spread": _spread([t[1] for t in times["sharded"]]),
            "memory_bytes": 0.0, "inner": inner}


class _Head(nn.Module):
    """Final norm, LM head and the loss: what the last LLM stage adds."""

    def __init__(self, spec: LLMSpec, tp: int) -> None:
        super().__init__()
        self.norm = RMSNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, shard(spec.vocab, tp, "vocabulary entries"), bias=False)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(wide(self.head(self.norm(x))), target)


def jobs(kind: Module, spec: EncoderSpec | LLMSpec, pair: MLLMSpec, tp: int, grid: Grid, dtype: torch.dtype,
         device: str, mesh: Any = None) -> Iterator[tuple[str, dict[str, int], bool, Callable[[], nn.Module],
                                                         Callable[[], tuple]]]:
    """(phase, shape, holdout, module factory, input factory) of everything to measure.

    With a TP ``mesh`` the blocks are whole and split over it, and the fixed parts whole (the
    backend's modules); without one, a TP degree's modules are one shard, as wide as a rank's.
    Shapes come in order of size, held-out ones among their neighbours, so that a machine
    whose speed drifts during the run biases the held-out error as little as it can."""
    opts = {"dtype": dtype, "device": device}
    width = 1 if mesh is not None else tp
    """The TP degree a module is built for: its shard's width."""

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, **opts, requires_grad=True)

    def block(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        if mesh is None:
            return make

        def split() -> nn.Module:
            module = make()
            split_blocks([module], mesh)
            return module
        return split

    if kind == Module.LLM:
        h, vocab = spec.hidden, shard(spec.vocab, width, "vocabulary entries")
        shapes = [(t, s, False) for t in grid.tokens for s in grid.seq if s <= t]
        shapes = sorted(shapes + [(t, s, True) for t, s in grid.holdout_llm])
        for tokens, seq, holdout in shapes:
            positions, cu = pack(packed_lengths(tokens, seq), device)
            yield ("block", {"tokens": tokens, "seq": seq}, holdout,
                   block(lambda: DecoderBlock(spec, width).to(**opts)),
                   lambda t=tokens, p=positions, c=cu: (tensor(t, h), p, c))
        for tokens in sorted({t for t, _, _ in shapes}):
            holdout = tokens not in grid.tokens
            yield ("embed", {"tokens": tokens}, holdout, lambda: nn.Embedding(vocab, h).to(**opts),
                   lambda t=tokens: (torch.randint(0, vocab, (t,), device=device),))
            yield ("head", {"tokens": tokens}, holdout, lambda: _Head(spec, width).to(**opts),
                   lambda t=tokens: (tensor(t, h), torch.randint(0, vocab, (t,), device=device)))
        return
    side = spec.image_size // spec.patch_size
    shapes = sorted([(t, False) for t in grid.tiles] + [(t, True) for t in grid.holdout_tiles])
    for tiles, holdout in shapes:
        yield ("block", {"tiles": tiles}, holdout, block(lambda: VisionBlock(spec, width).to(**opts)),
               lambda n=tiles: (tensor(n, side * side, spec.hidden),))
        yield ("embed", {"tiles": tiles}, holdout, lambda: PatchEmbed(spec).to(**opts),  # pixels take no gradient
               lambda n=tiles: (torch.randn(n, 3, spec.image_size, spec.image_size, **opts),))
        yield ("projector", {"tiles": tiles}, holdout, lambda: Projector(pair).to(**opts),
               lambda n=tiles: (tensor(n, side * side, spec.hidden),))


def fsdp_jobs(kind: Module, spec: EncoderSpec | LLMSpec, pair: MLLMSpec, grid: Grid, dtype: torch.dtype, device: str,
              shards: int, mesh: Any = None) -> Iterator[tuple[str, dict[str, int], bool, Callable[[], nn.Module],
                                                                Callable[[], tuple]]]:
    """Every FSDP2 unit to measure over ``shards`` processes (``mesh``, when measuring): the block and
    each fixed part, whole, on the grid's smallest inputs (the collectives do not depend on them, and
    the compute they are told apart from had better be small)."""
    parts = {}
    for phase, _, holdout, make_module, make_inputs in jobs(kind, spec, pair, 1, grid, dtype, device):
        if not holdout and phase not in parts:
            parts[phase] = (make_module, make_inputs)
    params: dict[str, int] = {}
    with torch.device("meta"):  # counted without allocating (a real-size block on a CPU)
        for phase, _, _, make, _ in jobs(kind, spec, pair, 1, grid, dtype, "meta"):
            if phase not in params:
                params[phase] = sum(p.numel() for p in make().parameters())
    for phase, (make_module, make_inputs) in parts.items():
        def unit(make: Callable[[], nn.Module] = make_module) -> nn.ModuleDict:
            pair = nn.ModuleDict({"plain": make(), "sharded": make()})
            shard_unit(pair["sharded"], mesh, reshard_after_forward=False)
            return pair
        yield FSDP_UNIT, {"params": params[phase], "shards": shards}, False, unit, make_inputs


def default_llm(encoder: str) -> str:
    return "tiny-llm" if encoder.startswith("tiny") else "qwen2.5-7b"


@dataclass
class ProfileReport:
    measured: int
    reused: int
    store: Path
    again: list[dict[str, Any]] = field(default_factory=list)
    """Shapes measured a second time, being off their neighbours the first."""


@dataclass(frozen=True)
class Request:
    """A `profile model` request with every option checked, before anything is said or measured."""

    kind: Module
    spec: EncoderSpec | LLMSpec
    pair: MLLMSpec | None
    dtype: str
    torch_dtype: torch.dtype
    grid: Grid
    store: ProfileStore
    fsdp: int
    """Processes FSDP2's units are measured over (0: not measured)."""


def check_request(name: str, out: str | Path, *, device: str = "cpu", dtype: str | None = None,
                  grid: str | Grid | None = None, llm: str | None = None, processes: int = 1,
                  tps: tuple[int, ...] = (1,), fsdp: bool = False) -> Request:
    """``grid``: a grid's name, or the shapes themselves (a drift check measures a few stored ones)."""
    if fsdp and processes < 2:
        raise DflopError("--fsdp: FSDP2's collectives are measured in a real data-parallel group of lock-step "
                         "processes; give --processes 2 or more")
    if processes > 1 and device != "cpu":
        raise DflopError(f"--processes {processes}: lock-step processes share one device only on cpu; on cuda "
                         "every rank has its own GPU (use --processes 1)")
    for tp in tps:
        if processes > 1 and tp > 1 and processes % tp:
            raise DflopError(f"--tp {tp}: lock-step processes run TP {tp} in real groups of {tp}, so --processes "
                             f"must be a multiple of it (got {processes})")
    kind, spec = resolve(name)
    pair = None
    if kind == Module.ENCODER:
        pair = MLLMSpec(encoder=spec, llm=presets.llm(llm or default_llm(spec.name), where="--llm"))
    elif llm is not None:
        raise DflopError(f"--llm {llm}: applies only when profiling an encoder (it sets the projector's "
                         f"output width); {spec.name} is an LLM")
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    torch_dtype = check_device(device, dtype)
    if not isinstance(grid, Grid):
        if grid not in (None, *GRIDS):
            raise DflopError(f"--grid {grid}: unknown (known: {', '.join(GRIDS)})")
        grid = GRIDS[grid or ("gpu" if device == "cuda" else "cpu")]
    store = ProfileStore.in_dir(out)
    store.read()  # a store that cannot be read fails here, not after the first shape
    return Request(kind, spec, pair, dtype, torch_dtype, grid, store, processes if fsdp else 0)


BARRIER_TIMEOUT_S = 1800.0
"""How long lock-step processes wait for each other at one shape before giving up (a twin died)."""
COLLECTIVE_TIMEOUT_S = 300.0
"""How long a TP group's collective waits for a peer: one op's skew, far below a shape's time."""


@dataclass(frozen=True)
class Meshes:
    """The lock-step processes' device meshes this process is in (none: measuring alone)."""

    tp: dict[int, Any] = field(default_factory=dict)
    """Per TP degree > 1, this process's TP group."""
    dp: Any = None
    """Every process: the data-parallel group FSDP2's units are sharded over."""


def _todo(r: Request, tps: tuple[int, ...], device: str, meshes: Meshes) -> list:
    todo = [(tp, job) for tp in tps
            for job in jobs(r.kind, r.spec, r.pair, tp, r.grid, r.torch_dtype, device, meshes.tp.get(tp))]
    if r.fsdp:
        todo += [(1, job) for job in fsdp_jobs(r.kind, r.spec, r.pair, r.grid, r.torch_dtype, device, r.fsdp,
                                               meshes.dp)]
    return todo


def _join(store: Any, rank: int, processes: int, tps: tuple[int, ...], fsdp: bool) -> Meshes:
    """Join the lock-step processes' gloo group; per TP degree > 1 this process's TP group, the
    processes split into consecutive groups of ``tp``, and with ``fsdp`` one of all of them (every
    process makes every mesh, in the same order: making one is collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=store, rank=rank, world_size=processes,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return Meshes({tp: init_device_mesh("cpu", (processes // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
                   for tp in tps if tp > 1},
                  init_device_mesh("cpu", (processes,), mesh_dim_names=("dp",)) if fsdp else None)


def _measure_job(phase: str, module: nn.Module, make_inputs: Callable[[], tuple], device: str, warmup: int,
                 repeats: int, meshes: Meshes, tp: int) -> dict[str, float]:
    """``measure`` a module (in this process's TP group of degree ``tp``, if it is in one), or
    ``measure_fsdp_unit`` an FSDP2 unit."""
    if phase == FSDP_UNIT:
        with warnings.catch_warnings():  # the projector returns a view; nothing here writes into it
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            return measure_fsdp_unit(module, make_inputs, device, warmup, repeats, meshes.dp.get_group())
    return measure(module, make_inputs, device, warmup, repeats,
                   meshes.tp[tp].get_group() if tp in meshes.tp else None)


def _twin(name: str, out: str, options: dict[str, Any], tps: tuple[int, ...], indices: list[int],
          warmup: int, repeats: int, threads: int | None, barrier: Any, rank: int, port: int | None) -> None:
    """A process that measures the same shapes as the recording one, at the same time, and keeps nothing
    (with ``port``, in TP groups with it, or a data-parallel one for FSDP2's units)."""
    r = check_request(name, out, processes=barrier.parties, tps=tps, **options)
    device = options["device"]
    _set_up(device, threads)
    meshes = Meshes()
    if port is not None:
        barrier.wait(BARRIER_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, barrier.parties, is_master=False,
                              timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        meshes = _join(store, rank, barrier.parties, tps, bool(r.fsdp))
    todo = _todo(r, tps, device, meshes)
    torch.manual_seed(0)
    for i in indices:
        tp, (phase, _, _, make_module, make_inputs) = todo[i]
        module = make_module()  # before the barrier, as the recording process: splitting a block is collective
        barrier.wait(BARRIER_TIMEOUT_S)
        _measure_job(phase, module, make_inputs, device, warmup, repeats, meshes, tp)
    if port is not None:
        dist.destroy_process_group()


def profile_model(name: str, out: str | Path, *, device: str = "cpu", dtype: str | None = None,
                  tps: tuple[int, ...] = (1,), grid: str | Grid | None = None, llm: str | None = None,
                  warmup: int = WARMUP, repeats: int | None = None, processes: int = 1,
                  threads: int | None = None, progress: Progress | None = None,
                  again: bool = True, fsdp: bool = False) -> ProfileReport:
    """Measure model ``name``'s shapes into the store in ``out`` (see the module's docstring); on CPU
    with ``threads`` torch threads per process (default ``CPU_THREADS``, the backend's). With ``again``,
    grid shapes measured now that sit far off their neighbours (``off_their_neighbours``) are measured
    once more, the second measurement kept whatever it says (a check of a profile, which measures a
    few shapes to compare them with their records, keeps its first figures). With ``fsdp``, FSDP2's
    units too (``measure_fsdp_unit``)."""
    options = {"device": device, "dtype": dtype, "grid": grid, "llm": llm, "fsdp": fsdp}
    r = check_request(name, out, processes=processes, tps=tps, **options)
    repeats = repeats or REPEATS[device]
    comm = TPComm.MEASURED if processes > 1 else TPComm.MODELLED
    done = {record_key(rec) for rec in r.store.read() if tp_comm_of(rec) in (None, comm)}
    base = {"device": device_name(device), "module": r.kind, "model": r.spec.name, "dtype": r.dtype}
    records = [{**base, "arch": architecture(r.kind, r.spec), "tp": tp, "phase": phase, "shape": shape,
                **({"tp_comm": comm.value} if tp > 1 else {})}
               for tp, (phase, shape, *_) in _todo(r, tps, device, Meshes())]
    pending = [i for i, rec in enumerate(records) if record_key(rec) not in done]
    report = ProfileReport(0, len(records) - len(pending), r.store.path)

    def measure_(indices: list[int], again_: bool) -> None:
        waiting = set(indices)
        with (_as_a_rank(device, threads) as kept,
              _lock_step(processes, name, str(out), options, tps, indices, warmup, repeats,
                         threads, bool(r.fsdp)) as (barrier, meshes)):
            torch.manual_seed(0)
            machine = machine_identity(device, torch.get_num_threads())
            todo = _todo(r, tps, device, meshes)
            for index, (tp, (phase, shape, holdout, make_module, make_inputs)) in enumerate(todo):
                if progress is not None and not again_:
                    progress(f"{r.spec.name} tp{tp} {phase} {shape}", index, len(records))
                if index not in waiting:
                    continue
                if progress is not None and again_:  # its own count: the shapes measured again
                    progress(f"{r.spec.name} again", indices.index(index), len(indices))
                module = make_module()
                if barrier is not None:
                    barrier.wait(BARRIER_TIMEOUT_S)
                figures = _measure_job(phase, module, make_inputs, device, warmup, repeats, meshes, tp)
                r.store.append({**records[index], **figures, "holdout": holdout, "repeats": repeats,
                                "torch": torch.__version__, "threads": torch.get_num_threads(), "processes": processes,
                                "machine": machine,
                                **({"freed_memory": "kept" if kept else "returned"} if device == "cpu" else {}),
                                "measured_at": datetime.now(timezone.utc).isoformat()})

    if pending:
        measure_(pending, False)
        report.measured = len(pending)
        measured_now = {record_key(records[i]): i for i in pending}
        mine = [rec for rec in r.store.read() if all(rec[k] == v for k, v in base.items())
                and tp_comm_of(rec) in (None, comm)]
        off = sorted(measured_now[key] for key in map(record_key, off_their_neighbours(mine))
                     if key in measured_now) if again else []
        if off:
            measure_(off, True)
            report.again = [records[i]["shape"] | {"tp": records[i]["tp"], "phase": records[i]["phase"]} for i in off]
    if progress is not None:
        progress(f"{r.spec.name} done", len(records), len(records))
    return report


def _set_up(device: str, threads: int | None) -> bool:
    """On CPU, this process set up as a rank (``threads`` torch threads, by default the backend's);
    whether freed memory is kept."""
    if device != "cpu":
        return False
    return set_up_cpu_process(threads)


@contextmanager
def _as_a_rank(device: str, threads: int | None) -> Iterator[bool]:
    """``_set_up`` with the thread count restored when the block ends (the profiler may run inside a
    longer-lived process; the memory setting stays, see ``dflop.backends.torch_runtime.cpu_process``)."""
    before = torch.get_num_threads()
    try:
        yield _set_up(device, threads)
    finally:
        torch.set_num_threads(before)


@contextmanager
def _lock_step(processes: int, name: str, out: str, options: dict[str, Any], tps: tuple[int, ...],
               pending: list[int], warmup: int, repeats: int,
               threads: int | None, fsdp: bool = False) -> Iterator[tuple[Any, Meshes]]:
    """``processes - 1`` twins measuring ``pending`` alongside this process, the barrier they share
    (None when measuring alone) and the meshes of ``_join`` (with TP degrees > 1, or ``fsdp``). A twin
    that dies breaks the barrier (or the group's collective): the run stops with an error, and what
    was recorded stays in the store."""
    if processes <= 1 or not pending:
        yield None, Meshes()
        return
    ctx = multiprocessing.get_context(start_method())
    barrier = ctx.Barrier(processes)
    store = None
    if fsdp or any(tp > 1 for tp in tps):  # rank 0's store, on a port the OS picks
        store = dist.TCPStore("127.0.0.1", 0, processes, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    port = store.port if store is not None else None
    twins = [ctx.Process(target=_twin, daemon=True,
                         args=(name, out, options, tps, pending, warmup, repeats, threads, barrier, rank, port))
             for rank in range(1, processes)]
    for t in twins:
        t.start()
    done = threading.Event()
    threading.Thread(target=_abort_when_a_twin_dies, args=(twins, barrier, done), daemon=True).start()
    joined = False
    try:
        meshes = Meshes()
        if store is not None:
            barrier.wait(BARRIER_TIMEOUT_S)  # every twin started: joining the group cannot wait on a dead one
            meshes, joined = _join(store, 0, processes, tps, fsdp), True
        yield barrier, meshes
    except RuntimeError as exc:  # BrokenBarrierError is one
        collective = isinstance(exc, dist.DistError) or "gloo" in str(exc)
        if not collective and not isinstance(exc, threading.BrokenBarrierError):
            raise  # this process's own failure, not its peers'
        for t in twins:
            t.join(timeout=5)  # a twin that failed has its exit code by then
        codes = [t.exitcode for t in twins if t.exitcode not in (None, 0)]
        why = f" (exit code {codes[0]})" if codes else ""
        if collective and not codes:
            why = f" (a group's collective failed: {str(exc).splitlines()[0]})"
        raise DflopError(f"--processes {processes}: a lock-step profiling process stopped{why}; the shapes "
                         f"measured so far are kept in {out}") from None
    finally:
        done.set()
        if joined:
            dist.destroy_process_group()
        for t in twins:
            t.join(timeout=5)
            if t.is_alive():
                t.kill()


def _abort_when_a_twin_dies(twins: list, barrier: Any, done: threading.Event) -> None:
    while not done.wait(0.2):
        if any(t.exitcode not in (None, 0) for t in twins):
            barrier.abort()
            return
