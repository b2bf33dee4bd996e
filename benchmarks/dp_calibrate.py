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
  python -m benchmarks.dp_calibrate --fit benchmarks/gpu_runs/2026-11-28-h200 \
      --out ooojax/calibration/h200.json             # any host: the replay's calibration

`--fit` compiles the same one-device steps compile-only for the GPU that ran
(`ooojax.gpu_hlo`) and fits the replay's kernel classes to what it measured
(`passes.calibration`'s `kernel_scale`, `launch_seconds`): memory-bound kernels
matched by instruction name give the "other" factor; the device's kernel total
less those gives the "gemm" factor (cuBLAS kernels carry no instruction name);
the wall step less the kernel total, per kernel, the launch gap.
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
  ap.add_argument("--fit", default=None, help="a GPU run's folder: fit the replay's calibration")
  ap.add_argument("--out", default=None, help="with --fit: write the calibration file here")
  a = ap.parse_args(argv)
  if a.fit:
    return fit_main(a.fit, a.out, a.rows)
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
    if s is not None:  # what `--fit` reads (older files: from the markdown table)
      record[name].update(
        kernel_s=s.kernel / 1e3, kernels=sum(n for n, _ in s.kernels.values()) / a.steps
      )
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


def _step_texts(gpu: str, rows: int) -> dict:
  """The one-device steps `main` times, compiled compile-only for `gpu` (HLO text)."""
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  import ooojax as ooo
  from benchmarks.dp_gspmd import _abstract_state
  from ooojax import gpu_hlo
  from tests import nanodo as nd

  cfg = nd.DoConfig(**SIZES, fsdp_enabled=False)
  mesh = gpu_hlo.mesh(gpu, 1, ("data",))
  shardings, state = _abstract_state(cfg, mesh)
  batch = jax.ShapeDtypeStruct((rows, cfg.L), jnp.int32, sharding=NamedSharding(mesh, P()))
  vg = functools.partial(
    ooo.value_and_grad, mode="data_parallel", ordering="none", axis_name="data"
  )
  steps = {
    "jax.value_and_grad": nd.make_step(shardings, mesh),
    "ooo data_parallel": nd.make_step(shardings, mesh, value_and_grad=vg),
  }
  return {k: gpu_hlo.compiled(f, state, batch, mesh=mesh).as_text() for k, f in steps.items()}


def _table(md: str) -> dict:
  """name -> (wall s, kernel s, kernels per step) from `main`'s markdown table."""
  out = {}
  for line in md.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 6 and cells[0] in ("jax.value_and_grad", "ooo data_parallel"):
      try:
        out[cells[0]] = (float(cells[1]) / 1e3, float(cells[2]) / 1e3, float(cells[3]))
      except ValueError:  # "no GPU stream lines"
        pass
  return out


def fit(works: dict, record: dict) -> dict:
  """The calibration fields from each variant's kernels (`replay.kernel_work`) and what
  the GPU measured (`record[name]`: kernels_s by name, kernel_s, kernels, wall_s)."""
  m_other = w_other = 0.0
  for name, rows in works.items():
    meas = record[name]["kernels_s"]
    for inst, heavy, w in rows:
      key = next((k for k in (inst, inst.replace(".", "_")) if k in meas), None)
      if key is not None and not heavy:
        m_other, w_other = m_other + meas[key], w_other + w
  other = m_other / w_other
  gemm, launch = [], []
  for name, rows in works.items():
    r = record[name]
    g = sum(w for _, h, w in rows if h)
    rest = r["kernel_s"] - other * sum(w for _, h, w in rows if not h)
    gemm.append(rest / g)
    launch.append((r["wall_s"] - r["kernel_s"]) / r["kernels"])
  return {
    "kernel_scale": {"gemm": statistics.mean(gemm), "other": other},
    "launch_seconds": statistics.mean(launch),
  }


def fit_main(run_dir: str, out: str | None, rows: int) -> dict:
  import os

  from ooojax.passes.hlo.replay import kernel_work

  with open(os.path.join(run_dir, "dp_kernels.json")) as f:
    record = json.load(f)
  md = open(os.path.join(run_dir, "dp_calibrate.md")).read()
  gpu = "H200" if "H200" in md else "H100"
  for name, (wall, kern, n) in _table(md).items():
    record[name].setdefault("kernel_s", kern)
    record[name].setdefault("kernels", n)
    record[name].setdefault("wall_s", wall)
  texts = _step_texts(gpu, rows)
  cal = fit({k: kernel_work(t, gpu) for k, t in texts.items()}, record)
  entry = {"format": 1, "device": gpu, "jax": jax.__version__, **cal}
  entry["fitted_by"] = f"benchmarks.dp_calibrate --fit {run_dir} (nanodo D1024, one device)"
  if out and os.path.exists(out):  # the file's other figures (stream-call costs) stay
    with open(out) as f:
      entry = {**json.load(f), **entry}
  text = json.dumps(entry, indent=1)
  print(text)
  if out:
    with open(out, "w") as f:
      f.write(text + "\n")
  return entry


if __name__ == "__main__":
  main()
