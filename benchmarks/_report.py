"""Shared header and output for benchmark tables (device, versions, date, commit)."""

from __future__ import annotations

import datetime
import platform
import subprocess

import jax


def header(title: str) -> list[str]:
  try:
    commit = (
      subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
      ).stdout.strip()
      or "?"
    )
  except OSError:
    commit = "?"
  import jaxlib

  return [
    f"### {title} ({datetime.date.today()}, {jax.devices()[0].device_kind}, "
    f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
    f"Python {platform.python_version()}, commit {commit})",
    "",
  ]


def emit(lines: list[str], write: bool, path: str = "benchmarks/RESULTS.md") -> None:
  text = "\n".join(lines)
  print(text)
  if write:
    with open(path, "a") as f:
      f.write("\n" + text + "\n")


def compile_then_alternate(fns: dict, args, rounds: int, iters: int):
  """Compiles each function once (a failure is a result), then times them
  alternating in one process. Returns ({name: [seconds per round]}, {name: why failed})."""
  import time

  from ooojax._calibrate import time_fn

  fns, failed = dict(fns), {}
  for name, f in list(fns.items()):
    try:
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      print(f"{name}: compiled+ran in {time.perf_counter() - t0:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001 - reported in the table
      failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
      del fns[name]
  times = {k: [] for k in fns}
  for _ in range(rounds):
    for name, f in fns.items():
      times[name].append(time_fn(f, args, iters))
  return times, failed
