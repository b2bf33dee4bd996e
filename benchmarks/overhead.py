"""Frontend overhead: trace + split + schedule + lower of ooo.grad vs jax.grad.

Both are lowered (not compiled) under jax.jit, alternating in one process,
fresh function objects each time so no trace cache is hit. Prints a markdown
table; `--write` appends it to benchmarks/RESULTS.md.

  python -m benchmarks.overhead [--depths 26 50 101] [--reps 3] [--write]
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import ooojax as ooo
from benchmarks import _report
from benchmarks.models import resnet


def _lower_time(make_grad, loss_fn, args) -> float:
  fresh = lambda *a: loss_fn(*a)  # new identity: no cache shared across reps
  t0 = time.perf_counter()
  jax.jit(make_grad(fresh)).lower(*args)
  return time.perf_counter() - t0


def measure(depth: int, reps: int, mode: str) -> dict:
  loss_fn, args, _ = resnet.make(depth, batch=2, image=64, real_init=False)
  base = lambda f: jax.grad(f, has_aux=True)
  ours = lambda f: ooo.grad(f, has_aux=True, mode=mode, device="H100")
  _lower_time(base, loss_fn, args)  # warm caches of jnp / flax internals
  _lower_time(ours, loss_fn, args)
  tb, to = [], []
  for _ in range(reps):
    tb.append(_lower_time(base, loss_fn, args))
    to.append(_lower_time(ours, loss_fn, args))
  vg = ooo.value_and_grad(loss_fn, has_aux=True, mode=mode, device="H100")
  t0 = time.perf_counter()
  plan, _ = vg.plan(args, {})
  t_plan = time.perf_counter() - t0
  n_eqns = len(plan.split.jaxpr.jaxpr.eqns)
  return dict(depth=depth, mode=mode, eqns=n_eqns, base=float(np.median(tb)),
              ours=float(np.median(to)), plan=t_plan)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--depths", type=int, nargs="+", default=[26, 50, 101])
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--modes", nargs="+", default=["single_gpu", "in_order"])
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  rows = [measure(d, a.reps, m) for d in a.depths for m in a.modes]
  lines = _report.header("Frontend overhead") + [
      "Lower time (trace + split + schedule + emit + MLIR) under `jax.jit(...).lower`, "
      f"ResNet at batch 2, 64x64 images, median of {a.reps}, alternating in one process.",
      "",
      "| model | mode | jaxpr eqns | jax.grad lower s | ooo.grad lower s | ratio | split+schedule s | µs/eqn (ooo) |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(f"| ResNet-{r['depth']} | {r['mode']} | {r['eqns']} | {r['base']:.3f} | "
                 f"{r['ours']:.3f} | {r['ours'] / r['base']:.2f}x | {r['plan']:.3f} | "
                 f"{1e6 * r['ours'] / r['eqns']:.0f} |")
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
