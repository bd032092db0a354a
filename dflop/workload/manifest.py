"""Read a dataset: a manifest, or a dataset list of manifests, into samples.

What is read (see :mod:`dflop.workload.schemas` for the manifest schemas and
:mod:`dflop.workload.dataset_list` for the lists): the kind of file is
detected, or forced with ``format``; every entry becomes one sample whose
tiles and tokens follow the encoder's rules.

Shapes come from the data, not from pixels: an image's size from the entry
(``width``/``height``) or its file header; a video's frames from the entry
(``frames``, or ``duration`` in seconds) or its container header. Image paths
resolve against ``image_root``, else the manifest's folder; video paths
against ``video_root``, else ``image_root``, else the manifest's folder; a
listed source with its own ``root`` uses that for both. A file that an entry
needs and that is not there is an error naming it. An image whose size the
entry gives is never opened, so a manifest reads without its images.

Every sample keeps its identity: its id is the entry's ``id`` (or its position,
``name:position`` in a list); an id seen before gets ``#2``, ``#3``, ... in
reading order, since schedules name samples by id and repeats (InternVL's
``repeat_time``) are real samples too.

A bad entry is an error naming file, line and entry; with ``skip_bad`` it is
skipped and counted by reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dflop.errors import DflopError, ManifestError
from dflop.specs.limits import MAX_SAMPLES, MAX_SIZE
from dflop.specs.models import EncoderSpec, TilingSpec
from dflop.workload import media
from dflop.workload.dataset_list import Kind, Source, data_yaml, kind_of, meta_json
from dflop.workload.entries import EntryError, entries, read_bytes
from dflop.workload.sample import SampleTable, unique_ids
from dflop.workload.schemas import Parsed, Schema, parse
from dflop.workload.shapes import ShapeColumns
from dflop.workload.tokens import TokenCounter, counter, estimate_text_tokens

FORMATS = ("auto", *(s.value for s in Schema), Kind.DATA_YAML.value, Kind.META_JSON.value)
EXAMPLES_PER_REASON = 3
TOKENIZE_CHUNK = 4096


@dataclass
class SkipLog:
    """Entries skipped under ``skip_bad``: a count per reason and the first few of each."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, exc: EntryError) -> None:
        self.counts[exc.reason] += 1
        shown = self.examples.setdefault(exc.reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(str(exc))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def text(self) -> str:
        return ", ".join(f"{n} {reason}" for reason, n in self.counts.most_common())

    def first(self) -> str:
        return next(iter(self.examples.values()))[0]


@dataclass
class ManifestReport:
    samples: SampleTable
    skips: SkipLog = field(default_factory=SkipLog)
    sources: list[dict[str, Any]] = field(default_factory=list)
    """Per source: its manifest, schema, sampling, and the entries listed, chosen, read and skipped."""
    renamed_ids: int = 0
    text_tokens: str = "estimate"
    kind: str = Kind.MANIFEST.value

    @property
    def skipped(self) -> int:
        return self.skips.total

    @property
    def problems(self) -> list[str]:
        return [m for shown in self.skips.examples.values() for m in shown]


@dataclass
class _Context:
    """How the entries of one source are read."""

    tiling: TilingSpec
    image_root: Path
    video_root: Path
    image_hint: str
    video_hint: str


def _roots(source: Source, image_root: Path | None, video_root: Path | None) -> tuple[Path, Path, str, str]:
    if source.root is not None:
        where = f"the root of {source.where.rsplit('.', 1)[0]}"
        images, videos, image_how, video_how = source.root, source.root, where, where
    else:
        folder = source.manifest.parent
        images = image_root or folder
        videos = video_root or image_root or folder
        image_how = "--image-root" if image_root else "the manifest's folder: give --image-root"
        video_how = ("--video-root" if video_root else "--image-root: give --video-root" if image_root
                     else "the manifest's folder: give --video-root")
    return (images, videos,
            f"image paths resolve against {image_how}, or give 'width' and 'height' to read without the images",
            f"video paths resolve against {video_how}, or give 'frames' or 'duration' to read without the videos")


def _sizes(p: Parsed, schema: Schema, ctx: _Context, where: str) -> list[tuple[int, int]]:
    key = schema.file_keys[0]
    names = [key if len(p.images) == 1 else f"{key}[{k}]" for k in range(len(p.images))]
    files = [ctx.image_root / image for image in p.images]
    if len(files) == 1 or ctx.tiling.multi_image == "dynamic":
        return [media.image_size(f, where, n, ctx.image_hint) for f, n in zip(files, names)]
    for f, n in zip(files, names):  # one tile each: the size does not matter, the file does
        media.require_file(f, where, n, ctx.image_hint)
    return [(0, 0)] * len(files)


def _videos(p: Parsed, schema: Schema, ctx: _Context, where: str) -> list[tuple[int, float, int, float]]:
    out = []
    key = schema.file_keys[1]
    for k, video in enumerate(p.videos):
        frames = p.frames[k] if p.frames else 0
        seconds = p.durations[k] if p.durations else 0.0
        header: tuple[int, float] = (0, 0.0)
        if not frames and not seconds:
            name = key if len(p.videos) == 1 else f"{key}[{k}]"
            header = media.video_header(ctx.video_root / video, where, name, ctx.video_hint)
        out.append((frames, seconds, *header))
    return out


class _Reader:
    """Reads sources one after another into shape columns, counting what it skips."""

    def __init__(self, encoder: EncoderSpec, *, schema: Schema | None, image_root: Path | None,
                 video_root: Path | None, tokens: TokenCounter, skip_bad: bool, limit: int | None,
                 seed: int) -> None:
        self.encoder, self.schema, self.tokens = encoder, schema, tokens
        self.image_root, self.video_root = image_root, video_root
        self.skip_bad, self.limit = skip_bad, limit
        self.sampling_rng = np.random.default_rng([seed, 0])
        self.frames_rng = np.random.default_rng([seed, 1])
        self.skips = SkipLog()
        self.read = 0
        self.tables: list[SampleTable] = []
        self.sources: list[dict[str, Any]] = []

    def full(self) -> bool:
        return self.limit is not None and self.read >= self.limit

    def source(self, src: Source, data: bytes, id_prefix: str) -> None:
        """Read one source; an entry without an id is ``id_prefix`` + its position."""
        tiling = self.encoder.tiling
        if src.max_tiles is not None and tiling.scheme == "dynamic":
            tiling = replace(tiling, max_tiles=src.max_tiles)
        roots = _roots(src, self.image_root, self.video_root)
        ctx = _Context(tiling, *roots)
        items = entries(src.manifest, data)
        chosen = src.sampling.select(len(items), self.sampling_rng)
        columns, schemas, pending, skipped = ShapeColumns(), Counter(), [], self.skips.total
        if self.limit is None and len(chosen) + self.read > MAX_SAMPLES:
            raise ManifestError(f"{src.where}: {src.sampling} of {len(items)} entries brings the samples to "
                                f"{len(chosen) + self.read}, more than the {MAX_SAMPLES} dflop reads from a "
                                "dataset (--samples reads fewer)")
        limit = self.limit if self.limit is not None else len(chosen) + self.read
        batched, forced = self.tokens.batched, self.schema
        positions, start = [], self.read
        order = chosen.tolist() if isinstance(chosen, np.ndarray) else chosen  # repeats: unrolled as read
        for k, index in enumerate(order):  # the hot loop: 50k entries take about a second
            if self.read >= limit or (k == len(items) and self.read == start):
                break  # (a pass over every entry read none: the repeats after it would read none either)
            where = items.where(index)
            try:
                raw = items.get(index)
                schema, parsed = parse(raw, where, forced)
                sizes = parsed.sizes if parsed.sizes is not None else _sizes(parsed, schema, ctx, where)
                videos = _videos(parsed, schema, ctx, where) if parsed.videos else []
            except EntryError as exc:
                if not self.skip_bad:
                    raise
                self.skips.add(exc)
                continue
            schemas[schema] += 1
            sample_id = str(parsed.id) if parsed.id is not None else f"{id_prefix}{index}"
            prepared = self.tokens.entry(
                raw, parsed, where, [(ctx.image_root / image, size) for image, size in zip(parsed.images, sizes)],
                [(ctx.video_root / video, info) for video, info in zip(parsed.videos, videos)]) if batched else None
            fed = self.tokens.fed_frames(prepared) if batched else None
            if fed:  # the frames its videos are fed, as given frames: the profile counts what runs
                videos = [(frames, *info[1:]) for frames, info in zip(fed, videos)]
            row = columns.add(sample_id, 0 if batched else estimate_text_tokens(parsed.turns), sizes, videos,
                              parsed.copies)
            positions.append(index)
            if batched:
                pending.append((row, prepared))
                if len(pending) >= TOKENIZE_CHUNK:
                    self._tokenize(columns, pending)
            self.read += 1
        self._tokenize(columns, pending)
        table = self._bounded(columns.table(tiling, self.frames_rng), items, positions) if len(columns) else None
        if table is not None and len(table):
            self.tables.append(table)
        self.sources.append(_source_record(src, items, chosen, schemas, len(table) if table is not None else 0,
                                           self.skips.total - skipped))

    def _bounded(self, table: SampleTable, items: Any, positions: list[int]) -> SampleTable:
        """``table`` without samples larger than any sample may be (``MAX_SIZE`` tiles or tokens, the
        bound a data profile is read back with): each an error naming its entry, or skipped."""
        keep = np.ones(len(table), dtype=bool)
        for name in ("tiles", "text_tokens", "image_tokens"):
            column = getattr(table, name)
            for row in np.flatnonzero(column > MAX_SIZE).tolist():
                exc = EntryError(f"{items.where(positions[row])}: {column[row]} {name.replace('_', ' ')}, more "
                                 f"than the {MAX_SIZE} a sample may have", "too large")
                if not self.skip_bad:
                    raise exc
                if keep[row]:
                    keep[row] = False
                    self.skips.add(exc)
                    self.read -= 1
        return table if keep.all() else table.take(np.flatnonzero(keep))

    def _tokenize(self, columns: ShapeColumns, pending: list[tuple[int, list[str]]]) -> None:
        if pending:
            for (row, _), n in zip(pending, self.tokens.count([turns for _, turns in pending])):
                columns.text_tokens[row] = n
            pending.clear()


def _source_record(src: Source, items: Any, chosen: np.ndarray, schemas: Counter, samples: int,
                   skipped: int) -> dict[str, Any]:
    record = {"name": src.name, "manifest": str(src.manifest),
              "format": "+".join(sorted(s.value for s in schemas)) or "-",
              "sampling": str(src.sampling), "entries": len(items), "chosen": int(len(chosen)),
              "samples": samples, "skipped": skipped}
    if src.root is not None:
        record["root"] = str(src.root)
    if src.declared is not None:
        record["declared_length"] = src.declared
    return record


def _sources(path: Path, data: bytes, fmt: str, image_root: Path | None) -> tuple[Kind, list[Source]]:
    kind = kind_of(path, data)
    if fmt in (Kind.DATA_YAML.value, Kind.META_JSON.value) and kind.value != fmt:
        raise ManifestError(f"{path} is {kind.title}, not {Kind(fmt).title}")
    if fmt not in ("auto", Kind.DATA_YAML.value, Kind.META_JSON.value) and kind is not Kind.MANIFEST:
        raise ManifestError(f"{path} is {kind.title}, not a {fmt} manifest: leave out --format (or give "
                            f"--format {kind.value})")
    if kind is Kind.DATA_YAML:
        return kind, data_yaml(path, data)
    if kind is Kind.META_JSON:
        return kind, meta_json(path, data, image_root)
    return kind, [Source(path.stem, path, str(path))]


def _listed_bytes(src: Source, list_path: Path) -> bytes:
    try:
        data = read_bytes(src.manifest)
    except ManifestError as exc:
        raise ManifestError(f"{src.where}: {exc} (relative paths resolve against the list's folder "
                            f"{list_path.parent}, then the working directory)") from None
    kind = kind_of(src.manifest, data)
    if kind is not Kind.MANIFEST:
        raise ManifestError(f"{src.where}: '{src.manifest}' is {kind.title}, not a manifest "
                            "(dataset lists do not nest)")
    return data


def read_manifest(path: str | Path, encoder: EncoderSpec, *, format: str = "auto",
                  image_root: str | Path | None = None, video_root: str | Path | None = None,
                  tokenizer: Any = None, skip_bad: bool = False, limit: int | None = None,
                  seed: int = 0) -> ManifestReport:
    """Samples of a manifest or dataset list, tiled and tokenised by ``encoder``'s rules.

    ``format`` is ``auto`` (detected per entry), a manifest schema (``llava``, ``sharegpt``,
    ``internvl``, ``content-list``, ``minicpm-v``, ``mantis``, ``preference``) or a list kind
    (``data-yaml``, ``meta-json``); ``tokenizer`` a ``tokenizer.json`` path, a TokenCounter or
    anything with ``encode``; ``limit`` caps the samples read; ``seed`` drives ``random:N``
    sampling and InternVL's frame draws.
    """
    if format not in FORMATS:
        raise DflopError(f"format: {format!r} is not one of {', '.join(FORMATS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise DflopError(f"seed: must be a whole number of at least 0, got {seed!r}")
    path = Path(path)
    data = read_bytes(path)
    kind, sources = _sources(path, data, format, Path(image_root) if image_root is not None else None)
    reader = _Reader(encoder, schema=Schema(format) if format in {s.value for s in Schema} else None,
                     image_root=Path(image_root) if image_root is not None else None,
                     video_root=Path(video_root) if video_root is not None else None,
                     tokens=counter(tokenizer), skip_bad=skip_bad, limit=limit, seed=seed)
    for src in sources:
        if reader.full():
            break
        listed = kind is not Kind.MANIFEST
        reader.source(src, _listed_bytes(src, path) if listed else data, f"{src.name}:" if listed else "")
    if not reader.tables:
        skipped = reader.skips
        detail = f" ({skipped.total} skipped: {skipped.text()}; first: {skipped.first()})" if skipped.total else ""
        raise ManifestError(f"{path}: no readable entries{detail}")
    table = SampleTable.concat(reader.tables)
    ids, renamed = unique_ids(table.ids)
    return ManifestReport(table.with_ids(ids), reader.skips, reader.sources, renamed, reader.tokens.name,
                          kind.value)

