"""Errors a user can act on.

Every error raised for bad input is a :class:`DflopError` whose message is one
line naming the input (file, key, line, entry) and what is wrong with it; the
CLI prints that line and exits with status 2. Anything else is a bug.
"""

import os
import shutil
import tempfile
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

E = TypeVar("E", bound=Enum)


class DflopError(Exception):
    """Bad input or an impossible request, explained in one line."""


LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
"""What ``str.splitlines`` breaks a line at."""


def one_line(value: object) -> str:
    """``value`` as text a one-line message can quote: its line breaks escaped (a path or a name
    from the user's input may hold one)."""
    return "".join(repr(c)[1:-1] if c in LINE_BREAKS else c for c in str(value))


class SpecError(DflopError):
    """A model, hardware, cluster, plan or run spec is invalid."""


class PlanError(DflopError):
    """A plan does not fit the cluster or the model."""


class ManifestError(DflopError):
    """A dataset manifest entry cannot be read."""


class InfeasibleError(DflopError):
    """No schedule or plan satisfies the constraints (caps, memory)."""


def member(kind: type[E], value: Any, where: str, what: str, error: type[DflopError] = DflopError) -> E:
    """``value`` as a member of the closed set ``kind`` (a str-valued enum), whatever its case and
    surrounding blanks; an unknown one is one line naming ``where``, the value and the valid ones."""
    try:
        return kind(value.strip().lower() if isinstance(value, str) else value)
    except ValueError:
        valid = ", ".join(str(m.value) for m in kind)
        raise error(f"{where}: unknown {what} {value!r} (valid: {valid})") from None


def ensure_writable_folder(folder: str | Path, what: str) -> Path:
    """Create ``folder`` and check it can be written, so that a run fails before any work, not
    after it; ``what`` names the folder in the message (output, profile)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DflopError(f"{folder}: cannot create the {what} folder ({exc.strerror})") from None
    if not os.access(folder, os.W_OK):
        raise DflopError(f"{folder}: {what} folder is not writable")
    return folder


def check_output(path: str | Path, *, folder: bool = False, suffixes: tuple[str, ...] = ()) -> Path:
    """Check, before any work and leaving nothing behind, that ``path`` can be written: a file
    (or with ``folder``, a folder) that is not a thing of the other kind, with one of ``suffixes``
    when some are given, under a folder that exists or can be made and is writable."""
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise DflopError(f"{path}: exists and is not a folder")
    if not folder and path.is_dir():
        raise DflopError(f"{path}: is a folder, expected a file name")
    if suffixes and path.suffix.lower() not in suffixes:
        kind = f"unsupported file type '{path.suffix}'" if path.suffix else "no file type"
        raise DflopError(f"{path}: {kind} (use {', '.join(suffixes)})")
    nearest = path if folder else path.parent
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise DflopError(f"{path}: cannot be written, {nearest} is not a folder")
    try:  # a probe, not os.access: root passes access() where the file system refuses (/proc, /sys)
        os.rmdir(tempfile.mkdtemp(prefix=".dflop-probe-", dir=nearest))
    except OSError as exc:
        raise DflopError(f"{path}: cannot be written, {nearest} is not writable ({exc.strerror})") from None
    return path


def remove_left_over(paths: list[Path]) -> None:
    """Remove the files and folders an earlier run left, before a new run writes its own; the one
    that cannot be removed is named in one line."""
    try:
        for p in paths:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    except OSError as exc:
        raise DflopError(f"{exc.filename}: cannot remove what an earlier run left ({exc.strerror})") from None
