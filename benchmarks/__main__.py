"""`python -m benchmarks`: the suite, one row per model and batch size.

For each row it alternates the baseline `jit(jax.grad)` step and the ooojax
step (`--mode`, default auto) in one process, takes medians after warm-up,
and adds the cost model's predicted ratio for this device's spec (simulated)
and the simulator's error against the measured baseline (calibrated costs).
Prints a table; `--write` appends it to benchmarks/RESULTS.md and saves a
plot next to it.

  python -m benchmarks                          # CPU-sized zoo (tiny shapes)
  python -m benchmarks --full --batches 32 64   # full-size models (GPU)
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

import ooojax as ooo
from benchmarks import _report
from benchmarks.step_time import sgd_step
from ooojax._calibrate import time_fn
from ooojax.models import ZOO

DEFAULT = ["mobilenet_v3_small", "densenet121", "resnet50", "bert"]


def row(name: str, batch: int | None, full: bool, mode: str, rounds: int, iters: int) -> dict:
  make, full_kw, tiny_kw = ZOO[name]
  sizes = dict(full_kw if full else tiny_kw)
  if batch is not None:
    sizes["batch"] = batch
  loss_fn, args, kw = make(**sizes)
  base = sgd_step(jax.grad, loss_fn, kw)
  ours = sgd_step(lambda f, **k: ooo.grad(f, mode=mode, **k), loss_fn, kw)
  tb, to = [], []
  for _ in range(rounds):
    tb.append(time_fn(base, args, iters))
    to.append(time_fn(ours, args, iters))
  report = ooo.explain(loss_fn, *args, mode="single_gpu", **kw)
  measured = ooo.calibrate(loss_fn, *args, reps=5, **kw)
  pred = ooo.explain(
    loss_fn, *args, mode="in_order", measured=measured, **kw
  ).schedule.in_order_makespan
  real = time_fn(jax.jit(jax.grad(loss_fn, **kw)), args, 10)
  return dict(
    model=name,
    batch=sizes.get("batch"),
    base=float(np.median(tb)),
    ours=float(np.median(to)),
    sim=report.schedule.predicted_speedup,
    spec=report.schedule.device,
    err=(pred - real) / real,
  )


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks")
  ap.add_argument("--models", nargs="+", default=DEFAULT, choices=list(ZOO))
  ap.add_argument("--batches", nargs="+", type=int, default=[None])
  ap.add_argument("--full", action="store_true", help="full-size models (default: tiny)")
  ap.add_argument("--mode", default="auto", choices=list(ooo.MODES))
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  jobs = [(m, b) for m in a.models for b in a.batches]
  rows = []
  for i, (m, b) in enumerate(jobs):
    print(f"[{i + 1}/{len(jobs)}] {m} batch={b or 'default'} ...", file=sys.stderr, flush=True)
    rows.append(row(m, b, a.full, a.mode, a.rounds, a.iters))
  device = jax.devices()[0].device_kind
  lines = _report.header(f"Suite ({'full' if a.full else 'tiny'} sizes, mode={a.mode})") + [
    f"Measured step times on {device}, baseline and ooojax alternating, median of "
    f"{a.rounds} x {a.iters}. 'simulated ratio' is the cost model's predicted "
    "in-order / scheduled makespan for the two-stream schedule on the spec named "
    "(not measured); 'simulator error' compares the calibrated in-order prediction "
    "with the measured `jit(jax.grad)` time.",
    "",
    "| model | batch | device | baseline ms | ooojax ms | ratio | simulated ratio (spec) | simulator error |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['model']} | {r['batch']} | {device} | {r['base'] * 1e3:.2f} | "
      f"{r['ours'] * 1e3:.2f} | {r['base'] / r['ours']:.3f}x | "
      f"{r['sim']:.3f}x ({r['spec']}) | {100 * r['err']:+.0f}% |"
    )
  _report.emit(lines, a.write)
  if a.write:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    names = [f"{r['model']}\nb{r['batch']}" for r in rows]
    xs = np.arange(len(rows))
    ax.bar(xs - 0.2, [r["base"] / r["ours"] for r in rows], 0.4, label=f"measured ({device})")
    ax.bar(xs + 0.2, [r["sim"] for r in rows], 0.4, label="simulated (cost model)")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xticks(xs, names, fontsize=7)
    ax.set_ylabel("jax.grad time / ooojax time")
    ax.legend(fontsize=7)
    fig.savefig("benchmarks/suite.svg", bbox_inches="tight")


if __name__ == "__main__":
  main()
