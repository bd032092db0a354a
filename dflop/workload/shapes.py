"""Entries to sample shapes: the media of every entry collected as columns, then tiled at once.

Reading fills a :class:`ShapeColumns` one entry at a time; the encoder's rules
(:mod:`dflop.workload.vision`) then run vectorised over all images and videos
of a source, and each sample's tiles and tokens are the sum over its media.
"""

from __future__ import annotations

import numpy as np

from dflop.specs.models import TilingSpec
from dflop.workload import vision
from dflop.workload.sample import Modality, SampleTable

TEXT, IMAGE, MULTI_IMAGE, VIDEO = (m.code for m in (Modality.TEXT, Modality.IMAGE, Modality.MULTI_IMAGE,
                                                    Modality.VIDEO))


class ShapeColumns:
    """What one source's samples are made of, row by row."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.text_tokens: list[int] = []
        self.modality: list[int] = []
        self.single = ([], [], [])
        """(row, width, height) of single images."""
        self.multi = ([], [], [], [])
        """(row, width, height, images in the sample) of every image of multi-image samples."""
        self.video = ([], [], [], [], [])
        """(row, frames given, duration given, frames in the header, header fps) of every video."""
        self.copies: dict[int, int] = {}
        """Rows whose media the trainer encodes more than once (a preference pair: twice)."""

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, sample_id: str, text_tokens: int, sizes: list[tuple[int, int]],
            videos: list[tuple[int, float, int, float]], copies: int = 1) -> int:
        """Append one sample whose media are encoded ``copies`` times; returns its row."""
        row = len(self.ids)
        if copies != 1:
            self.copies[row] = copies
        self.ids.append(sample_id)
        self.text_tokens.append(text_tokens)
        n = len(sizes)
        if n == 1:
            rows, widths, heights = self.single
            rows.append(row)
            widths.append(sizes[0][0])
            heights.append(sizes[0][1])
        elif n:
            rows, widths, heights, counts = self.multi
            for w, h in sizes:
                rows.append(row)
                widths.append(w)
                heights.append(h)
                counts.append(n)
        for video in videos:
            for column, value in zip(self.video, (row, *video)):
                column.append(value)
        self.modality.append(VIDEO if videos else IMAGE if n == 1 else MULTI_IMAGE if n else TEXT)
        return row

    def table(self, tiling: TilingSpec, rng: np.random.Generator) -> SampleTable:
        """The samples under ``tiling``; ``rng`` draws frame counts where the rule is random."""
        n = len(self.ids)
        tiles = np.zeros(n, dtype=np.int64)
        tokens = np.zeros(n, dtype=np.int64)

        def add(rows: list[int], part_tiles: np.ndarray, part_tokens: np.ndarray) -> None:
            if rows:
                tiles[:] += np.bincount(rows, part_tiles, n).astype(np.int64)
                tokens[:] += np.bincount(rows, part_tokens, n).astype(np.int64)

        rows, w, h = self.single
        if rows:
            add(rows, *vision.single_images(np.array(w), np.array(h), tiling))
        rows, w, h, count = self.multi
        if rows:
            add(rows, *vision.multi_image_parts(np.array(w), np.array(h), np.array(count), tiling))
        rows = self.video[0]
        if rows:
            add(rows, *vision.videos(self._frames(tiling, rng), tiling))
        if self.copies:
            rows, times = list(self.copies), list(self.copies.values())
            tiles[rows] *= times
            tokens[rows] *= times
        return SampleTable.build(self.ids, np.array(self.modality, dtype=np.int8), tiles, self.text_tokens,
                                 tokens)

    def _frames(self, tiling: TilingSpec, rng: np.random.Generator) -> np.ndarray:
        given = np.array(self.video[1], dtype=np.int64)
        if tiling.scheme == "native":
            return vision.native_frames(given, np.array(self.video[2], dtype=float),
                                        np.array(self.video[3], dtype=np.int64), np.array(self.video[4], dtype=float),
                                        tiling)
        if tiling.video_sampling == "uniform":
            return np.where(given > 0, given, vision.uniform_frames(len(given), tiling, rng))
        duration = vision.video_frames(np.array(self.video[2], dtype=float), tiling)
        header = vision.header_frames(np.array(self.video[3], dtype=np.int64),
                                      np.array(self.video[4], dtype=float), tiling)
        from_header = np.array(self.video[3]) > 0
        return np.where(given > 0, given, np.where(from_header, header, duration))
