"""Reductions carried into the next forward: `dp.make_train_step(cross_step=True)` replayed.

Each train step is compiled for N compile-only H100s (no GPU runs) twice, planned
for the row's link (`link=`): reducing every gradient in-step (`cross_step=False`)
and carrying some into the next step's forward (`cross_step=True`: the plan's first
k layers, or the last layers the forward reads), each also compiled again with the
link's profile for XLA's latency-hiding scheduler (`ooojax.gpu_hlo.pgle_options`).
`passes.hlo.replay` prices each program on the row's link, at the H100 roofline and
with the shipped H200 calibration. Replayed from compile-only HLO, not timed.
Plain jit's programs do not depend on ooojax: `benchmarks.dp_exposed` has them.

  python -m benchmarks.dp_carried --rows "BERT-large-like|IB400" "nanodo D1024|IB100"
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.dp_exposed import NANODO

DEFAULT_ROWS = ("BERT-large-like|IB400", "nanodo D1024|IB400", "ResNet-50|25GbE")


def _problem(name: str, devices: int, layers: int):
  """(params as ShapeDtypeStructs, loss(params, batch), the global batch, the mesh)."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from ooojax import gpu_hlo

  mesh = gpu_hlo.mesh("H100", devices, ("data",))
  dat = NamedSharding(mesh, P("data"))
  if name == "ResNet-50":
    from ooojax.models import resnet

    loss_fn, (params, stats, x, y), _ = resnet.make(50, batch=2, image=224, real_init=False)
    rows = 32  # per device, as `benchmarks.dp_exposed`

    def loss(p, b):
      # the batch statistics' running averages are left out (a constant state): the
      # step's kernels are the same but for those few small updates
      s = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), stats)
      return loss_fn(p, s, *b)[0]

    batch = (
      jax.ShapeDtypeStruct((rows * devices, *x.shape[1:]), x.dtype, sharding=dat),
      jax.ShapeDtypeStruct((rows * devices,), y.dtype, sharding=dat),
    )
    sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    return jax.tree.map(sds, params), loss, batch, mesh, optax.sgd(0.1, momentum=0.9)
  from tests import nanodo as nd

  sizes, rows = NANODO[name]
  cfg = nd.DoConfig(**sizes, N=layers, fsdp_enabled=False)
  module = nd.TransformerDo(cfg)
  params = jax.eval_shape(
    lambda r: nd.unbox(module.init(r, jnp.ones((1, cfg.L), jnp.int32))["params"]),
    jax.random.PRNGKey(0),
  )

  def loss(p, tokens):
    x, y, w = nd.get_in_out(tokens)
    logits = module.apply({"params": p}, x)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y) * w) / w.sum()

  batch = jax.ShapeDtypeStruct((rows * devices, cfg.L), jnp.int32, sharding=dat)
  return params, loss, batch, mesh, nd.get_optimizer()


def measure(name: str, link: str, cross: bool, devices: int = 8, layers: int = 4) -> dict:
  """One row's step compiled without and with the link's profile, replayed on the link."""
  from ooojax import data_parallel as dp
  from ooojax.gpu_hlo import pgle_options
  from ooojax.passes import calibration
  from ooojax.passes.hlo.replay import get_link, replay

  params, loss, batch, mesh, tx = _problem(name, devices, layers)
  step = dp.make_train_step(
    loss,
    tx,
    mesh,
    axis_name="data",
    cross_step=cross,
    device="H100",
    ordering="none",
    link=get_link(link),
  )
  state = step.abstract_state(params, batch)
  lowered = step.lower(state, batch)
  c = lowered.compile()
  opts = pgle_options(c, devices, link)
  try:
    c_pgle = lowered.compile(compiler_options=opts)
  finally:
    os.unlink(next(iter(opts.values())))
  cal = calibration.load(calibration.SHIPPED / "h200.json")
  p = step.plan
  out = {
    "k": p.first_k if cross else 0,
    "carried": len(step._layout.deferred),
    "carried_buckets": len(step._layout.carried),
    "bucket_MB": p.bucket_bytes / 2**20,
    "plan": (p.cross_step if cross else p.makespan),
  }
  for tag, comp in (("", c), ("pgle ", c_pgle)):
    text = comp.as_text()
    for cal_tag, kw in (("", {}), ("cal ", {"calibration": cal})):
      r = replay(text, devices, link, "H100", **kw)
      out[tag + cal_tag + "step"], out[tag + cal_tag + "exposed"] = r.step, r.exposed
  return out


def _cell(r: dict, tag: str) -> str:
  return f"{r[tag + 'step'] * 1e3:.3f} ({r[tag + 'exposed'] * 1e3:.3f})"


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.dp_carried", description=__doc__)
  ap.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), help="model|link")
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--layers", type=int, default=4)
  a = ap.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  lines = [
    f"Replayed from compile-only HLO, not timed (jax {jax.__version__}, {a.devices} "
    "H100s, planned for the row's link); step (exposed) ms on the row's link:",
    "",
    "| model | link | step | carried (k / leaves / buckets) | bucket MB | plan ms | roofline "
    "| calibrated | roofline, profile | calibrated, profile |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for spec in a.rows:
    name, link = spec.split("|")
    for cross in (False, True):
      r = measure(name, link, cross, a.devices, a.layers)
      lines.append(
        f"| {name} | {link} | {'carried' if cross else 'in-step'} | {r['k']} / "
        f"{r['carried']} / {r['carried_buckets']} | {r['bucket_MB']:.0f} | "
        f"{r['plan'] * 1e3:.3f} | {_cell(r, '')} | {_cell(r, 'cal ')} | "
        f"{_cell(r, 'pgle ')} | {_cell(r, 'pgle cal ')} |"
      )
      print(lines[-1], file=sys.stderr, flush=True)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
