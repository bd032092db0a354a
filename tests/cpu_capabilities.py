"""Prints the ATEN_CPU_CAPABILITY values this CPU can run, lowest first (`make test` runs the numerics
tests under each): torch picks the highest by default, and every lower x86 level runs too."""

import torch

X86_LEVELS = ["default", "avx2", "avx512"]


def capabilities(native: str) -> list[str]:
    native = native.lower()
    return X86_LEVELS[:X86_LEVELS.index(native) + 1] if native in X86_LEVELS else ["default", native]


if __name__ == "__main__":
    print(" ".join(capabilities(torch.backends.cpu.get_cpu_capability())))
