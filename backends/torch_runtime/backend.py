"""The torch backend: the plan's step graphs run on real processes, timed into the one trace format.

On one machine it starts the plan's ranks itself with torch's elastic launcher
(one process per GPU, or per CPU "GPU" on gloo; the rendezvous port chosen by
the OS); under ``torchrun`` every rank is already running and the same code
runs in place. Each rank executes its worker's nodes of every step graph
(``worker.py``), and the launcher merges what the ranks measured into a trace
recorded with the same recorder, names and arguments as the simulator's, next
to the simulator's prediction for the very same steps. A rank that raises or
dies stops every rank (the elastic agent tears the group down) and the error
names the rank, the step and the node it was at. A signal to the launcher
(Ctrl-C, SIGTERM) stops every rank the same way and ends as a
``KeyboardInterrupt`` naming the signal, with the launcher's signal handlers
as they were before.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import tempfile
import threading
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from dflop.backends.base import BackendResult, Observer, ScheduledBatch, ObservedStep, T, get_backend
from dflop.errors import DflopError, remove_left_over
from dflop.timing.steps import CostedPlan
from dflop.specs.execution import Device, DType
from dflop.specs.hardware import ClusterSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Plan
from dflop.specs.run import RunConfig
from dflop.trace.chrome import COMPUTE, OPTIMIZER, TraceBuilder
from dflop.trace.metrics import metrics
from dflop.trace.record import record_graph_step
from dflop.workload.chat import Encoded, by_step, encode_samples, load_chat

from dflop.backends.torch_runtime import checkpoint
from dflop.backends.torch_runtime.cpu_process import start_method
from dflop.backends.torch_runtime.hf_checkpoint import check_checkpoint, open_checkpoint
from dflop.backends.torch_runtime.progress import WARMUP, read_progress, telling_steps
from dflop.backends.torch_runtime.worker import Payload, RankResult, TorchOptions, rank_entry, run_rank


class RankFailed(DflopError):
    """A rank of a torch run failed or died; every rank was stopped. ``details`` holds the failing
    rank's traceback and node list (shown with ``--debug``)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


PR_SET_PDEATHSIG = 1
"""Linux prctl option: the signal a process gets when its parent ends."""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def check_launch(cluster: ClusterSpec, gpus: int, placed: Sequence[tuple[int, int]]) -> None:
    """Refuse a torchrun launch whose nodes are not the ones the plan was placed on.

    ``placed``: per rank, the (node, local rank) torchrun gave it (``GROUP_RANK``, ``LOCAL_RANK``).
    The planner puts GPU ``g`` (rank ``g``) on node ``cluster.node_of(g)``, ``gpus_per_node`` to a
    node, and prices every link (and HSDP's shard groups) by that; torchrun numbers ranks node after
    node, each node's ``--nproc-per-node`` in turn. A launch of other nodes would still run, on links
    the plan did not price, so it stops here, on every rank alike."""
    per_node = cluster.gpus_per_node
    if len(placed) == gpus and all(p == divmod(r, per_node) for r, p in enumerate(placed)):
        return
    nodes = -(-gpus // per_node)
    last = gpus - (nodes - 1) * per_node
    launch = f"--nnodes {nodes} --nproc-per-node {min(gpus, per_node)}" + (
        f" ({last} on the last node)" if last != min(gpus, per_node) else "")
    counts = Counter(node for node, _ in placed)
    got = ", ".join(f"{counts[k]} on node {k}" for k in sorted(counts))
    wrong = next((r for r, p in enumerate(placed) if r < gpus and p[0] != r // per_node), None)
    where = ("" if wrong is None else
             f", rank {wrong} on node {placed[wrong][0]} where the plan has it on node {wrong // per_node}")
    raise DflopError(f"torchrun started {len(placed)} processes ({got}){where}; the plan runs {gpus} on its "
                     f"cluster's nodes of {per_node} GPUs ({cluster.nodes} nodes): launch it with torchrun {launch}")


def torchrun_placement(device: Device, timeout_s: float) -> list[tuple[int, int]]:
    """Every rank's (``GROUP_RANK``, ``LOCAL_RANK``), gathered so that every rank judges the same
    launch (collective; joins the process group the ranks would join anyway)."""
    import datetime

    import torch
    import torch.distributed as dist

    cpu = device is Device.CPU
    if not dist.is_initialized():
        dist.init_process_group("gloo" if cpu else "nccl", timeout=datetime.timedelta(seconds=timeout_s))
    mine = torch.tensor([int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])],
                        device="cpu" if cpu else f"cuda:{int(os.environ['LOCAL_RANK'])}")
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [(int(t[0]), int(t[1])) for t in every]


def die_with_agent() -> None:
    """Under torchrun, end this rank when its agent ends (Linux; nothing elsewhere).

    torchrun starts each rank in a session of its own, so a killed agent (a lost node, an
    OOM-killer) leaves its ranks running unsupervised: they would train on, and the agents of the
    other nodes would wait for the lost one at their exit. With the parent-death signal the
    ranks go with their agent, as with their node, and the ranks on other nodes see the loss."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no C library with prctl: the ranks outlive their agent
        pass


@dataclass
class TorchBackend:
    name = "torch"
    defaults = "torch"
    resumable = True
    options: TorchOptions = field(default_factory=TorchOptions)
    keep_parameters: bool = False
    """Return every rank's final parameters (tests compare them with a reference run)."""
    predict: bool = True
    """Also simulate the same steps, for ``predicted_step_time_s`` next to the measured time."""
    folder: Path | None = None
    """In a `dflop run` (:meth:`session`), its output folder: each arm (``meta["name"]``)
    checkpoints in ``checkpoints/<arm>`` there."""
    planned: bool = False
    """In a `dflop run`, whether it is planned (and saved: ``--resume`` can continue it)."""
    model: MLLMSpec | None = None
    """In a `dflop run`, its model: what a resume checks its checkpoints against."""
    dataset: str = ""
    """The manifest whose conversations the ranks train on, rendered and tokenized by the checkpoint
    (``options.weights``); empty: synthetic inputs. A `dflop run` sets it where the config trains
    on real samples (``RunConfig.real_samples``)."""
    encoded: tuple[tuple[str, str], dict[str, Encoded]] | None = None
    """(dataset, checkpoint): its samples rendered and tokenized, by id, once for every arm of a run."""

    def run(self, runner: CostedPlan, steps: Sequence[ScheduledBatch], *, observe: Observer | None = None,
            meta: dict[str, Any] | None = None, steps_run: Callable[[int], None] | None = None) -> BackendResult:
        refuse_unsupported(runner.plan, self.options)
        if self.options.weights:  # before any rank starts: one line naming the tensor and the file
            check_checkpoint(open_checkpoint(self.options.weights), runner.system.model)
        if under_torchrun():
            check_launch(runner.system.cluster, runner.plan.gpus,
                         torchrun_placement(self.options.device, self.options.timeout_s))
        opts = self.options
        if self.folder is not None and opts.checkpoint_every:
            opts = replace(opts, checkpoint_dir=str(self.folder / "checkpoints" / (meta or {})["name"]))
        if opts.resume and opts.checkpoint_dir:
            found = checkpoint.resume_point(Path(opts.checkpoint_dir), len(steps),
                                            checkpoint.identity(opts.seed, runner.system.model))
            opts = replace(opts, resume_from=str(found) if found is not None else "")
        if opts.init_from and not opts.resume_from:  # a new run, or a resumed arm with no checkpoint of its own
            opts = replace(opts, resume_from=opts.init_from)
        texts = None
        if self.dataset:  # tokenized here, ahead of every step; a sample that fails is refused before any rank starts
            key = (self.dataset, self.options.weights)
            if self.encoded is None or self.encoded[0] != key:  # once a run: its arms train on the same samples
                self.encoded = key, encode_samples(self.dataset, runner.system.model.encoder,
                                                   load_chat(self.options.weights))
            texts = by_step(self.encoded[1], [s.batch for s in steps], self.dataset)
        with _progress_folder() as progress:
            opts = opts if opts.progress_dir else replace(opts, progress_dir=str(progress))
            payload = Payload(runner.plan, runner.system.model, [s.batch for s in steps],
                              [np.asarray(s.assignment) for s in steps], opts, runner.system.cluster.gpus_per_node,
                              texts, runner.system.training.freeze_encoder)
            results = self._launch(payload, Path(opts.progress_dir), steps_run)
        if results is None:  # a rank other than 0 under torchrun: rank 0 reports
            return BackendResult({}, metrics({"traceEvents": []}), [], {"rank": int(os.environ["RANK"])})
        return self._report(runner, steps, results, observe, meta)

    def inputs(self) -> str:
        """What the ranks train on, as the report names it."""
        if self.dataset:
            return f"real samples: {self.dataset}, chat template and tokenizer of {self.options.weights}"
        return "synthetic: token ids and pixels drawn from each sample's id, shaped by the data profile"

    # ---- a whole run: torchrun's process group, rank 0 plans and reports, signals -------------------

    @contextmanager
    def session(self, config: RunConfig, folder: Path, *, where: str, resume: bool) -> Iterator[None]:
        """The run's device checked, before any work; under torchrun the process group joined (and
        this rank tied to its agent); the ranks run as ``config.execution`` says (resuming, each arm
        from its own newest checkpoint; with ``init_from``, a step folder the job has checked, each
        arm without one from that); a signal ends the run as an interrupt saying how to go on. The
        process group it joined it leaves at the end, refused or done: a rank whose group's threads
        are still running as the interpreter exits can abort."""
        if problem := device_problem(config.execution.device):
            raise DflopError(f"{where}: execution.device: {problem}")
        joined = False
        if under_torchrun():
            import torch.distributed as dist

            die_with_agent()
            if not dist.is_initialized():
                dist.init_process_group("gloo" if config.execution.device is Device.CPU else "nccl",
                                        timeout=datetime.timedelta(seconds=config.execution.timeout_s))
                joined = True
        spec = config.execution
        before = self.options, self.folder, self.planned, self.model, self.dataset, self.encoded
        self.options = replace(self.options, **{f.name: getattr(spec, f.name) for f in fields(spec)},
                             seed=config.seed, resume=resume, weights=config.checkpoint)
        self.folder, self.planned, self.model = folder, resume, config.model
        self.dataset = config.data.dataset if config.real_samples else ""
        self.encoded = None
        try:
            with _interruptible(folder, lambda: self.planned):
                yield
        finally:
            self.options, self.folder, self.planned, self.model, self.dataset, self.encoded = before
            if joined:
                dist.destroy_process_group()

    @property
    def calibrates(self) -> bool:
        """Launched here only: under torchrun, rank 0 measuring shapes while the other ranks wait would
        start processes (and, for TP shapes, a process group) beside the run's own."""
        return not under_torchrun()

    def is_reporting_rank(self) -> bool:
        """Rank 0 under torchrun; the one process launched here."""
        return not under_torchrun() or int(os.environ["RANK"]) == 0

    def share(self, value: T) -> T:
        if not under_torchrun():
            return value
        import torch.distributed as dist

        bundle = [value]
        dist.broadcast_object_list(bundle, src=0)
        self.planned = True  # what the reporting rank shares is the planned (and saved) run
        return bundle[0]

    def refuse(self, plan: Plan) -> None:
        refuse_unsupported(plan, self.options)

    def prepare(self, plans: dict[str, Plan], steps: int, log: Callable[[str], None]) -> None:
        """Resuming, every arm's checkpoint checked before the first arm trains; otherwise the
        checkpoints an earlier run left in the folder removed. More CPU ranks than cores: a warning.
        A plan the backend cannot run is refused here, before the calibration."""
        assert self.folder is not None, "prepare() runs inside session()"
        for plan in plans.values():
            self.refuse(plan)
        self.planned = True
        saved = self.folder / "checkpoints"
        if self.options.resume:
            for name in plans:
                checkpoint.resume_point(saved / name, steps, checkpoint.identity(self.options.seed, self.model))
        else:
            _clear_checkpoints(saved, plans, log)
        if note := crowding(max(plan.gpus for plan in plans.values()), self.options.device):
            log(f"dflop: warning: {note}")

    # ---- launching --------------------------------------------------------------------------------

    def _launch(self, payload: Payload, progress: Path, steps_run: Callable[[int], None] | None = None
                ) -> dict[int, RankResult] | None:
        if under_torchrun():
            import torch.distributed as dist

            mine = run_rank(payload, self.keep_parameters)
            gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            return {r.rank: r for r in gathered} if gathered is not None else None
        return self._spawn(payload, progress, steps_run)

    def _spawn(self, payload: Payload, progress: Path, steps_run: Callable[[int], None] | None = None
               ) -> dict[int, RankResult]:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        method = start_method()
        world = payload.plan.gpus
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"dflop-{uuid.uuid4().hex[:8]}",
                              rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                              monitor_interval=0.1, start_method=method)
        with _quiet_launcher(), _own_signal_handlers(), telling_steps(progress, world, steps_run):
            try:
                return elastic_launch(config, rank_entry)(payload, self.keep_parameters)
            except ChildFailedError as exc:
                raise RankFailed(*_failure_message(exc, progress)) from None
            except SignalException as exc:  # the agent has stopped every rank already
                raise KeyboardInterrupt(signal.Signals(exc.sigval).name) from None

    # ---- reporting --------------------------------------------------------------------------------

    def _report(self, runner: CostedPlan, steps: Sequence[ScheduledBatch], results: dict[int, RankResult],
                observe: Observer | None, meta: dict[str, Any] | None) -> BackendResult:
        from dflop.sim.simulate import trace_meta

        trace = TraceBuilder(meta=trace_meta(runner, backend="torch", device=str(self.options.device), **(meta or {})))
        leads = {r.worker: r for r in results.values() if r.tp_index == 0}
        first = min(r.start_step for r in results.values())
        offset, per_step = 0, []
        skipped: list[dict[str, Any]] = []
        ran: list[ScheduledBatch] = []
        for i in range(first, len(steps)):
            batch, assignment = steps[i].batch, np.asarray(steps[i].assignment)
            skip = next(iter(results.values())).steps[i - first]["skipped"]  # (the same on every rank)
            if skip:  # the step the ranks ran: without the samples whose media failed to decode
                keep = np.flatnonzero(~np.isin(batch.ids.astype(str), list(skip)))
                batch, assignment = batch.take(keep), assignment[keep]
                skipped += [{"step": i, "sample_id": k, "why": why} for k, why in skip.items()]
            ran.append(ScheduledBatch(batch, assignment))
            step = runner.step(i, batch, assignment)
            graph, costs = step.graph, step.costs
            start, end = np.zeros(len(graph), dtype=np.int64), np.zeros(len(graph), dtype=np.int64)
            for w, lead in leads.items():
                for n, (a, b) in lead.steps[i - first]["nodes"].items():
                    start[n], end[n] = a, b
            step_ns = max(r.steps[i - first]["end"] for r in results.values())
            compute_end = record_graph_step(trace, graph, start, end, step=i, offset_ns=offset, step_ns=step_ns,
                                            costs=costs, samples=len(batch))
            for w, lead in leads.items():
                a, b = lead.steps[i - first]["optimizer"]
                trace.op(w, COMPUTE, "OPTIMIZER", OPTIMIZER, a + offset, b + offset, {"step": i})
            loss = sum(r.steps[i - first]["loss"] for r in results.values() if r.tp_index == 0)
            graph_ns = max(r.steps[i - first]["optimizer"][0] for r in results.values())
            optimizer_ns = max(b - a for a, b in (r.steps[i - first]["optimizer"] for r in results.values()))
            per_step.append({"step": i, "step_s": step_ns / 1e9, "graph_s": graph_ns / 1e9,
                             "optimizer_s": optimizer_ns / 1e9, "compute_s": compute_end / 1e9, "loss": loss,
                             "inputs_s": max(r.steps[i - first]["inputs_s"] for r in results.values()),
                             "decode_s": max(r.steps[i - first]["decode_s"] for r in results.values()),
                             "sample_ids": [str(x) for x in batch.ids]})
            if observe is not None:
                observe(ObservedStep(step, start, end))
            offset += step_ns
        doc = trace.document()
        warm = [r.warmup for r in results.values() if r.warmup is not None]
        extra: dict[str, Any] = {"losses": [s["loss"] for s in per_step], "first_step": first,
                                 "warmup": {"step": warm[0][0], "seconds": max(s for _, s in warm)} if warm else None,
                                 "device": str(self.options.device), "inputs": self.inputs(),
                                 "trained": [{k: s[k] for k in ("step", "loss", "sample_ids")} for s in per_step],
                                 "skipped": skipped}
        if self.predict:
            cores = shared_cores(runner.plan.gpus, self.options.device)
            predicted = get_backend("sim", memory=False, cores=cores).run(runner, ran)
            extra["shared_cores"] = cores
            extra["predicted_step_time_s"] = [s["step_s"] for s in predicted.steps]
            extra["predicted_trace"] = predicted.trace
        if self.keep_parameters:
            extra["parameters"] = {name: t for r in results.values() for name, t in r.parameters.items()}
            extra["rank_parameters"] = {r.rank: r.parameters for r in results.values()}  # each rank's own copies
            extra["weights_read"] = {r.rank: r.weights_read for r in results.values()}
        return BackendResult(doc, metrics(doc), per_step, extra)


def device_problem(device: Device, processes: int | None = None) -> str | None:
    """Why this machine cannot run the ranks on ``device`` (None when it can): CUDA asked of a torch
    without CUDA or a machine without a GPU, or (launched here, one process per GPU) fewer GPUs
    than ``processes``. Said before any process starts, which would fail only inside."""
    if device is not Device.CUDA:
        return None
    import torch

    if not torch.cuda.is_available():
        build = "this torch is built without CUDA" if torch.version.cuda is None else "torch finds no CUDA GPU here"
        return f"cuda: {build}; use device: cpu"
    if processes is not None and not under_torchrun() and torch.cuda.device_count() < processes:
        return (f"cuda: the plan runs {processes} processes, one per GPU, but this machine has "
                f"{torch.cuda.device_count()}")
    return None


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def shared_cores(processes: int, device: Device) -> int | None:
    """The cores CPU ranks launched here take turns on, where they outnumber them (None: each rank
    has a core, or a device, of its own): what the prediction of their steps models."""
    cores = cpu_cores()
    return cores if device is Device.CPU and not under_torchrun() and processes > cores else None


def crowding(processes: int, device: Device) -> str | None:
    """A warning when CPU ranks launched here outnumber the cores: each runs one thread, so more of
    them than cores take turns, and measured steps say more about the machine than the plan."""
    if (cores := shared_cores(processes, device)) is None:
        return None
    return (f"the plan runs {processes} processes on {cores} CPU core{'s' if cores > 1 else ''}: they take turns "
            "on the cores (and are predicted to), so measured step times say more about this machine than the plan")


def refuse_unsupported(plan: Plan, options: TorchOptions) -> None:
    """What the torch backend cannot run as the plan says, refused before any process starts.

    ``fp32_grads`` (Megatron's fp32 main gradients, FSDP's float32 reduce dtype) needs
    gradients wider than the parameters; the backend keeps gradients in the parameters' dtype,
    which in float32 and float64 runs is already that wide (so there the field changes nothing),
    but not in 16-bit ones."""
    if plan.heterogeneous and (plan.encoder.tp != 1 or plan.llm.tp != 1 or plan.zero > 1):
        raise DflopError(f"plan field placement: the torch backend runs a heterogeneous encoder phase with tp 1 "
                         f"for the encoder and the LLM and ZeRO 0 or 1 (got encoder tp {plan.encoder.tp}, llm tp "
                         f"{plan.llm.tp}, zero {plan.zero}); the simulator runs any: dflop simulate --plan")
    stage = plan.llm.tp * plan.llm.dp
    if plan.heterogeneous and plan.zero == 1 and plan.llm.dp > 1 and plan.encoder.gpus % stage:
        raise DflopError(f"plan field encoder: with zero 1 the torch backend shards a heterogeneous encoder's "
                         f"optimizer state over the LLM's data-parallel groups, so its GPUs must be whole LLM "
                         f"stages (a multiple of {stage}; got tp {plan.encoder.tp} x dp {plan.encoder.dp}): use "
                         f"zero 0, or the simulator: dflop simulate --plan")
    if plan.fp32_grads and options.dtype in (DType.BFLOAT16, DType.FLOAT16):
        raise DflopError(f"plan field fp32_grads: the torch backend keeps gradients in the parameters' dtype "
                         f"({options.dtype}), not in fp32 buffers; run with execution dtype float32 or float64, or "
                         "use a plan with fp32_grads false")
    if problem := device_problem(options.device, plan.gpus):
        raise DflopError(f"execution.device: {problem}")


@contextmanager
def _quiet_launcher() -> Iterator[None]:
    """The elastic agent logs every child's traceback (and a signal it stops the ranks on); dflop
    reports a failure in one line instead (and the traceback under --debug). Each of its modules'
    loggers has a level of its own, so each is raised."""
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    loggers = [logging.getLogger(name) for name in sorted(set(logging.Logger.manager.loggerDict) | set(prefixes))
               if name.startswith(prefixes)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """The elastic launcher installs handlers for these signals (raising ``SignalException``) and
    leaves them; put back what was there, so a signal after the launch is the caller's again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = [n for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n)]
    saved = {n: signal.getsignal(getattr(signal, n)) for n in names}
    try:
        yield
    finally:
        for n, handler in saved.items():
            if handler is not None:  # None: set outside Python, nothing to put back
                signal.signal(getattr(signal, n), handler)


@contextmanager
def _progress_folder() -> Iterator[Path]:
    """Where the ranks of this node keep their progress files. Under torchrun, one folder per agent
    (the ranks' parent process), shared by its ranks so that each can read what a sibling lost; left
    behind when a rank failed (a sibling failing later reads it), removed after a run that ended well.
    Launched here, a temporary folder for the launch."""
    if not under_torchrun():
        with tempfile.TemporaryDirectory(prefix="dflop-progress-") as folder:
            yield Path(folder)
        return
    folder = Path(tempfile.gettempdir()) / f"dflop-progress-agent-{os.getppid()}"
    folder.mkdir(exist_ok=True)
    yield folder
    rank = os.environ["RANK"]
    for suffix in ("progress", "pid", "lost"):
        (folder / f"rank-{rank}.{suffix}").unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # a sibling's files are still there: the last to finish removes it
        pass


def _failure_message(exc: Any, progress: Path) -> tuple[str, str]:
    """(one line: which rank failed first and how, where it was; the failing rank's traceback)."""
    rank, failure = min(exc.failures.items())
    message, details = failure.message, ""
    if isinstance(message, dict):
        details = str(message.get("extraInfo", {}).get("py_callstack", ""))
        message = message.get("message", "")
    message = str(message or "").strip()
    if message.startswith("DflopError: "):  # bad input a rank found (a checkpoint): every rank found it
        return message.removeprefix("DflopError: ").splitlines()[0], details
    if " failed at step " in message:  # an ActionFailed: it names rank, step and node itself
        return message.split(": ", 1)[1] if message.startswith("ActionFailed") else message, details
    where = read_progress(progress, rank)
    at = ""
    if where is not None:
        step, label = where
        warming = label.startswith(WARMUP)
        at = (f" in the warm-up (step {step}'s graph), " if warming else f" at step {step}, ") + \
            f"node {label.removeprefix(WARMUP).strip() if warming else label}"
    line = (f"rank {rank} died{at} (exit code {failure.exitcode}); every other rank was stopped"
            + (f": {message.splitlines()[0]}" if message and "To enable traceback" not in message else ""))
    return line, details


def _clear_checkpoints(folder: Path, arms: Iterable[str], log: Callable[[str], None]) -> None:
    """Remove the checkpoints (``<arm>/step-NNNNNN``) an earlier run left in ``folder`` for these
    arms, so that a resume of this run sees its own alone; any other file stays."""
    found = [p for arm in arms for p in (folder / arm).glob("step-*")
             if checkpoint.STEP.fullmatch(p.name) and p.is_dir()]
    remove_left_over(found)
    if found:
        log(f"dflop: {folder}: removed the checkpoints an earlier run left there ({len(found)})")


@contextmanager
def _interruptible(folder: Path, planned: Callable[[], bool]) -> Iterator[None]:
    """SIGTERM stops the run as Ctrl-C does, and either ends it as a KeyboardInterrupt whose message
    says where the run can be resumed from (every rank has been stopped by then: the launcher's
    agent stops them on the signal). Under torchrun its agent owns the signals: a rank keeps the
    default SIGTERM, which ends it at once even inside a collective, where a Python handler waits."""
    main = threading.current_thread() is threading.main_thread() and not under_torchrun()
    before = signal.signal(signal.SIGTERM, _terminated) if main else None
    try:
        yield
    except KeyboardInterrupt as exc:
        raise KeyboardInterrupt(_interrupted(folder, str(exc) or "SIGINT", planned())) from None
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _interrupted(folder: Path, by: str, planned: bool) -> str:
    """The line an interrupted run ends with: what stopped it and how to go on."""
    if not planned:
        return f"the torch run was stopped by {by} before it started training"
    saved = sorted(folder.glob("checkpoints/*/step-*/" + checkpoint.META))
    kept = f"its checkpoints are in {folder / 'checkpoints'}" if saved else "it saved no checkpoint"
    return f"the torch run was stopped by {by}, every process with it; {kept}; `--resume {folder}` continues it"
