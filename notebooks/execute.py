"""Execute the notebooks top to bottom with nbclient, in this environment's own kernel.

`make notebooks` runs this script: every notebook (or those named) is executed
in a temporary folder and stored with its outputs, so it reads on GitHub as
run. tests/test_notebooks.py executes copies the same way. The kernel is the
``python3`` kernelspec that ipykernel installs into this environment, started
with this interpreter: nothing is registered globally, and a kernelspec of the
same name elsewhere on the machine is never picked up.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

FOLDER = Path(__file__).resolve().parent
TIMEOUT_S = 600
"""Longest a single cell may run."""


def execute(path: Path, cwd: Path) -> nbformat.NotebookNode:
    """The notebook at ``path``, executed with ``cwd`` as its working folder; raises on a failing cell."""
    nb = nbformat.read(path, as_version=4)
    own = KernelSpecManager(kernel_dirs=[str(Path(sys.prefix) / "share" / "jupyter" / "kernels")])
    km = KernelManager(kernel_name="python3", kernel_spec_manager=own)
    NotebookClient(nb, km=km, timeout=TIMEOUT_S, resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def main(names: list[str]) -> None:
    paths = [Path(n) for n in names] or sorted(FOLDER.glob("*.ipynb"))
    for path in paths:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as cwd:
            nb = execute(path, Path(cwd))
        nbformat.write(nb, path)
        print(f"{path.name}: executed in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
