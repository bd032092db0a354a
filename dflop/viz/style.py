"""Shared figure set-up and colours. matplotlib is imported here only, and only when a figure is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflop.errors import DflopError, check_output
from dflop.specs.plan import Module

IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")
"""Figure files dflop writes (matplotlib picks the format from the suffix)."""

COLORS = {
    "text": "#7f7f7f",
    "image": "#1f77b4",
    "multi_image": "#2ca02c",
    "video": "#d62728",
    "idle": "#f2f2f2",
}

# Timelines: the LLM in blue/orange/brown, the encoder in greens and purple, so a glance
# tells the two modules apart; communication in colours no compute bar uses.
COMPUTE_COLORS = {
    (Module.LLM, "F"): "#4c72b0", (Module.LLM, "B"): "#dd8452", (Module.LLM, "I"): "#dd8452", (Module.LLM, "W"): "#937860",
    (Module.ENCODER, "F"): "#55a868", (Module.ENCODER, "B"): "#8172b3", (Module.ENCODER, "I"): "#8172b3",
    (Module.ENCODER, "W"): "#da8bc3",
}
COMM_COLORS = {"p2p": "#6f6f6f", "bridge": "#17becf", "reduce_grad": "#c44e52", "unshard": "#ccb974",
               "overlapped": "#e5d8a0", "all_to_all_f": "#17becf", "all_to_all_b": "#0f8a96",
               "reduce_encoder_grad": "#8c2d30"}
OTHER_COLOR = "#b5b5b5"
COLOCATED_COLORS = {"F": "#2b4a7a", "B": "#9c5428", "I": "#9c5428", "W": "#5e4c3c"}
"""A darker shade of the LLM's colours, hatched, where a colocated first stage also runs the encoder."""
COLOCATED_HATCH = "//"
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (inputs)", "W": "backward (weights)"}
COMM_NAMES = {"p2p": "p2p send", "bridge": "encoder->LLM bridge", "reduce_grad": "gradient reduction",
              "unshard": "FSDP gather", "overlapped": "FSDP gathers/reductions inside compute",
              "all_to_all_f": "all-to-all (embeddings)", "all_to_all_b": "all-to-all (their gradients)",
              "reduce_encoder_grad": "encoder gradient reduction"}


def figure(rows: int, cols: int, size: tuple[float, float], **kwargs: Any):
    """A figure of its own, outside pyplot: no backend is chosen or switched (a notebook's inline
    display keeps working), and nothing stays open once it is saved or dropped."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    return fig, fig.subplots(rows, cols, **kwargs)


def save(fig: Any, path: str | Path) -> Path:
    p = Path(path)
    try:
        check_output(p, suffixes=IMAGE_SUFFIXES)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=110, bbox_inches="tight")
    except OSError as exc:
        raise DflopError(f"{p}: cannot write the figure ({exc.strerror})") from None
    return p
