"""The numerical cost of the opt-in lower-precision gradient reduction (`reduce_dtype`).

nanodo's train step (`tests/nanodo.py`, adamw) on 8 CPU devices under its own sharded
`jax.jit`, with `ooo.value_and_grad(mode="data_parallel")` in f32 (the default) and with
`reduce_dtype=jnp.bfloat16` / `jnp.float16`: the gradient's error against
`jax.value_and_grad` after one step (max abs, and max abs over the leaf's max abs), and
after `--steps` AdamW steps the losses' largest difference and the parameters' error.
CPU numerics (XLA:CPU's reductions); not timed.

  python -m benchmarks.dp_reduce_dtype [--steps 20] [--write]
"""

from __future__ import annotations

import argparse
import functools
import os

SIZES = dict(D=256, H=4, L=128, N=2, V=1024, F=1024)
DEVICES = 8


def _errors(got, ref) -> tuple[float, float]:
  """(max abs error, max over leaves of abs error / the leaf's max abs)."""
  import jax
  import jax.numpy as jnp

  ab = rel = 0.0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    e = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
    ab, rel = max(ab, e), max(rel, e / max(float(jnp.max(jnp.abs(b))), 1e-30))
  return ab, rel


def measure(steps: int = 20) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  import ooojax as ooo
  from tests import nanodo as nd

  cfg = nd.DoConfig(**SIZES, fsdp_enabled=False)
  mesh = nd.mesh(DEVICES)
  shardings, state0 = nd.init_train_state(cfg, mesh)
  data = list(nd.batches(cfg, 2 * DEVICES, steps))
  variants = {
    "jax": jax.value_and_grad,
    "f32": functools.partial(ooo.value_and_grad, mode="data_parallel"),
    "bf16": functools.partial(ooo.value_and_grad, mode="data_parallel", reduce_dtype=jnp.bfloat16),
    "f16": functools.partial(ooo.value_and_grad, mode="data_parallel", reduce_dtype=jnp.float16),
  }

  def grads_of(vg):
    def g(state, batch):
      batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P("data")))
      loss_fn = nd.get_default_loss_fn(batch, state.apply_fn, None)
      return vg(loss_fn, has_aux=True)(state.params)[1]

    return jax.jit(g)

  out: dict = {}
  ref_g = grads_of(variants["jax"])(state0, data[0])
  runs = {}
  for name, vg in variants.items():
    g = grads_of(vg)(state0, data[0]) if name != "jax" else ref_g
    step = nd.make_step(shardings, mesh, value_and_grad=vg)
    state, losses = state0, []
    for b in data:
      state, m = step(state, b)
      losses.append(float(m["loss"]))
    runs[name] = (g, losses, nd.unbox(state.params))
  ref_losses, ref_p = runs["jax"][1], runs["jax"][2]
  for name, (g, losses, p) in runs.items():
    if name == "jax":
      continue
    out[name] = {
      "grad": _errors(g, ref_g),
      "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
      "final_loss": (losses[-1], ref_losses[-1]),
      "params": _errors(p, ref_p),
    }
  out["first_loss"] = ref_losses[0]
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.dp_reduce_dtype",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
  import jax

  from benchmarks import _report

  r = measure(a.steps)
  sizes = ", ".join(f"{k}={v}" for k, v in SIZES.items())
  lines = _report.header("Data parallel: the numerical cost of reduce_dtype")
  lines += [
    f"nanodo ({sizes}, adamw, no FSDP), {DEVICES} CPU devices, jax {jax.__version__}; "
    f"against `jax.value_and_grad` under the same sharded jit (CPU numerics, not timed); "
    f"first loss {r['first_loss']:.6f}:",
    "",
    "| reduce | gradient, 1 step: max abs / max rel error | "
    f"{a.steps} AdamW steps: max loss difference | final loss (jax) | params: max abs / max rel |",
    "|---|---|---|---|---|",
  ]
  for name in ("f32", "bf16", "f16"):
    x = r[name]
    lines.append(
      f"| {name} | {x['grad'][0]:.2e} / {x['grad'][1]:.2e} | {x['loss_diff']:.2e} | "
      f"{x['final_loss'][0]:.6f} ({x['final_loss'][1]:.6f}) | "
      f"{x['params'][0]:.2e} / {x['params'][1]:.2e} |"
    )
  lines.append("")
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
