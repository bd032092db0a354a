"""How a CPU process that runs a rank, or measures a profile for one, is set up.

Two settings, the same for the backend's ranks and the profiler's processes, so
that a profile prices the steps the way they run:

- ``CPU_THREADS`` torch threads (see ``dflop.specs.execution``);
- freed memory kept in the process. glibc hands a freed block of 128 KiB or
  more back to the system, and trims the top of its heap; a training step frees
  its activations and allocates them again every step, so every step
  page-faults them in anew, most of all a step larger than any before it, and
  a profile measured without those faults would price every step short.
  Keeping freed memory is what a GPU's caching allocator does too.

The settings hold for the rest of the process: glibc has no way to read the
previous ones back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import torch

from dflop.specs.execution import CPU_THREADS

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1
"""The largest threshold mallopt takes (an int): the heap's free top is never given back."""


def _libc(name: str) -> Any:
    """The C library's function ``name``; None where there is no such library or function (not glibc)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Allocate from the heap only and never trim it, so freed blocks are reused, not faulted in again.
    False where the C library has no ``mallopt`` (not glibc): the process then runs as it would."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_bytes() -> tuple[int, int] | None:
    """(bytes of the heap, of them free at its top); None where the C library has no ``mallinfo2``."""
    mallinfo2 = _libc("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.arena, info.keepcost


def grow_heap(factor: float) -> int:
    """Grow a heap that keeps freed memory (``keep_freed_memory``) to ``factor`` times its size, its new
    pages touched (faulted in) and left free; the bytes added (0 where glibc's heap cannot be read).
    Why: a heap that has run one step still grows, step after step, with the holes between the
    blocks that outlive a step, and every page it grows by faults in mid-step; a long run's heap has
    long grown past that. The pages stay the process's for the rest of it. Where the memory is not
    there, nothing is grown: the steps then fault their pages in as they come."""
    before = heap_bytes()
    if before is None:
        return 0
    arena, top_free = before
    block = int(arena * factor) - arena + top_free
    if block <= top_free:
        return 0
    try:
        torch.empty(block, dtype=torch.uint8).fill_(0)  # freed at once, kept as a free chunk to carve from
    except (RuntimeError, MemoryError):
        return 0
    return heap_bytes()[0] - arena


def set_up_cpu_process(threads: int | None = None) -> bool:
    """``threads`` torch threads (None: ``CPU_THREADS``) and freed memory kept; whether memory is kept
    (see ``keep_freed_memory``)."""
    torch.set_num_threads(threads or CPU_THREADS)
    return keep_freed_memory()
