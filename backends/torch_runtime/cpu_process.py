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

Both kinds of process start from one fork server (``start_method``) that has
imported what they run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
from multiprocessing.util import get_temp_dir
from typing import Any

import torch

from dflop.specs.execution import CPU_THREADS

UNIX_PATH_MAX = 107
"""The longest path a Unix socket address holds (Linux: 108 bytes, the last a NUL)."""
FORK_SERVER_IMPORTS = ("__main__", "torch", "torch.distributed.optim", "torch._dynamo",
                       "dflop.backends.torch_runtime.worker", "dflop.profile.profiler")
"""What the fork server imports once, before it forks any process: the launching script (which a
started process would otherwise import again), torch, a rank's code and a profiling twin's, and what
a rank imports as it builds its optimizer (ZeRO's, and the compiler module torch's optimizers import
on first use): each a second or so a process, on every launch, where the server has not."""
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1
"""The largest threshold mallopt takes (an int): the heap's free top is never given back."""


def start_method(temp_dir: str | None = None) -> str:
    """How dflop starts a CPU process (a rank, a profiling twin): forked from a server that has
    imported ``FORK_SERVER_IMPORTS`` (a process then starts in a fraction of a second), where the
    server's socket, in ``temp_dir`` (multiprocessing's), has a path a Unix socket address holds;
    else (a long TMPDIR) afresh. The server is one per process and imports what it was first told."""
    temp_dir = temp_dir or get_temp_dir()
    if ("forkserver" not in multiprocessing.get_all_start_methods()
            or len(os.path.join(temp_dir, "listener-12345678")) > UNIX_PATH_MAX):
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORK_SERVER_IMPORTS))
    return "forkserver"


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
