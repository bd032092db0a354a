"""Every notebook runs from top to bottom, its own assertions included, and reads as a document."""

import importlib.util
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.processes

FOLDER = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(FOLDER.glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("execute_notebooks", FOLDER / "execute.py")
execute_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute_notebooks)


def images(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})]


def test_the_notebooks_are_there():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "what_if_data_mix", "what_if_scale", "encoder_llm_ratio",
                                           "scheduler_quality", "sensitivity", "fidelity"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_stored_notebook_is_a_document_with_its_outputs(path):
    nb = nbformat.read(path, as_version=4)
    first, code = nb.cells[0], [c for c in nb.cells if c.cell_type == "code"]
    assert first.cell_type == "markdown" and "**Question.**" in first.source
    after_results = nb.cells[nb.cells.index(code[0]) + 1:]
    assert any(c.cell_type == "markdown" for c in after_results), "prose that reads the results"
    assert "assert " in code[-1].source, "the notebook ends by checking its own results"
    assert all(c.execution_count is not None for c in code), "stored without outputs: run `make notebooks`"
    assert images(nb), "at least one figure rendered inline"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]


MEASURES = {"fidelity"}
"""Notebooks that hold measured step and op times against predictions (run alone, see the Makefile)."""


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.alone) if p.stem in MEASURES else p
                                  for p in NOTEBOOKS], ids=[p.stem for p in NOTEBOOKS])
def test_a_notebook_runs_and_writes_nothing_where_it_runs(path, tmp_path):
    nb = execute_notebooks.execute(path, tmp_path)  # raises on any failing cell or assertion
    assert images(nb)
    assert list(tmp_path.iterdir()) == [], "a notebook writes only under a temporary folder"
