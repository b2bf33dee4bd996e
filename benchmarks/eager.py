"""Eager per-call cost of ooo.grad vs eager jax.grad on the test models.

Every eager `ooo.grad` call re-traces the function (so Python state it reads
is never stale) and reuses the split and schedule when the new trace has the
same structure; this measures what that costs against eager `jax.grad`
(op-by-op dispatch). Prints a markdown table; `--write` appends it to
benchmarks/RESULTS.md.

  python -m benchmarks.eager [--reps 10] [--write]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import ooojax as ooo
from benchmarks import _report

CASES = ("mlp_case", "cnn_case", "block_case", "tied_lm_case")


def _time(fn, reps: int) -> float:
  jax.block_until_ready(fn())  # warm: dispatch caches, the plan cache
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def measure(case: str, reps: int) -> dict:
  from tests import models

  loss, args = getattr(models, case)()
  has_aux = case == "cnn_case"
  jg = jax.grad(loss, has_aux=has_aux)
  og = ooo.grad(loss, has_aux=has_aux, mode="in_order")
  vg = og._ooo
  t_jax = _time(lambda: jg(*args), reps)
  t_ooo = _time(lambda: og(*args), reps)
  t_plan = _time(lambda: vg.plan(args, {})[0].split.consts, reps)  # trace + reuse, no emit
  n = len(vg.plan(args, {})[0].split.jaxpr.jaxpr.eqns)
  return dict(case=case, eqns=n, jax=t_jax, ooo=t_ooo, plan=t_plan)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  rows = [measure(c, a.reps) for c in CASES]
  lines = _report.header("Eager per-call cost") + [
    f"Eager (no jit) gradient calls on tests/models.py, median of {a.reps} after one warm-up; "
    "ooo.grad in `in_order` mode re-traces every call and reuses the cached split and "
    "schedule (trace + fingerprint = the re-trace column).",
    "",
    "| model | jaxpr eqns | jax.grad ms | ooo.grad ms | ratio | ooo re-trace ms |",
    "|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['case']} | {r['eqns']} | {1e3 * r['jax']:.1f} | {1e3 * r['ooo']:.1f} | "
      f"{r['ooo'] / r['jax']:.2f}x | {1e3 * r['plan']:.1f} |"
    )
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
