"""GPU smoke check: does each ordering compile and match jax.grad on this device?

For each ordering mechanism, compiles `jax.jit(ooo.grad(..., mode="single_gpu"))`
on a small CNN, compares gradients with jax.grad, and reads the compiled HLO:
async stream calls, control edges, and heavy dW calls with a conv/GEMM kernel
between start and done (the overlap the schedule asked for, as XLA compiled it
on this device, autotuning included).
Prints one line per ordering; errors are caught and printed, not raised, so one
unsupported mechanism does not hide the others.
"""

from __future__ import annotations

import argparse
import re
import traceback

import jax
import jax.numpy as jnp
import optax

import ooojax as ooo
from ooojax import demo

ORDERINGS = ("auto", "barriers", "none", "scheduling_group", "control_deps")


def main(argv=None):
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.gpu_check",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--orderings", nargs="+", default=list(ORDERINGS), choices=ORDERINGS)
  a = ap.parse_args(argv)
  model = demo.SmallCNN()
  x, y = demo._data(a.batch)
  v = model.init(jax.random.PRNGKey(0), x)
  _, loss_fn = demo.make_step(jax.grad, model, optax.sgd(0.1))
  args = (v["params"], v["batch_stats"], x, y)
  want = jax.jit(jax.grad(loss_fn, has_aux=True))(*args)[0]
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
  from ooojax.passes.hlo import schedule as hlo_schedule

  for ordering in a.orderings:
    try:
      f = jax.jit(ooo.grad(loss_fn, has_aux=True, mode="single_gpu", ordering=ordering))
      hlo = f.lower(*args).compile().as_text()
      got = f(*args)[0]
      err = max(
        float(jnp.max(jnp.abs(a - b)) / (1 + jnp.max(jnp.abs(b))))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
      )
      edges = sum(len(m.split(",")) for m in re.findall(r"control-predecessors=\{([^}]*)\}", hlo))
      k, n = hlo_schedule.parse(hlo).heavy_overlap()
      print(
        f"ordering={ordering}: ok, rel err {err:.1e}, call-start {hlo.count('call-start')}, "
        f"control edges {edges}, heavy dW calls overlapped {k}/{n}"
      )
    except Exception as e:  # report, keep going
      print(f"ordering={ordering}: FAILED {type(e).__name__}: {str(e)[:300]}")
      traceback.print_exc(limit=3)


if __name__ == "__main__":
  main()
