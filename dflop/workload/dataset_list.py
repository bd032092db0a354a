"""Dataset lists: the files training recipes are driven by, each naming manifests to read.

LLaVA-NeXT's data YAML (``--data_path x.yaml`` in its ``train.py``)::

    datasets:
      - json_path: llava_ov/si.json
        sampling_strategy: "first:50%"     # all | first:N | end:N | random:N, N a count or P%

``P%`` is ``ceil(P * entries / 100)`` entries; ``random`` shuffles (seeded)
and keeps N. InternVL's meta JSON (``--meta_path``)::

    {"coco": {"root": "data/coco/", "annotation": "coco.jsonl", "repeat_time": 2, "length": 1000}}

``repeat_time`` above 1 (a whole number) repeats the entries; below 1 keeps the
first ``int(entries * repeat_time)``, as InternVL does. ``root`` is where the
source's images and videos are; ``max_dynamic_patch`` overrides the encoder's
tile limit for that source (dynamic tiling only); ``length`` is recorded next to what was read.

Relative manifest paths and roots resolve against the list's folder, or,
when nothing is there, against the working directory (where LLaVA-NeXT and
InternVL resolve them, as their trainers run from the repository root). A
relative ``root`` resolves against ``--image-root`` when that is given.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dflop.errors import ManifestError, SpecError
from dflop.specs.limits import MAX_SAMPLES
from dflop.specs.loading import parse_yaml
from dflop.workload.entries import decode


class Kind(str, Enum):
    MANIFEST = "manifest"
    DATA_YAML = "data-yaml"
    META_JSON = "meta-json"

    @property
    def title(self) -> str:
        return {"manifest": "a manifest", "data-yaml": "a LLaVA-NeXT data YAML (a dataset list)",
                "meta-json": "an InternVL meta JSON (a dataset list)"}[self.value]


STRATEGY = re.compile(r"(first|end|random):(\d+(?:\.\d+)?)(%?)")


@dataclass(frozen=True)
class Repeated:
    """Positions 0..n-1, ``times`` times over, without holding them."""

    n: int
    times: int

    def __len__(self) -> int:
        return self.n * self.times

    def __iter__(self) -> Iterator[int]:
        return (i for _ in range(self.times) for i in range(self.n))


@dataclass(frozen=True)
class Sampling:
    """Which entries of a source are used, and how many times."""

    kind: str = "all"
    """all, first, end, random (LLaVA-NeXT) or repeat (InternVL)."""
    number: float = 0.0
    percent: bool = False

    def __str__(self) -> str:
        if self.kind == "all":
            return "all"
        if self.kind == "repeat":
            return f"repeat_time {self.number:g}"
        return f"{self.kind}:{self.number:g}{'%' if self.percent else ''}"

    def select(self, n: int, rng: np.random.Generator) -> np.ndarray | Repeated:
        """Positions of the entries used, in the order training sees them (repeats unrolled as
        they are read, so that a limit on the samples applies before they are)."""
        if self.kind == "repeat":
            if self.number < 1:
                return np.arange(int(n * self.number))
            return Repeated(n, int(self.number))
        if self.kind == "all":
            return np.arange(n)
        keep = min(n, math.ceil(self.number * n / 100) if self.percent else int(self.number))
        if self.kind == "first":
            return np.arange(keep)
        if self.kind == "end":
            return np.arange(n - keep, n)
        return rng.permutation(n)[:keep]


@dataclass(frozen=True)
class Source:
    """One manifest of a dataset list (or the manifest given alone)."""

    name: str
    manifest: Path
    where: str
    """The list entry that names it (for errors), or the manifest path."""
    root: Path | None = None
    sampling: Sampling = Sampling()
    declared: int | None = None
    max_tiles: int | None = None


def kind_of(path: Path, data: bytes) -> Kind:
    """What a file is: a dataset list by its suffix (``.yaml``) or content (a JSON object of
    sources with ``annotation``), else a manifest."""
    if path.suffix.lower() in (".yaml", ".yml"):
        return Kind.DATA_YAML
    if data.lstrip()[:1] == b"{":
        try:
            value = json.loads(decode(data, path))
        except (ValueError, RecursionError, ManifestError):
            return Kind.MANIFEST  # JSON lines, or a broken file the manifest reader reports
        if isinstance(value, dict) and str(value.get("format", "")).startswith("dflop.data_profile"):
            raise ManifestError(f"{path} is a dflop data profile, not a dataset (a run config takes it as "
                                "data: {profile: ...})")
        if isinstance(value, dict) and any(isinstance(v, dict) and "annotation" in v for v in value.values()):
            return Kind.META_JSON
    return Kind.MANIFEST


def _listed(value: Any, where: str, base: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{where}: expected a path, got {value!r}")
    p = Path(value)
    if p.is_absolute():
        return p
    here = base / p
    return here if here.exists() or not p.exists() else Path.cwd() / p


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ManifestError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _strategy(value: Any, where: str) -> Sampling:
    text = str(value).strip() if isinstance(value, (str, int)) else ""
    if text == "all":
        return Sampling()
    match = STRATEGY.fullmatch(text)
    if not match or (match.group(3) == "" and "." in match.group(2)) or float(match.group(2)) <= 0:
        raise ManifestError(f"{where}: {value!r} is not all, first:N, end:N or random:N "
                            "(N a count or a percentage such as 10%)")
    return Sampling(match.group(1), float(match.group(2)), match.group(3) == "%")


def data_yaml(path: Path, data: bytes) -> list[Source]:
    try:
        doc = parse_yaml(decode(data, path), str(path))  # bounded nesting, no duplicate keys
    except SpecError as exc:
        raise ManifestError(str(exc)) from None
    datasets = doc.get("datasets") if isinstance(doc, dict) else None
    if not isinstance(datasets, list) or not datasets:
        found = f"keys {', '.join(map(str, doc))}" if isinstance(doc, dict) and doc else type(doc).__name__
        raise ManifestError(f"{path}: not a LLaVA-NeXT data YAML (expected a non-empty 'datasets' list, "
                            f"found {found})")
    sources = []
    for i, item in enumerate(datasets):
        where = f"{path}: datasets[{i}]"
        if not isinstance(item, dict):
            raise ManifestError(f"{where}: expected a mapping with 'json_path'")
        manifest = _listed(item.get("json_path"), f"{where}.json_path", path.parent)
        sampling = _strategy(item.get("sampling_strategy", "all"), f"{where}.sampling_strategy")
        sources.append(Source(manifest.name, manifest, f"{where}.json_path", sampling=sampling))
    return sources


def meta_json(path: Path, data: bytes, image_root: Path | None) -> list[Source]:
    sources = []
    for name, item in json.loads(decode(data, path)).items():
        where = f"{path}: {name}"
        if not isinstance(item, dict):
            raise ManifestError(f"{where}: expected an object with 'annotation', got {type(item).__name__}")
        manifest = _listed(item.get("annotation"), f"{where}.annotation", path.parent)
        root = item.get("root")
        if root is not None:  # InternVL joins root and path: an empty root is the folder resolved from
            root = _listed(root or ".", f"{where}.root", image_root or path.parent)
        repeat = _number(item.get("repeat_time", 1), f"{where}.repeat_time")
        if repeat <= 0 or (repeat > 1 and not repeat.is_integer()):
            raise ManifestError(f"{where}.repeat_time: expected a whole number of repeats or a fraction "
                                f"below 1, got {item.get('repeat_time')!r}")
        if repeat > MAX_SAMPLES:
            raise ManifestError(f"{where}.repeat_time: {item['repeat_time']!r} repeats, more than the "
                                f"{MAX_SAMPLES} samples dflop reads from a dataset")
        declared, max_tiles = item.get("length"), item.get("max_dynamic_patch")
        for key, value in (("length", declared), ("max_dynamic_patch", max_tiles)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ManifestError(f"{where}.{key}: expected a whole number of at least 1, got {value!r}")
        sources.append(Source(str(name), manifest, f"{where}.annotation", root,
                              Sampling("repeat", repeat), declared, max_tiles))
    return sources
