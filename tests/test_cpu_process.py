"""A CPU rank's process keeps the memory it frees (see dflop.backends.torch_runtime.cpu_process):
checked on the resident size of a fresh process, since the setting is the process's for good."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

PROBE = """
import os, sys, torch
from dflop.backends.torch_runtime.cpu_process import set_up_cpu_process
kept = set_up_cpu_process() if sys.argv[1] == "set-up" else False
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
x = torch.ones(64 * 2**20)  # 256 MiB, touched
held = rss()
del x
print(kept, torch.get_num_threads(), (held - rss()) / 2**20)
"""


def freed_mib(how: str) -> tuple[str, int, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "2", "PATH": ""}).stdout.split()
    return out[0], int(out[1]), float(out[2])


def test_a_rank_s_process_keeps_what_it_frees_and_runs_one_thread():
    kept, threads, returned = freed_mib("set-up")
    assert (kept, threads) == ("True", 1)
    assert returned < 16  # the 256 MiB stay resident, to be reused by the next step
    kept, threads, returned = freed_mib("as-is")
    assert (kept, threads) == ("False", 2)
    assert returned > 200  # as glibc does by default: handed back, and faulted in again on reuse


GROWN = """
import resource, sys, torch
from dflop.backends.torch_runtime.cpu_process import grow_heap, heap_bytes, set_up_cpu_process
set_up_cpu_process()
x = torch.ones(32 * 2**20)  # a step's 128 MiB, freed
del x
before = heap_bytes()[0]
added = grow_heap(2.5) if sys.argv[1] == "grown" else 0
after = heap_bytes()[0]
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
y = torch.empty(before + 2**26, dtype=torch.uint8).fill_(1)  # a larger step: 64 MiB more than the heap held
print(before, added, after, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


def heap_after(how: str) -> tuple[int, int, int, int]:
    out = subprocess.run([sys.executable, "-c", GROWN, how], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": ""}).stdout.split()
    return tuple(map(int, out))


def test_a_grown_heap_holds_a_larger_step_without_faulting_its_pages_in():
    """After the warm-up a rank's heap is grown past its size (``grow_heap``): a step that needs more
    than the warm-up did then takes pages already there, where it would fault in every page it adds
    (64 MiB more than the heap held, however much of it was free)."""
    page = 4096
    before, added, after, faults = heap_after("grown")
    assert after >= 2.5 * before - page and added == after - before
    assert faults < 2**20 // page  # under 1 MiB faulted in
    _, _, _, faults = heap_after("as-is")
    assert faults > 2**26 // page  # over 64 MiB: every page past the heap's end
