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
