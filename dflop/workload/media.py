"""Image and video facts from file headers, and the bounds every size and duration must meet.

Images: Pillow reads the size from the header and decodes nothing. Videos:
PyAV (FFmpeg, which torchvision also uses) reads the container header: the
first video stream's frame count and average frame rate, or its duration when
the container does not count frames. No frame is ever decoded.

Sizes beyond what training could load are errors naming the entry, not
numbers to compute with: an image of more than ``MAX_PIXELS`` pixels (Pillow
refuses to open those as decompression bombs), a video longer than
``MAX_VIDEO_SECONDS`` or with more than ``MAX_VIDEO_FRAMES`` frames, and any
NaN or infinite value.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

from dflop.errors import one_line
from dflop.workload.entries import EntryError

MAX_PIXELS = 2 * 89_478_485
"""Pillow's decompression-bomb limit (twice ``Image.MAX_IMAGE_PIXELS``): it opens nothing larger."""
MAX_VIDEO_SECONDS = 7 * 24 * 3600.0
MAX_VIDEO_FRAMES = 10_000_000
MAX_FPS = 10_000.0


def field_error(where: str, name: str, problem: str) -> EntryError:
    return EntryError(f"{where}: field '{name}': {problem}", f"field '{name}'")


def count(value: Any, where: str, name: str, maximum: float) -> int:
    """A whole number from 1 to ``maximum`` (``3.0`` is 3; NaN, infinities and booleans are not)."""
    if type(value) is int and 1 <= value <= maximum:  # the common case, first
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise field_error(where, name, f"expected a whole number, got {value!r}")
    if not (isinstance(value, int) or (math.isfinite(value) and value.is_integer())) \
            or not 1 <= value <= maximum:
        raise field_error(where, name, f"expected a whole number from 1 to {maximum:g}, got {value!r}")
    return int(value)


def seconds(value: Any, where: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise field_error(where, name, f"expected seconds (a number), got {value!r}")
    if not (math.isfinite(value) and 0 < value <= MAX_VIDEO_SECONDS):
        raise field_error(where, name, f"expected seconds above 0 and at most {MAX_VIDEO_SECONDS:g}, "
                                       f"got {value!r}")
    return float(value)


def check_pixels(width: int, height: int, where: str, what: str) -> tuple[int, int]:
    if width * height > MAX_PIXELS:
        raise EntryError(f"{where}: {what} is {width} x {height} pixels, more than {MAX_PIXELS} (Pillow refuses "
                         "to open such an image as a decompression bomb, so training could not load it)",
                         "image too large")
    return width, height


def require_file(file: Path, where: str, name: str, hint: str) -> None:
    """``hint`` says where relative paths resolve and how to change it."""
    if not file.is_file():
        raise EntryError(f"{where}: field '{name}': file '{one_line(file)}' not found ({hint})", "missing file")


def image_size(file: Path, where: str, name: str, hint: str) -> tuple[int, int]:
    """(width, height) from the image header."""
    require_file(file, where, name, hint)
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(file) as img:
                width, height = img.size
    except Image.DecompressionBombError:
        raise EntryError(f"{where}: field '{name}': the header of '{file}' claims more than {MAX_PIXELS} pixels "
                         "(Pillow refuses to open it as a decompression bomb)", "image too large") from None
    except Exception as exc:  # noqa: BLE001 - Pillow's format plugins raise many types on bad headers
        raise EntryError(f"{where}: field '{name}': cannot read the header of '{file}' ({exc})",
                         "unreadable image") from None
    if width < 1 or height < 1:
        raise EntryError(f"{where}: field '{name}': '{file}' is {width} x {height} pixels", "unreadable image")
    return check_pixels(width, height, where, f"'{file}'")


def video_header(file: Path, where: str, name: str, hint: str) -> tuple[int, float]:
    """(frames, average frames per second) of the first video stream, from the container header."""
    require_file(file, where, name, hint)
    import av

    try:
        with av.open(str(file), metadata_errors="ignore") as container:
            if not container.streams.video:
                raise EntryError(f"{where}: field '{name}': '{file}' has no video stream", "unreadable video")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            frames = stream.frames
            if not frames and rate:
                length = (stream.duration * stream.time_base if stream.duration
                          else Fraction(container.duration or 0, av.time_base))
                frames = round(length * rate)
    except EntryError:
        raise
    except Exception as exc:  # noqa: BLE001 - FFmpeg reports bad containers with many error types
        raise EntryError(f"{where}: field '{name}': cannot read the container header of '{file}' ({exc})",
                         "unreadable video") from None
    fps = float(rate) if rate else math.nan
    if not (math.isfinite(fps) and 0 < fps <= MAX_FPS) or not 1 <= frames <= MAX_VIDEO_FRAMES:
        raise EntryError(f"{where}: field '{name}': the header of '{file}' gives {frames} frames at {fps:g} "
                         f"fps (expected 1 to {MAX_VIDEO_FRAMES} frames at up to {MAX_FPS:g} fps)",
                         "unreadable video")
    return int(frames), fps
