"""Shared header and output for benchmark tables (device, versions, date, commit)."""
from __future__ import annotations

import datetime
import platform
import subprocess

import jax


def header(title: str) -> list[str]:
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "?"
  except OSError:
    commit = "?"
  import jaxlib
  return [f"### {title} ({datetime.date.today()}, {jax.devices()[0].device_kind}, "
          f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
          f"Python {platform.python_version()}, commit {commit})", ""]


def emit(lines: list[str], write: bool, path: str = "benchmarks/RESULTS.md") -> None:
  text = "\n".join(lines)
  print(text)
  if write:
    with open(path, "a") as f:
      f.write("\n" + text + "\n")
