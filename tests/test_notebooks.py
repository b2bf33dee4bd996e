"""The notebooks run top to bottom (outputs are stripped in git)."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
  # The kernel compiles at XLA O0, as the correctness tests do: a third less
  # compile time on 2 cores; what the cells assert compares ooojax with jax under
  # the same options. Its figures (the calibration's timings) are not checked here.
  flags = os.environ.get("XLA_FLAGS", "")
  monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_backend_optimization_level=0".strip())
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
