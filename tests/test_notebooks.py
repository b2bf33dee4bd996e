"""The notebooks run top to bottom (outputs are stripped in git)."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
  nb = nbformat.read(path, as_version=4)
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
    f"{path.name} has outputs committed; clear them"
  )
  NotebookClient(
    nb,
    timeout=3600,  # per cell, only a hang: a busy machine must not fail a notebook
    startup_timeout=600,  # the kernel's start, likewise
    kernel_name="python3",
    resources={"metadata": {"path": str(path.parent.parent)}},
  ).execute()
  errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors
