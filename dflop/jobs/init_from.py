"""A new run that starts from another run's checkpoint: ``execution.init_from``, ``dflop run --init-from``.

As Megatron-LM's ``--load`` under other parallelism and torchtitan's ``checkpoint.initial_load_path``:
the run has plans of its own (searched, or given) and begins at the checkpoint's step with its
weights and optimizer states, which torch.distributed.checkpoint reshards onto each arm's plan; the
steps before it are not run, as on a resume. Every arm that trains starts from the same checkpoint:
the arms train one model on the same global batches (only their bins differ), so each continues the
checkpoint's run and they are timed against each other from the same weights.

The checkpoint must be a start that run would have continued from: the run's seed and model, trained
on the run's first global batches (so the steps after it draw the samples the saving run drew), with
a step left to train. :func:`check_start` checks that on the reporting rank before planning. The run's
record names the checkpoint's step folder, so that a resume restarts an arm that has no checkpoint of
its own from the very same one.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from dflop.backends.base import Backend
from dflop.errors import DflopError
from dflop.specs.run import RunConfig

from dflop.jobs.export_checkpoint import ARM
from dflop.jobs.setup import Setup
from dflop.jobs.steps import global_batches


def with_init_from(config: RunConfig, option: Path | None, backend: Backend, where: str) -> RunConfig:
    """``config`` with ``--init-from`` (``option``, when given) in place of its ``execution.init_from``,
    resolved to the absolute step folder it names (:func:`starting_point`), so that every rank and
    the run's record hold the same one. ``where`` names the config in errors. A backend that keeps
    no checkpoints (the simulator: it trains no weights) refuses it, as it refuses ``--resume``."""
    named = str(option) if option is not None else config.execution.init_from
    if not named:
        return config
    source = "--init-from" if option is not None else f"{where}: execution.init_from"
    if not backend.resumable:
        raise DflopError(f"{source}: the {backend.name} backend trains no weights to start from a checkpoint "
                         "(a run starts from one on a backend that trains: --backend torch)")
    try:
        found = starting_point(Path(named))
    except DflopError as exc:
        raise DflopError(f"{source}: {exc}") from None
    return replace(config, execution=replace(config.execution, init_from=str(found.resolve())))


def starting_point(path: Path) -> Path:
    """The complete checkpoint ``path`` names: itself (a ``step-NNNNNN`` folder), the newest in it (a
    folder of them, such as a run's ``checkpoints/<arm>``), or its dflop arm's newest (a run's output
    folder: the run's own checkpoints, as `dflop export checkpoint` reads them). DflopError
    (``path: ...``) where it names none."""
    from dflop.backends.torch_runtime import checkpoint

    if not path.is_dir():
        raise DflopError(f"{path}: no such folder (give a checkpoint folder step-NNNNNN, a folder of them, "
                         "or the output folder of a `dflop run --backend torch` that saved some)")
    if checkpoint.STEP.fullmatch(path.name):
        if not (path / checkpoint.META).is_file():
            raise DflopError(f"{path}: not a complete checkpoint (no {checkpoint.META}: its run stopped while "
                             "saving it)")
        return path
    arm = path / "checkpoints" / ARM
    folder = arm if arm.is_dir() else path
    found = checkpoint.newest(folder)
    if found is None:
        raise DflopError(f"{folder}: no complete checkpoint (step-NNNNNN with its {checkpoint.META}) in it "
                         "(its run needs execution.checkpoint_every)")
    return found


def check_start(s: Setup, steps: int, out: Path) -> dict[str, Any] | None:
    """Where a new run of ``steps`` steps into ``out`` starts (``checkpoint``: the step folder; ``step``),
    checked before any work (``checkpoint.check_start``: the run's seed, model and first global
    batches; a step left); None for a run from the seed. A checkpoint among ``out``'s own is
    refused: the run clears those before it starts."""
    if not s.config.execution.init_from:
        return None
    from dflop.backends.torch_runtime import checkpoint

    start = Path(s.config.execution.init_from)
    if start.is_relative_to((out / "checkpoints").resolve()):
        raise DflopError(f"execution.init_from: {start} is a checkpoint of --out {out}, which this run clears "
                         "before it starts (give another --out, or copy the checkpoint elsewhere first)")
    trained = checkpoint.TrainedBatches(global_batches(s))
    step = checkpoint.check_start(start, steps, checkpoint.identity(s.config.seed, s.config.model), trained.upto)
    return {"checkpoint": str(start), "step": step}
