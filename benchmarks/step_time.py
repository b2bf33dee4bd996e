"""Training-step time of jax.grad vs ooo.grad variants on the current device.

Each variant is a jitted SGD step on the demo's SmallCNN (BatchNorm, has_aux);
variants run alternating in one process, median over rounds. Prints a
markdown table; `--write` appends it to benchmarks/RESULTS.md.

  python -m benchmarks.step_time [--batch 32] [--rounds 5] [--write]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import subprocess

import jax
import numpy as np
import optax

import ooojax as ooo
from ooojax import demo

VARIANTS = {
    "jax.grad": None,
    "ooo auto": {},
    "ooo in_order": {"mode": "in_order"},
    "ooo single_gpu (control_deps)": {"mode": "single_gpu", "ordering": "control_deps"},
    "ooo single_gpu (none)": {"mode": "single_gpu", "ordering": "none"},
}


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  model = demo.SmallCNN()
  x, y = demo._data(a.batch)
  v = model.init(jax.random.PRNGKey(0), x)
  opt = optax.sgd(0.05)
  state = (v["params"], v["batch_stats"], opt.init(v["params"]))
  steps = {}
  for name, kw in VARIANTS.items():
    g = jax.grad if kw is None else (lambda kw: lambda f, **k: ooo.grad(f, **kw, **k))(kw)
    steps[name] = demo.make_step(g, model, opt)[0]
  times = {k: [] for k in steps}
  for _ in range(a.rounds):
    for name, step in steps.items():
      times[name].append(demo._time(step, state, x, y, a.iters))
  med = {k: float(np.median(t)) for k, t in times.items()}
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  lines = [
      f"### Step time, SmallCNN batch {a.batch} ({datetime.date.today()}, "
      f"{jax.devices()[0].device_kind}, jax {jax.__version__}, "
      f"Python {platform.python_version()}, commit {commit})",
      "",
      f"Measured: jitted SGD step, median of {a.rounds} rounds x {a.iters} steps, "
      "variants alternating in one process. Ratio = jax.grad time / variant time "
      "(>1 means faster than jax.grad).",
      "",
      "| variant | step ms | ratio vs jax.grad |",
      "|---|---|---|",
  ]
  for k, t in med.items():
    lines.append(f"| {k} | {t * 1e3:.2f} | {med['jax.grad'] / t:.3f}x |")
  # Simulator check: calibrated per-unit timings -> predicted in-order gradient
  # time, against the measured jax.grad gradient computation alone.
  _, loss_fn = demo.make_step(jax.grad, model, opt)
  args = (v["params"], v["batch_stats"], x, y)
  measured = ooo.calibrate(loss_fn, *args, has_aux=True)
  report = ooo.explain(loss_fn, *args, has_aux=True, mode="in_order", measured=measured)
  from ooojax._calibrate import time_fn
  real = time_fn(jax.jit(jax.grad(loss_fn, has_aux=True)), args, 20)
  pred = report.schedule.in_order_makespan
  lines += [
      "",
      f"Simulator check (same model): calibrated in-order prediction (simulated) "
      f"{pred * 1e3:.2f} ms vs measured `jit(jax.grad)` {real * 1e3:.2f} ms: error "
      f"{100 * (pred - real) / real:+.0f}% ({len(measured)} units timed alone; "
      "per-unit timing misses cross-unit fusion).",
  ]
  text = "\n".join(lines)
  print(text)
  if a.write:
    with open("benchmarks/RESULTS.md", "a") as f:
      f.write("\n" + text + "\n")


if __name__ == "__main__":
  main()
