"""collectives.emit: issue each gradient bucket's all-reduce as soon as it is complete.

Contract: `BucketEmitter(plan, split, axis_name, reduce)`; `passes.emit.emit`
calls `emitter.after_unit(name, env)` after each compute unit, and
`emitter.outputs(outs)` swaps the reduced gradients into the flat outputs.

What reaches XLA per bucket: the bucket's gradient leaves flattened into one
buffer per dtype, one `psum` (one all-reduce), a scale by `1/n` for
`reduce="mean"`, and a split back; with `reduce_dtype` (`wire`) wider float leaves
are scaled, cast to it for the `psum` and cast back. One tie keeps the buckets apart
and in order (see docs/data-parallel.md): bucket b+1's inputs
pass through a `lax.optimization_barrier` with bucket b's reduced buffer and
take an exact zero computed from it (`_zero_from`), so all-reduce b+1
data-depends on all-reduce b. XLA's all-reduce combiners (CPU and GPU) merge
only independent all-reduces, so buckets stay apart without any compiler flag
and run in bucket order; the backward itself never waits for a reduction (a
slow link delays only the next reduction, not the compute).

The stacked dW of a split backward scan (`plan.loops`) is not bucketed:
`emit` hands each layer's dW slices to `reduce_ys` from inside the skewed
scan's loop (`passes.collectives.loops`). A bucket whose last dW unit was
fused into such a loop (an accumulator's W-scan) is issued once its values
exist.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from ooojax.passes import _compat
from ooojax.passes.collectives import wire
from ooojax.passes.collectives.buckets import early_bytes
from ooojax.passes.collectives.plan import Bucket, CollectivePlan
from ooojax.passes.ir import Kind, Split


def _zero_from(x, dtype):
  """An exact 0 (or -0.0) that data-depends on `x`, NaN/inf safe.

  XLA expands optimization barriers early (into control edges on CPU, away
  on GPU) and all-reduce combiners ignore control edges; a data edge is what
  keeps two all-reduces apart. XLA's algebraic simplifier does not fold a
  float multiply by zero (it cannot prove the other side finite), but it does
  fold `convert(pred) * 0` (into `select(p, 0, 0)`), so the finite value is
  taken with a select: `where(isfinite(x0), x0, 0) * 0`. One scalar op.
  """
  if _typed_sharded(x):  # flattening would reshard it: a (small) reduction instead
    x0 = jnp.sum(x)
  else:
    x0 = jax.lax.index_in_dim(jax.lax.reshape(x, (x.size,)), 0, keepdims=False)  # lax: cheap
  return (jnp.where(jnp.isfinite(x0), x0, 0) * 0).astype(dtype)


def _typed_sharded(x) -> bool:
  """Whether `x`'s type splits a dimension over a mesh axis (explicit sharding)."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return spec is not None and any(e is not None for e in spec)


def reduce_buffers(
  vals, axis_name, reduce: str = "mean", scatter=None, prescale: bool = False, reduce_dtype=None
):
  """One all-reduce per dtype of `vals` flattened together.

  `scatter`: per value, None or the dimension it is reduce-scattered over
  (FSDP: the parameter's sharded dimension); those values go into one
  `psum_scatter` per dtype instead, each coming back as this device's slice.
  Values whose type is sharded over another mesh axis (explicit sharding)
  go into one multi-operand `psum` per dtype, unflattened.
  `prescale`: a mean over several leaves is scaled before the pack (a bucket
  outside loops; in a loop body it would change what XLA overlaps).
  `reduce_dtype`: the dtype wider float leaves are reduced in (`wire`): scaled by
  1/n first (mean), cast, reduced, and cast back to their own dtype.
  Returns `(reduced values, the reduced flat buffers)`.
  """
  scatter = scatter or [None] * len(vals)
  groups: dict = {}
  for j, x in enumerate(vals):
    kind = "scatter" if scatter[j] is not None else "typed" if _typed_sharded(x) else "flat"
    groups.setdefault((wire.wire_dtype(jnp.result_type(x), reduce_dtype), kind), []).append(j)
  out: list = [None] * len(vals)
  bufs = []
  for (wdt, kind), idx in groups.items():
    # cast on the way: the mean's 1/n before the cast (float16's range), back after
    cast = any(jnp.result_type(vals[j]) != wdt for j in idx)
    if kind == "scatter":
      bufs.append(
        _reduce_scatter(vals, idx, scatter, out, axis_name, reduce, wdt if cast else None)
      )
      continue
    if kind == "typed":
      # sharded over other mesh axes in their type (explicit sharding): flattening
      # them together would reshard them; one all-reduce of several operands
      xs = [vals[j] for j in idx]
      if cast:
        xs = [_lower(x, wdt, axis_name, reduce) for x in xs]
      red = jax.lax.psum(xs, axis_name)
      if reduce == "mean" and not cast:
        red = [r / jax.lax.axis_size(axis_name) for r in red]
      for j, r in zip(idx, red):
        out[j] = r.astype(jnp.result_type(vals[j])) if cast else r
      bufs.append(red[0])
      continue
    # lax ops, one split per buffer: fewer equations to trace and lower than
    # jnp's ravel and a slice per leaf
    shapes = [jnp.shape(vals[j]) for j in idx]
    sizes = [math.prod(s) for s in shapes]
    # lax.concatenate inserts no vma casts (jnp's does): vary as the most varying
    vma = [_compat.varying_axes(vals[j]) for j in idx]
    axes = tuple(sorted(frozenset().union(*vma), key=str))
    flat = [
      _compat.to_varying(vals[j], axes) if v != frozenset(axes) else vals[j]
      for j, v in zip(idx, vma)
    ]
    flat = [jax.lax.reshape(x, (n,)) if len(s) != 1 else x for x, s, n in zip(flat, shapes, sizes)]
    # A bucket of several leaves is scaled before the pack, where XLA fuses the
    # scale into the concatenation: after the psum it was a pass of its own over
    # the whole bucket (nanodo D 2048 on H100 x8: 0.6 ms of a 9 ms step, replayed).
    packed = cast or (prescale and reduce == "mean" and len(flat) > 1)
    if cast:
      flat = [_lower(x, wdt, axis_name, reduce) for x in flat]
    elif packed:
      n_dev = jax.lax.axis_size(axis_name)
      flat = [x / jnp.asarray(n_dev, x.dtype) for x in flat]
    buf = flat[0] if len(flat) == 1 else jax.lax.concatenate(flat, 0)
    buf = jax.lax.psum(buf, axis_name)
    if reduce == "mean" and not packed:
      buf = buf / jax.lax.axis_size(axis_name)
    bufs.append(buf)
    parts = jax.lax.split(buf, sizes) if len(idx) > 1 else [buf]
    for j, part, s in zip(idx, parts, shapes):
      if cast:
        part = part.astype(jnp.result_type(vals[j]))
      out[j] = part if len(s) == 1 else jax.lax.reshape(part, s)
  return out, bufs


def _lower(x, dtype, axis_name, reduce):
  """`x` scaled for the mean in its own dtype, then cast to `dtype` (the wire's)."""
  if reduce == "mean":
    x = x / jnp.asarray(jax.lax.axis_size(axis_name), x.dtype)
  return x.astype(dtype)


def _reduce_scatter(vals, idx, scatter, out, axis_name, reduce, wdt=None):
  """One `psum_scatter` of `vals[idx]`, each split over its own dimension.

  Each value's scattered dimension is moved first and the value laid out as
  (n, its slice's size): row i is device i's slice. The rows are joined
  side by side, so one reduce-scatter over rows hands each device the
  slices of all of them. `wdt`: the dtype to reduce in (scaled first, cast
  back after). Returns the (1, total) buffer; fills `out[idx]`.
  """
  n = jax.lax.axis_size(axis_name)
  rows, shapes = [], []
  for j in idx:
    x = jnp.moveaxis(_compat.to_varying(vals[j], axis_name), scatter[j], 0)
    shapes.append((x.shape[0] // n, *x.shape[1:]))
    x = jax.lax.reshape(x, (n, x.size // n))
    rows.append(x if wdt is None else _lower(x, wdt, axis_name, reduce))
  sizes = [r.shape[1] for r in rows]
  buf = rows[0] if len(rows) == 1 else jax.lax.concatenate(rows, 1)
  buf = jax.lax.psum_scatter(buf, axis_name, scatter_dimension=0, tiled=True)
  if reduce == "mean" and wdt is None:
    buf = buf / n
  parts = jax.lax.split(buf, sizes, axis=1) if len(rows) > 1 else [buf]
  for j, part, s in zip(idx, parts, shapes):
    if wdt is not None:
      part = part.astype(jnp.result_type(vals[j]))
    out[j] = jnp.moveaxis(jax.lax.reshape(part, s), 0, scatter[j])
  return buf


def chain_after(prev_bufs, vals):
  """`vals`, made to data-depend on `prev_bufs` (so their all-reduce comes after)."""
  if prev_bufs is None:
    return list(vals)
  # The barrier keeps XLA from seeing through the zero; the zero keeps the
  # data edge on CPU, where barriers become control edges early.
  _, vals = jax.lax.optimization_barrier((prev_bufs, list(vals)))
  vals = list(vals)
  vals[0] = vals[0] + _zero_from(prev_bufs[0], vals[0].dtype)
  return vals


class BucketEmitter:
  """Emits the bucketed reductions of a `CollectivePlan` during `emit`."""

  def __init__(
    self,
    plan: CollectivePlan,
    split: Split,
    axis_name,
    reduce: str = "mean",
    defer: frozenset = frozenset(),
    scatter=None,
    early=None,
    reduce_dtype=None,
  ):
    self.plan = plan
    self.reduce_dtype = reduce_dtype  # the dtype wider float leaves are reduced in (`wire`)
    # `early(value and traced aux leaves) -> them combined over the axis` (`_dp_gspmd`): run
    # before the first bucket and chained ahead of it. Left to the caller after the step,
    # these scalar all-reduces land between two buckets, and as XLA:GPU keeps one
    # collective in flight they force the earlier bucket's done before the backward ends.
    self._early = early
    self._early_out: list | None = None
    self.scatter = dict(scatter or {})  # leaf -> dimension it is reduce-scattered over
    self.defer = frozenset(defer)  # leaves returned unreduced (cross-step overlap)
    self.split = split
    self.axis_name = axis_name
    self.reduce = reduce
    self._by_unit: dict[str, list] = {}
    for b in plan.buckets:
      self._by_unit.setdefault(b.after, []).append(b)
    self._reduced: dict[int, Any] = {}
    self._prev: Any = None  # the last issued bucket's reduced buffers
    self._grad_vars = split.jaxpr.jaxpr.outvars[split.grad_out_start :]
    self._issued: set[int] = set()
    # In-loop leaves by gradient variable (a var shared with a deferred leaf stays out).
    by_var: dict = {}
    for i, v in enumerate(self._grad_vars):
      if isinstance(v, _compat.Var):
        by_var.setdefault(v, []).append(i)
    # a reduce-scattered leaf is reduced once its loop is done (`outputs`)
    loop = getattr(plan, "in_loop", frozenset()) - self.defer - set(self.scatter)
    self._loop_vars = {v: ids for v, ids in by_var.items() if set(ids) <= loop}
    self._loop_done: set[int] = set()
    # what `scan_skew.fuse` looks for first: a backward (dX) scan
    self._may_fuse = any(
      e.primitive.name == "scan" and k is Kind.DX
      for e, k in zip(split.jaxpr.jaxpr.eqns, split.kinds)
    )

  def reads_after(self, unit: str) -> bool:
    """Whether `after_unit(unit, ...)` may read `env` (emission makes its values first)."""
    return bool(self._by_unit.get(unit)) or self._may_fuse

  def after_unit(self, unit: str, env: dict) -> None:
    for b in self._by_unit.get(unit, ()):
      self._issue(b, env)
    # A bucket whose unit was fused into a loop: issue it once its values exist
    # (only a backward scan is fused: without one every unit runs, and checking
    # each bucket after each unit would cost units x buckets).
    if not self._may_fuse:
      return
    for b in self.plan.buckets:
      if b.after and b.index not in self._issued and all(self._available(env, i) for i in b.grads):
        self._issue(b, env)

  def reduce_ys(self, w_eqns, ys: list, in_loop: bool = True) -> list:
    """One layer's W ys (a list per W-scan) with the in-loop gradients all-reduced.

    Called by the skewed scan (`passes.scan.skew`) inside its loop and in its
    epilogue (`in_loop=False`, the last layer): one all-reduce per dtype per
    layer. The epilogue's joins the bucket chain (else XLA's combiner would
    merge it with the bucket issued before the loop, delaying that one);
    inside the loop a tie to an outer reduction would hold the whole loop.
    """
    where, vals = [], []
    for i, w in enumerate(w_eqns):
      nk = _compat.scan_info(w).num_carry
      for j, v in enumerate(w.outvars[nk:]):
        if v in self._loop_vars:  # ys only: an accumulator carry is never reduced here
          where.append((i, j))
          vals.append(ys[i][j])
          self._loop_done.update(self._loop_vars[v])
    if not vals:
      return ys
    if in_loop:
      reduced, _ = reduce_buffers(vals, self.axis_name, self.reduce, reduce_dtype=self.reduce_dtype)
    else:
      reduced, self._prev = reduce_buffers(
        chain_after(self._prev, vals), self.axis_name, self.reduce, reduce_dtype=self.reduce_dtype
      )
    ys = [list(y) for y in ys]
    for (i, j), r in zip(where, reduced):
      ys[i][j] = r
    return ys

  def outputs(self, outs: list, env: dict) -> list:
    """The flat outputs with every gradient replaced by its reduced value (and, with
    `early`, the value and aux leaves by their combined ones)."""
    for b in self.plan.buckets:
      if b.index not in self._issued:
        self._issue(b, env)
    # In-loop leaves whose loop was not fused as planned: reduce them here.
    missed = tuple(i for ids in self._loop_vars.values() for i in ids if i not in self._loop_done)
    missed += tuple(
      sorted((getattr(self.plan, "in_loop", frozenset()) - self.defer) & set(self.scatter))
    )
    if missed:
      self._issue(Bucket(-1, missed, 0, ""), env)
    outs = list(outs)
    start = self.split.grad_out_start
    if self._early is not None:
      if self._early_out is None:  # no bucket issued: combined here
        self._early_out = list(self._early(outs[:start]))
      outs[:start] = self._early_out
    for i, x in self._reduced.items():
      outs[start + i] = x
    return outs

  def _combine_early(self, env) -> None:
    """The value and aux leaves combined (`early`), once, if the forward made them."""
    if self._early is None or self._early_out is not None:
      return
    heads = self.split.jaxpr.jaxpr.outvars[: self.split.grad_out_start]
    if getattr(self.plan, "early", None) is False or early_bytes(self.split) is None:
      # planned after the step, or many or large aux leaves (BatchNorm statistics)
      return
    if not all(isinstance(v, _compat.Literal) or v in env for v in heads):
      return
    vals = [v.val if isinstance(v, _compat.Literal) else env[v] for v in heads]
    self._early_out = list(self._early(vals))
    tied = [
      x
      for x in self._early_out
      if _compat.is_tracer(x) and jnp.issubdtype(x.dtype, jnp.number)  # not a key
    ]
    if tied and self._prev is None:
      # the first bucket's all-reduce after all of them (one exact zero from each)
      tie = sum(_zero_from(x, jnp.float32) for x in tied)
      self._prev = [tie]

  # --- internals ---------------------------------------------------------------
  def _value(self, env, i):
    v = self._grad_vars[i]
    if isinstance(v, _compat.Literal):
      return _compat.to_varying(jnp.asarray(v.val), self.axis_name)
    return env[v]

  def _available(self, env, i) -> bool:
    v = self._grad_vars[i]
    return isinstance(v, _compat.Literal) or v in env

  def _issue(self, bucket, env) -> None:
    self._issued.add(bucket.index)
    grads = tuple(i for i in bucket.grads if i not in self.defer)
    if not grads:
      return
    bucket = dataclasses.replace(bucket, grads=grads)
    self._combine_early(env)
    vals = [self._value(env, i) for i in bucket.grads]
    vals = chain_after(self._prev, vals)  # this all-reduce after the previous one
    reduced, self._prev = reduce_buffers(
      vals,
      self.axis_name,
      self.reduce,
      [self.scatter.get(i) for i in bucket.grads],
      True,
      self.reduce_dtype,
    )
    self._reduced.update(zip(bucket.grads, reduced))
