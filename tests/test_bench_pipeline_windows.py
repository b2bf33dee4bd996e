"""benchmarks/pipeline_windows.py: lag-1 windows on a compile-only H100, both option sets."""

import pytest

from benchmarks import pipeline_windows
from ooojax import gpu_hlo


@pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only GPU: {gpu_hlo.unavailable_reason()}",
)
def test_table_rows(capsys):
  pipeline_windows.main(
    ["--only", "ooo:2", "zb-h1:4", "--dim", "128", "--hidden", "256", "--batch", "32"]
  )
  rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| ")][-2:]
  # 2 stages: one permute, hidden by default; 4: two rings, the second by the options
  assert rows == ["| ooo | 2 | 2,048 | 1 | 1 | 1 |", "| zb-h1 | 4 | 2,048 | 2 | 1 | 2 |"]
