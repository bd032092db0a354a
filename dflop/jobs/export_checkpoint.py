"""`dflop export checkpoint RUN_DIR --to hf --out DIR`: a run's trained weights as a Hugging Face folder.

The run folder is a `dflop run --backend torch` output with ``execution.checkpoint_every``
set. Its dflop arm is the run (the baselines train the same model only to be timed against
it), so the export is that arm's newest complete checkpoint (``checkpoints/dflop/step-NNNNNN``
with its ``meta.json``). The folder is written beside ``--out`` under a temporary name and
renamed into place at the end: a failure leaves nothing at ``--out``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from enum import Enum
from pathlib import Path
from typing import Any

from dflop.errors import DflopError, ensure_writable_folder, member
from dflop.specs.loading import from_mapping, load_json
from dflop.specs.models import LLMSpec

from dflop.jobs.resume import RUN_FILE, read_run

ARM = "dflop"


class CheckpointTarget(str, Enum):
    """Formats a run's checkpoint is written in."""

    HF = "hf"

    def __str__(self) -> str:
        return self.value


def _empty_out(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise DflopError(f"--out {out}: exists and is not an empty folder (give a new or empty folder)")


def export_checkpoint(run_dir: str | Path, target: str, out: str | Path, *,
                      shard_bytes: int | None = None) -> dict[str, Any]:
    """Write the newest checkpoint of the run in ``run_dir`` to ``out``; what was written.
    ``shard_bytes``: split the weights into files of at most this size (default save_pretrained's)."""
    from dflop.backends.torch_runtime import checkpoint, hf_export
    from dflop.backends.torch_runtime.hf_checkpoint import open_checkpoint

    kind, run_dir, out = member(CheckpointTarget, target, "--to", "checkpoint format"), Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise DflopError(f"{run_dir}: no such run folder (give the --out folder of a `dflop run --backend torch`)")
    if not (run_dir / RUN_FILE).is_file():
        raise DflopError(f"{run_dir}: not the folder of a `dflop run --backend torch` (no {RUN_FILE})")
    _empty_out(out)
    run = read_run(run_dir)
    saved = run_dir / "checkpoints" / ARM
    found = checkpoint.newest(saved)
    if found is None:
        raise DflopError(f"{saved}: no complete checkpoint to export (run with execution.checkpoint_every set)")
    checkpoint.check_files(found)
    llm = from_mapping(LLMSpec, run.get("llm"), f"{run_dir / RUN_FILE}: llm")
    source = open_checkpoint(run["checkpoint"]) if run.get("checkpoint") else None
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=ensure_writable_folder(out.parent, "output")))
    try:
        files = hf_export.write_folder(found, llm, source, tmp, str(run_dir),
                                       shard_bytes or hf_export.SHARD_BYTES)
        tmp.chmod(0o755)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "to": str(kind), "run": str(run_dir), "checkpoint": str(found),
            "step": load_json(found / checkpoint.META)["step"], "arm": ARM,
            "source": str(source.folder) if source is not None else None, "files": sorted(files)}
