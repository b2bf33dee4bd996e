"""Compiling the explained data-parallel gradient for compile-only GPUs: ooojax's
program (`DataParallelReport.compiled`) and XLA's own (`compile_xla`, plain
`jax.jit(jax.grad)` under GSPMD), on the same placed arguments. Shared by
`data_parallel._explain` and `data_parallel._versus` (kept below both).
"""

from __future__ import annotations

import dataclasses
import html
import os
from typing import Any

import jax

from ooojax.passes.hlo.windows import Window


@dataclasses.dataclass(frozen=True)
class CompiledDataParallel:
  """The all-reduces XLA scheduled for the explained gradient, and what runs inside each."""

  gpu: str
  devices: int
  windows: tuple[Window, ...]
  predicted: int  # all-reduces the plan issues (buckets + loop reductions)
  hlo: Any = dataclasses.field(compare=False, repr=False)  # passes.hlo.schedule.HloSchedule
  text: str = dataclasses.field(default="", compare=False, repr=False)  # the optimized HLO
  temp_bytes: int = 0  # compiled temp memory per device (`memory_analysis()`)

  def summary(self) -> str:
    busy = sum(w.overlapped for w in self.windows)
    lines = [
      f"compiled for {self.gpu} x {self.devices} (compile-only): "
      f"all-reduces: {len(self.windows)} (the plan issues {self.predicted}), {busy} with "
      "conv/GEMM work inside their window"
    ]
    lines += [f"  {w.summary()}" for w in self.windows]
    return "\n".join(lines)

  def __repr__(self) -> str:
    return self.summary()

  def _repr_html_(self) -> str:
    return f"<pre>{html.escape(self.summary())}</pre>"


def placed_args(report, gpu: str, batch_argnums):
  """The explained call's arguments on `plan.n_devices` compile-only `gpu`s: the batch
  arguments' leading axis `n`-fold and split over the axis, the rest replicated.

  Returns `(mesh, rebuild, specs, placed)`: `rebuild(*vals)` puts the placed leaves
  back into the call's argument list."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from ooojax import gpu_hlo
  from ooojax._api import _resolve_argnums

  call = report.call
  if call is None:
    raise ValueError(
      "this DataParallelReport was not made by ooo.explain(fun, *args, "
      "mode='data_parallel', ...), so there is no function to compile"
    )
  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    raise RuntimeError(f"cannot compile for a GPU here: {reason}")
  n, ax = report.plan.n_devices, report.axis_name
  diff = set(_resolve_argnums(call.argnums, len(call.args)))
  batch = (
    tuple(i for i in range(len(call.args)) if i not in diff)
    if batch_argnums is None
    else tuple(_resolve_argnums(batch_argnums, len(call.args)))
  )
  m = gpu_hlo.mesh(gpu, n, (ax,))
  leaves, tree = jax.tree_util.tree_flatten(list(call.args))
  arg_of = [i for i, a in enumerate(call.args) for _ in jax.tree_util.tree_leaves(a)]
  dyn = [k for k, x in enumerate(leaves) if hasattr(x, "shape") and hasattr(x, "dtype")]
  specs = [P(ax) if arg_of[k] in batch and len(leaves[k].shape) else P() for k in dyn]
  placed = [
    jax.ShapeDtypeStruct(
      (leaves[k].shape[0] * n, *leaves[k].shape[1:]) if s != P() else tuple(leaves[k].shape),
      leaves[k].dtype,
      sharding=NamedSharding(m, s),
    )
    for k, s in zip(dyn, specs)
  ]

  def rebuild(*vals):
    full = list(leaves)
    for k, v in zip(dyn, vals):
      full[k] = v
    return jax.tree_util.tree_unflatten(tree, full)

  return m, rebuild, specs, placed


def compile_xla(report, gpu: str, batch_argnums=None, compiler_options=None):
  """XLA's own data-parallel gradient of the explained call: `jax.jit(jax.grad)`
  over the whole batch, sharded on the axis (GSPMD); the `jax.stages.Compiled`."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from ooojax import gpu_hlo

  m, rebuild, _, placed = placed_args(report, gpu, batch_argnums)
  call = report.call
  g = jax.grad(call.fun, call.argnums, call.has_aux)

  def full(*vals):
    out = g(*rebuild(*vals), **call.kwargs)
    return out[0] if call.has_aux else out

  fn = jax.jit(full, out_shardings=NamedSharding(m, P()))
  return gpu_hlo.compiled(fn, *placed, mesh=m, compiler_options=compiler_options)


def compile_dp(
  report, gpu: str, batch_argnums, compiler_options, bucket_bytes=None, pgle=None
) -> CompiledDataParallel:
  from jax.sharding import PartitionSpec as P

  from ooojax import gpu_hlo
  from ooojax._api import grad
  from ooojax.passes.hlo.schedule import parse
  from ooojax.passes.hlo.windows import windows

  if pgle is not None and pgle is not False:
    from ooojax.passes.hlo.replay import get_link

    pgle = get_link(report.plan.link if pgle is True else pgle)  # a bad name fails before compiling
  m, rebuild, specs, placed = placed_args(report, gpu, batch_argnums)
  call, n = report.call, report.plan.n_devices
  opts = {k: v for k, v in call.options.items() if k != "ordering"}
  # bucket size and k as the report planned them; XLA:GPU has no control-dep handler
  bb = report.plan.bucket_bytes if bucket_bytes is None else bucket_bytes
  opts.update(bucket_bytes=max(bb, 1), first_k=report.first_k, ordering="none")
  g = grad(call.fun, call.argnums, call.has_aux, **opts)

  def per_device(*vals):
    out = g(*rebuild(*vals), **call.kwargs)
    return out[0] if call.has_aux else out

  fn = jax.jit(
    jax.shard_map(per_device, mesh=m, in_specs=tuple(specs), out_specs=P(), check_vma=False)
  )
  c = gpu_hlo.compiled(fn, *placed, mesh=m, compiler_options=compiler_options)
  text = c.as_text()
  if pgle is not None and pgle is not False:
    # XLA places each start for its own (NVLink-fast) estimate: compile again with the
    # link model's cost of each collective as its profile (`passes.hlo.pgle`).
    from ooojax.passes.hlo import pgle as _pgle

    prof = _pgle.compiler_options(text, n, pgle)
    try:
      opts2 = {**(compiler_options or {}), **prof}
      c = gpu_hlo.compiled(fn, *placed, mesh=m, compiler_options=opts2)
    finally:
      os.unlink(prof[_pgle.PGLE_OPTION])
    text = c.as_text()
  hlo = parse(text)
  return CompiledDataParallel(
    gpu,
    n,
    windows(hlo, "all-reduce"),
    len(report.plan.buckets) + len(report.plan.loops),
    hlo,
    text,
    int(c.memory_analysis().temp_size_in_bytes),
  )
