"""Shared figure set-up. matplotlib is imported here only, and only when a figure is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflop.errors import DflopError, check_output

IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")
"""Figure files dflop writes (matplotlib picks the format from the suffix)."""

COLORS = {
    "text": "#7f7f7f",
    "image": "#1f77b4",
    "multi_image": "#2ca02c",
    "video": "#d62728",
    "F": "#4c72b0",
    "B": "#dd8452",
    "I": "#dd8452",
    "W": "#55a868",
    "comm": "#b0b0b0",
    "allreduce": "#8172b3",
    "idle": "#f2f2f2",
}


def figure(rows: int, cols: int, size: tuple[float, float], **kwargs: Any):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=size, **kwargs)
    return fig, axes


def save(fig: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    p = Path(path)
    try:
        check_output(p, suffixes=IMAGE_SUFFIXES)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=110, bbox_inches="tight")
    except OSError as exc:
        raise DflopError(f"{p}: cannot write the figure ({exc.strerror})") from None
    finally:
        plt.close(fig)
    return p
