"""The pipeline executor's own cost on one device: a one-stage 1F1B table against
the same model accumulated over the same microbatches (`jax.value_and_grad` in a
scan), on this device, alternating in one process. No parallelism and no link:
the ratio is what the executor's ticks, records and per-phase tracing cost.

  python -m benchmarks.executor_cost                        # this device
  python -m benchmarks.executor_cost --also-with xla_gpu_enable_triton_gemm=false
  python -m benchmarks.executor_cost --compile-only H100    # count kernels, run nothing

Besides the times it counts the weight-slice copies in the compiled step: the
stage function indexes each layer's weights out of its stack (`p["w1"][j]`),
and where the backend makes that a copy kernel (XLA:CPU; XLA:GPU before a
Triton GEMM fusion) the executor makes it in F and again in B, where the
accumulated scan's forward and backward share one (XLA's CSE). On the
compile-only H100 with cuBLAS GEMMs the slices fold into the GEMM calls
(dynamic-slice fusion) and no copy is left.
"""

from __future__ import annotations

import argparse
import re

import jax
import numpy as np

import ooojax as ooo
from benchmarks import _mlp_model as model, _report
from ooojax._hlo_cli import parse_kv

_MOVES = ("slice", "dynamic-slice", "bitcast", "copy", "parameter", "reshape", "transpose")


def _op(line: str) -> str | None:
  m = re.search(r"= \S+ ([\w-]+)\(", line)
  return m.group(1) if m else None


def weight_slice_copies(hlo: str, dim: int, hidden: int) -> int:
  """Kernels that only copy out one layer's weight matrix, (dim, hidden) or
  (hidden, dim) with leading 1s: a slice or copy instruction, or a fusion whose
  every instruction moves data (XLA:GPU's `wrapped_slice`, XLA:CPU's
  `slice_bitcast_fusion`), outside fused computations. A GEMM that reads its
  slice in place (a dynamic-slice fusion around a cuBLAS call) has none."""
  bodies: dict[str, list[str]] = {}  # computation -> its instruction lines
  name = None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
    if head:
      name = head.group(1)
      bodies[name] = []
    elif line.startswith("}"):
      name = None
    elif name:
      bodies[name].append(line)
  calls = lambda ln: re.findall(r"calls=%([\w.-]+)", ln)  # noqa: E731
  loops = {"while", "conditional", "call"}  # their computations run kernels of their own
  fused = {c for ls in bodies.values() for ln in ls if _op(ln) not in loops for c in calls(ln)}
  shape = re.compile(rf"= f32\[(?:1,)*(?:{dim},{hidden}|{hidden},{dim})\]\{{")
  n = 0
  for comp, lines in bodies.items():
    for ln in lines if comp not in fused else ():
      op = _op(ln)
      if not shape.search(ln) or op is None:
        continue
      inner = {_op(x) for c in calls(ln) for x in bodies.get(c, ["?"])}
      n += op in ("slice", "dynamic-slice", "copy") or (op == "fusion" and inner <= set(_MOVES))
  return n


def steps(m: int, mesh) -> dict:
  sched = ooo.pipeline.schedule("1f1b", stages=1, microbatches=m)
  ex = ooo.pipeline.value_and_grad(
    model.stage_fn, model.loss_fn, mesh=mesh, axis_name="stage", schedule=sched
  )
  return {f"accumulated/{m}": model.accumulated(m), f"executor/{m}": ex}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--microbatches", type=int, nargs="*", default=[8, 16])
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--hidden", type=int, default=1024)
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--also-with", nargs="*", default=[], metavar="OPTS", help="a=1,b=2 each")
  ap.add_argument("--compile-only", metavar="GPU", help="compile for this GPU; run nothing")
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  option_sets = [("", {})] + [(f" [{o}]", parse_kv(o.split(","))) for o in a.also_with]
  params = model.make_params(1, a.layers, a.dim, a.hidden)
  batch = model.make_batch(a.batch, a.dim)
  if a.compile_only:
    from ooojax import gpu_hlo

    mesh = gpu_hlo.mesh(a.compile_only, 1, ("stage",))
    sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    args = jax.tree.map(sds, (params, batch))
    device = f"compile-only {a.compile_only} (nothing ran)"
  else:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("stage",))
    args = jax.tree.map(jax.numpy.asarray, (params, batch))
    device = jax.devices()[0].device_kind
  fns, copies = {}, {}
  for m in a.microbatches:
    for name, f in steps(m, mesh).items():
      for suffix, opts in option_sets:
        if a.compile_only:
          hlo = gpu_hlo.compile_text(f, *args, gpu=a.compile_only, mesh=mesh, compiler_options=opts)
        else:
          fns[name + suffix] = jax.jit(f).lower(*args).compile(compiler_options=opts)
          hlo = fns[name + suffix].as_text()
        copies[name + suffix] = weight_slice_copies(hlo, a.dim, a.hidden)
  times, failed = _report.compile_then_alternate(fns, args, a.rounds, a.iters)
  lines = _report.header("Pipeline executor's own cost, one device (benchmarks/executor_cost.py)")
  lines += [
    f"Device: {device}. Model: {a.layers} residual blocks x + gelu(LN(x) W1) W2, D={a.dim}, "
    f"H={a.hidden}, batch {a.batch}, float32. The executor runs a one-stage 1F1B table; "
    "the accumulated step is jax.value_and_grad in a scan over the same microbatches. "
    + (
      ""
      if a.compile_only
      else f"Median of {a.rounds} rounds x {a.iters} calls, all variants alternating. "
    )
    + "Weight-slice copies: kernels in the compiled step that copy out one layer's "
    "weight matrix (per loop body where the step loops).",
    "",
    "| step | ms (median) | executor / accumulated | weight-slice copies |",
    "|---|---|---|---|",
  ]
  for key, n in copies.items():
    ms = f"{np.median(times[key]) * 1e3:.2f}" if key in times else failed.get(key, "-")
    acc = key.replace("executor/", "accumulated/")
    ratio = (
      f"{np.median(times[key]) / np.median(times[acc]):.2f}x"
      if key.startswith("executor/") and key in times and acc in times
      else ""
    )
    lines.append(f"| {key} | {ms} | {ratio} | {n} |")
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
