"""Kernel parity: what the two-stream program runs beside jax.grad's kernels.

For each zoo model, compiles `jax.grad` and `ooo.grad(mode=...)` for a
compile-only H100 (`ooojax.gpu_hlo`, no GPU needed) and counts the kernels of
each (`passes.hlo.kernels`): the conv/GEMM kernels must be jax.grad's own; the
others are counted with the bytes they write, and the largest differences by
opcode and type are printed. Compile-only: no timings.

  python -m benchmarks.kernel_parity                       # ResNet-50, batch 32
  python -m benchmarks.kernel_parity --models resnet50 mobilenet_v3_small --modes single_gpu in_order
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp

import ooojax as ooo
from ooojax import _hlo_cli, gpu_hlo
from ooojax.passes import cost
from ooojax.passes.hlo import kernels


def _shapes(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), tree)


def parity(name: str, batch: int, modes, top: int = 6) -> list[str]:
  loss, args, kw = _hlo_cli.load_model(name, batch=batch, sizes={})
  args = _shapes(args)
  want = gpu_hlo.schedule(jax.grad(loss, **kw), *args)
  lines = [f"{name} batch {batch}, jax {jax.__version__}, jax.grad: {kernels.kernels(want).n}"]
  for mode in modes:
    # the uncalibrated preset: every window the planner would plan (a shipped H100
    # calibration prices a pinned call at 105 us and plans none at batch 32)
    spec = cost.DEVICE_SPECS["H100"]
    got = gpu_hlo.schedule(ooo.grad(loss, mode=mode, device=spec, **kw), *args)
    p = kernels.compare(got, want)
    k, n = got.heavy_overlap()
    lines.append(f"  {mode}: {p.summary()}; heavy dW calls with dX work inside: {k}/{n}")
    diff = collections.Counter((i.op, i.shape) for i in p.got.other)
    diff.subtract(collections.Counter((i.op, i.shape) for i in p.want.other))
    for (op, shape), c in diff.most_common(top):
      if c > 0:
        lines.append(f"    +{c} {op} {shape[:100]}")
  return lines


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", nargs="+", default=["resnet50"])
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--modes", nargs="+", default=["single_gpu"])
  a = ap.parse_args(argv)
  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    raise SystemExit(f"compile-only GPU unavailable: {reason}")
  for m in a.models:
    print("\n".join(parity(m, a.batch, a.modes)), flush=True)


if __name__ == "__main__":
  main()
