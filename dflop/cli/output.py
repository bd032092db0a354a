"""Output conventions of the `dflop` command.

With ``--json`` a command prints exactly one JSON object on stdout; without it,
a short human summary. Progress and logs always go to stderr.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Callable

import numpy as np


def _plain(value: Any) -> Any:
    """JSON-safe: numpy scalars to Python, NaN/inf to null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def emit(result: dict[str, Any], as_json: bool, human: Callable[[dict[str, Any]], str]) -> None:
    if as_json:
        sys.stdout.write(json.dumps(_plain(result)) + "\n")
    else:
        sys.stdout.write(human(result).rstrip() + "\n")


def log(message: str) -> None:
    sys.stderr.write(message + "\n")


def fmt_stats(block: dict[str, float]) -> str:
    return f"mean {block['mean']:.1f}  p50 {block['p50']:.0f}  p99 {block['p99']:.0f}  max {block['max']:.0f}"
