"""One data-parallel step on one GPU: measured kernel times beside the replay's roofline.

A lent GPU is one device, so a collective there spans one device and times
nothing. What it can record is the compute stream: nanodo's train step
(`tests/nanodo.py`) with `jax.value_and_grad` and with
`ooo.value_and_grad(mode="data_parallel")`, jitted on a one-device mesh, timed
(wall, median) and traced (`benchmarks.gpu_trace`: kernel times per step). The
same compiled program is replayed (`passes.hlo.replay`) twice: on the H100
roofline alone and with the traced kernel times (`measured=`, kernels matched
to instructions by name). `--json PATH` writes the kernel times per variant:
the calibration `replay(..., measured=...)` reads.

  python -m benchmarks.dp_calibrate                  # on the GPU
  python -m benchmarks.dp_calibrate --tiny --steps 2 # CPU dry run (no kernel lines)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax

from benchmarks import _report

SIZES = dict(D=1024, H=8, L=512, N=4, V=32768, F=4096)
TINY = dict(D=64, H=2, L=16, N=1, V=128, F=128)


def _steps(cfg, mesh):
  import ooojax as ooo
  from tests import nanodo as nd

  shardings, state = nd.init_train_state(cfg, mesh)
  # one device: the batch constraint shows no split, so the axis is named
  vg = functools.partial(
    ooo.value_and_grad, mode="data_parallel", ordering="none", axis_name="data"
  )
  steps = {
    "jax.value_and_grad": nd.make_step(shardings, mesh),
    "ooo data_parallel": nd.make_step(shardings, mesh, value_and_grad=vg),
  }
  return steps, state


def main(argv=None):
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.dp_calibrate",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("--tiny", action="store_true")
  ap.add_argument("--rows", type=int, default=4)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  from benchmarks import gpu_trace
  from ooojax.passes.hlo.replay import replay
  from tests import nanodo as nd

  cfg = nd.DoConfig(**(TINY if a.tiny else SIZES), fsdp_enabled=False)
  mesh = nd.mesh(1)
  steps, state = _steps(cfg, mesh)
  batch = nd.batches(cfg, a.rows, 1)[0]
  dev = jax.devices()[0].device_kind
  lines = _report.header("Data parallel on one GPU: kernel times for the replay")
  lines += [
    f"nanodo ({', '.join(f'{k}={v}' for k, v in (TINY if a.tiny else SIZES).items())}, "
    f"{a.rows} rows), {dev}, jax {jax.__version__}, one device (no collective is timed):",
    "",
    "| step | wall ms (median) | device kernels ms | kernels / step | replayed compute ms "
    "(H100 roofline) | replayed with measured kernels ms |",
    "|---|---|---|---|---|---|",
  ]
  record = {}
  for name, step in steps.items():
    text = step.lower(state, batch).compile().as_text()
    jax.block_until_ready(step(state, batch))
    walls = []
    for _ in range(a.steps):
      t0 = time.perf_counter()
      jax.block_until_ready(step(state, batch))
      walls.append(time.perf_counter() - t0)
    _, prof = gpu_trace.trace(step, (state, batch), a.steps)
    s = gpu_trace.summarize(prof, a.steps)
    measured = {}
    if s is not None:  # seconds per launch, by kernel name
      measured = {k: ms / 1e3 / n for k, (n, ms) in s.kernels.items()}
    roof = replay(text, 1, "nvlink", "H100")
    cal = replay(text, 1, "nvlink", "H100", measured)
    record[name] = {"kernels_s": measured, "wall_s": statistics.median(walls)}
    dk = f"{s.kernel:.3f}" if s else "no GPU stream lines"
    per = f"{sum(n for n, _ in s.kernels.values()) / a.steps:.0f}" if s else "-"
    lines.append(
      f"| {name} | {statistics.median(walls) * 1e3:.3f} | {dk} | {per} | "
      f"{roof.compute * 1e3:.3f} ({roof.kernels} kernels) | {cal.compute * 1e3:.3f} |"
    )
    print(lines[-1], flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(record, f)
  _report.emit(lines, False)


if __name__ == "__main__":
  main()
