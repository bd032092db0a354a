"""Shape distributions of a data profile: tiles and LLM tokens per modality."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflop.viz.style import COLORS, figure, save
from dflop.workload.data_profile import DataProfile
from dflop.workload.sample import MODALITIES


def plot_data_profile(profile: DataProfile, path: str | Path) -> Path:
    s = profile.samples
    fig, (ax_tiles, ax_tokens) = figure(1, 2, size=(12, 4.2))
    token_edges = np.unique(np.geomspace(8, max(16, s.llm_tokens.max() + 1), 40).round())
    for m in MODALITIES:
        mask = s.modality == m.code
        if not mask.any():
            continue
        label = f"{m.value} ({mask.mean():.0%})"
        color = COLORS[m.value]
        if s.tiles[mask].max() > 0:
            ax_tiles.hist(s.tiles[mask], bins=np.arange(0, s.tiles.max() + 2) - 0.5, histtype="step",
                          linewidth=1.6, color=color, label=label)
        ax_tokens.hist(np.maximum(s.llm_tokens[mask], 8), bins=token_edges, histtype="step",
                       linewidth=1.6, color=color, label=label)
    ax_tiles.set(xlabel="vision tiles per sample", ylabel="samples", title="Encoder work")
    ax_tokens.set(xlabel="LLM tokens per sample", ylabel="samples", title="LLM work", xscale="log")
    for ax in (ax_tiles, ax_tokens):
        ax.legend(frameon=False)
    name = profile.source.get("name") or profile.source.get("path", "")
    fig.suptitle(f"Data profile: {name}, {len(s)} samples, encoder {profile.source.get('encoder', '')}")
    return save(fig, path)
