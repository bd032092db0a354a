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

import torch

from dflop.specs.execution import CPU_THREADS

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1
"""The largest threshold mallopt takes (an int): the heap's free top is never given back."""


def keep_freed_memory() -> bool:
    """Allocate from the heap only and never trim it, so freed blocks are reused, not faulted in again.
    False where the C library has no ``mallopt`` (not glibc): the process then runs as it would."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1


def set_up_cpu_process(threads: int | None = None) -> bool:
    """``threads`` torch threads (None: ``CPU_THREADS``) and freed memory kept; whether memory is kept
    (see ``keep_freed_memory``)."""
    torch.set_num_threads(threads or CPU_THREADS)
    return keep_freed_memory()
