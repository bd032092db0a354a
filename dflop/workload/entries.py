"""Manifest files as entries: a JSON list, or JSON lines, read without trusting the bytes.

Bytes that are not UTF-8, JSON nested beyond Python's recursion limit and lines
that are not JSON become one-line errors naming the file and line. In a JSON
lines file they belong to one entry, so ``--skip-bad`` skips and counts them;
in a JSON list they spoil the whole file. JSON lines are parsed only when an
entry is used, so sampling 1% of a large file parses 1% of its lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflop.errors import ManifestError
from dflop.specs.loading import read_regular, too_many_digits

BOM = b"\xef\xbb\xbf"


class EntryError(ManifestError):
    """One entry cannot be read; ``reason`` groups the skipped entries in the summary."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def read_bytes(path: Path, what: str = "manifest") -> bytes:
    try:
        data = read_regular(path)
    except FileNotFoundError:
        raise ManifestError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise ManifestError(f"{path}: is a folder, expected a {what} file") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the {what} ({exc.strerror})") from None
    except ValueError as exc:
        raise ManifestError(f"{path}: cannot read the {what}: {exc}") from None
    return data[len(BOM):] if data.startswith(BOM) else data


def _utf8_problem(exc: UnicodeDecodeError, data: bytes) -> tuple[int, str]:
    """(line, problem) of the first byte that is not UTF-8."""
    line_start = data.rfind(b"\n", 0, exc.start) + 1
    line = data.count(b"\n", 0, exc.start) + 1
    return line, f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at column {exc.start - line_start + 1})"


def decode(data: bytes, path: Path) -> str:
    """The whole file as text; the first non-UTF-8 byte is an error naming its line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, problem = _utf8_problem(exc, data)
        raise ManifestError(f"{path}:{line}: {problem}") from None


def parse_json(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise ManifestError(f"{path}: JSON nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise ManifestError(f"{path}: not valid JSON ({too_many_digits(exc)})") from None


@dataclass(frozen=True)
class Entries:
    """The entries of one manifest, by position; JSON lines are parsed on access."""

    path: Path
    items: list
    """Parsed entries (JSON list) or raw lines (JSON lines)."""
    lines: list[int] | None = None
    """Line number of every entry of a JSON lines file."""

    def __len__(self) -> int:
        return len(self.items)

    def where(self, index: int) -> str:
        if self.lines is None:
            return f"{self.path}: entry {index}"
        return f"{self.path}:{self.lines[index]}: entry {index}"

    def get(self, index: int) -> Any:
        """Entry ``index``; raises EntryError for a line that is not UTF-8 or not JSON."""
        item = self.items[index]
        if self.lines is None:
            return item
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError as exc:
                problem = _utf8_problem(exc, item)[1]
                raise EntryError(f"{self.where(index)}: {problem}", "not valid UTF-8") from None
        try:
            return json.loads(item)
        except json.JSONDecodeError as exc:
            raise EntryError(f"{self.where(index)}: not valid JSON ({exc.msg})", "not valid JSON") from None
        except RecursionError:
            raise EntryError(f"{self.where(index)}: JSON nested too deeply", "not valid JSON") from None
        except ValueError as exc:  # an integer of more digits than Python converts
            raise EntryError(f"{self.where(index)}: not valid JSON ({too_many_digits(exc)})",
                             "not valid JSON") from None


def entries(path: Path, data: bytes) -> Entries:
    """A JSON list (the file starts with ``[``) or JSON lines, one entry a non-blank line."""
    if data.lstrip()[:1] == b"[":
        items = parse_json(decode(data, path), path)
        if not isinstance(items, list):
            raise ManifestError(f"{path}: expected a JSON list of entries")
        return Entries(path, items)
    try:
        raw: list = data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raw = data.split(b"\n")  # decode line by line, so that one bad line is one bad entry
    items, lines = [], []
    for number, line in enumerate(raw, start=1):
        if line.strip():
            items.append(line)
            lines.append(number)
    return Entries(path, items, lines)
