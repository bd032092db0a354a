"""The data profile: per-sample shapes of a dataset or mix, and their statistics.

A profile keeps every sample's shape (not only histograms) so that planners can
draw realistic global batches from it later, with the joint distribution of
tiles and tokens intact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dflop.errors import DflopError
from dflop.specs.loading import load_json
from dflop.specs.models import EncoderSpec
from dflop.workload.manifest import read_manifest
from dflop.workload.mixes import MixSpec, mix, synthesize
from dflop.workload.sample import MODALITIES, SampleTable, unique_ids

FORMAT = "dflop.data_profile/1"


def stats(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    v = np.asarray(values, dtype=float)
    return {"mean": round(float(v.mean()), 3), "p50": float(np.percentile(v, 50)),
            "p99": float(np.percentile(v, 99)), "max": float(v.max())}


def _token_edges(max_tokens: float) -> list[float]:
    top = max(2.0, float(max_tokens))
    return [0.0] + [float(2**k) for k in range(3, int(np.ceil(np.log2(top))) + 1)]


@dataclass(frozen=True)
class DataProfile:
    samples: SampleTable
    source: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)

    def _groups(self) -> list[tuple[str, np.ndarray]]:
        out = [(m.value, self.samples.modality == m.code) for m in MODALITIES]
        return [(name, mask) for name, mask in out if mask.any()]

    def summary(self) -> dict[str, Any]:
        """Counts, shares and mean/p50/p99/max of tiles and LLM tokens, per modality and overall."""
        s = self.samples
        n = len(s)
        llm = s.llm_tokens

        def block(mask: np.ndarray) -> dict[str, Any]:
            return {"count": int(mask.sum()), "share": round(float(mask.sum()) / n, 6),
                    "tiles": stats(s.tiles[mask]), "llm_tokens": stats(llm[mask]),
                    "text_tokens_mean": round(float(s.text_tokens[mask].mean()), 3),
                    "image_tokens_mean": round(float(s.image_tokens[mask].mean()), 3)}

        return {"samples": n, "modalities": {name: block(mask) for name, mask in self._groups()},
                "all": block(np.ones(n, dtype=bool))}

    def histograms(self) -> dict[str, Any]:
        s = self.samples
        tile_edges = list(range(0, int(s.tiles.max()) + 2))
        token_edges = _token_edges(s.llm_tokens.max())
        out: dict[str, Any] = {"tiles_edges": tile_edges, "llm_tokens_edges": token_edges}
        for name, mask in self._groups():
            out[name] = {"tiles": np.histogram(s.tiles[mask], bins=tile_edges)[0].tolist(),
                         "llm_tokens": np.histogram(s.llm_tokens[mask], bins=token_edges)[0].tolist()}
        return out

    def sample(self, n: int, rng: np.random.Generator, id_prefix: str = "b") -> SampleTable:
        """``n`` samples drawn with replacement, with fresh ids."""
        rows = rng.integers(0, len(self.samples), size=n)
        return self.samples.take(rows).with_ids([f"{id_prefix}{k}" for k in range(n)])

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "source": self.source, "summary": self.summary(),
                "histograms": self.histograms(), "samples": self.samples.columns()}

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(self.to_json()))
        except OSError as exc:
            raise DflopError(f"{p}: cannot write the data profile ({exc.strerror})") from None
        return p

    @classmethod
    def load(cls, path: str | Path) -> "DataProfile":
        data = load_json(path)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise DflopError(f"{path}: not a dflop data profile (expected format '{FORMAT}')")
        if not isinstance(data.get("samples"), dict):
            raise DflopError(f"{path}: missing key 'samples'")
        table = SampleTable.from_columns(data["samples"], str(path))
        return cls(table.with_ids(unique_ids(table.ids)[0]), data.get("source", {}))

    def check_rule(self, encoder: EncoderSpec, where: str) -> None:
        """Refuse a profile made under another encoder's tiling rule: its tiles are that encoder's
        (a 384-pixel SigLIP tile, a 28-pixel Qwen2-VL token), so its shapes do not carry over. A
        profile that names no rule (made before profiles named theirs) is taken as it is."""
        rule = self.source.get("rule") if isinstance(self.source, dict) else None
        if rule is not None and rule != encoder.rule:
            raise DflopError(f"{where}: made under the {rule} rule (encoder {self.source.get('encoder')}), but the "
                             f"encoder {encoder.name} uses the {encoder.rule} rule; profile the data with it")


def profile_mix(spec: MixSpec | str, samples: int, encoder: EncoderSpec, seed: int = 0) -> DataProfile:
    spec = mix(spec) if isinstance(spec, str) else spec
    table = synthesize(spec, samples, encoder, seed)
    return DataProfile(table, {"kind": "preset", "name": spec.name, "encoder": encoder.name, "rule": encoder.rule,
                               "seed": seed, "description": spec.description, "source": spec.source})


def profile_dataset(path: str | Path, encoder: EncoderSpec, *, format: str = "auto",
                    image_root: str | Path | None = None, video_root: str | Path | None = None,
                    tokenizer: Any = None, skip_bad: bool = False, samples: int | None = None,
                    seed: int = 0) -> DataProfile:
    """The profile of a manifest or dataset list (see :func:`read_manifest`)."""
    report = read_manifest(path, encoder, format=format, image_root=image_root, video_root=video_root,
                           tokenizer=tokenizer, skip_bad=skip_bad, limit=samples, seed=seed)
    return DataProfile(report.samples, {
        "kind": "dataset", "path": str(path), "dataset_kind": report.kind, "encoder": encoder.name,
        "rule": encoder.rule,
        "sources": report.sources, "skipped": report.skipped,
        "skipped_reasons": dict(report.skips.counts.most_common()),
        "skipped_examples": report.problems, "renamed_ids": report.renamed_ids,
        "text_tokens": report.text_tokens, "seed": seed})


def batches(table: SampleTable, global_batch: int, seed: int = 0) -> Iterator[SampleTable]:
    """Global batches in epochs: each epoch a fresh permutation, every sample once per epoch.

    Ids are ``e<epoch>:<original id>``, unique across the stream. A tail smaller
    than a batch is carried into the next epoch's first batch rather than
    dropped, so no sample is ever skipped.
    """
    if global_batch < 1:
        raise DflopError(f"global_batch: must be at least 1, got {global_batch}")
    rng = np.random.default_rng(seed)
    carry: SampleTable | None = None
    epoch = 0
    while True:
        order = rng.permutation(len(table))
        part = table.take(order).with_ids([f"e{epoch}:{i}" for i in table.ids[order]])
        if carry is not None:
            part = SampleTable.concat([carry, part])
        start = 0
        while start + global_batch <= len(part):
            yield part.take(np.arange(start, start + global_batch))
            start += global_batch
        carry = part.take(np.arange(start, len(part))) if start < len(part) else None
        epoch += 1
