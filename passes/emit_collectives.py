"""emit_collectives: issue each gradient bucket's all-reduce as soon as it is complete.

Contract: `BucketEmitter(plan, split, axis_name, reduce)`; `passes.emit.emit`
calls `emitter.after_unit(name, env)` after each compute unit, and
`emitter.outputs(outs)` swaps the reduced gradients into the flat outputs.

What reaches XLA per bucket: the bucket's gradient leaves flattened into one
buffer per dtype, one `psum` (one all-reduce), a scale by `1/n` for
`reduce="mean"`, and a split back. One tie keeps the buckets apart
and in order (see the README's "Data parallel" section): bucket b+1's inputs
pass through a `lax.optimization_barrier` with bucket b's reduced buffer and
take an exact zero computed from it (`_zero_from`), so all-reduce b+1
data-depends on all-reduce b. XLA's all-reduce combiners (CPU and GPU) merge
only independent all-reduces, so buckets stay apart without any compiler flag
and run in bucket order; the backward itself never waits for a reduction (a
slow link delays only the next reduction, not the compute).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from passes import _compat
from passes.collectives import CollectivePlan
from passes.ir import Split


def _zero_from(x, dtype):
  """An exact 0 (or -0.0) that data-depends on `x`, NaN/inf safe.

  XLA expands optimization barriers early (into control edges on CPU, away
  on GPU) and all-reduce combiners ignore control edges; a data edge is what
  keeps two all-reduces apart. XLA's algebraic simplifier does not fold a
  float multiply by zero (it cannot prove the other side finite), but it does
  fold `convert(pred) * 0` (into `select(p, 0, 0)`), so the finite value is
  taken with a select: `where(isfinite(x0), x0, 0) * 0`. One scalar op.
  """
  x0 = jnp.ravel(x)[0]
  return (jnp.where(jnp.isfinite(x0), x0, 0) * 0).astype(dtype)


def reduce_buffers(vals, axis_name, reduce: str = "mean"):
  """One all-reduce per dtype of `vals` flattened together.

  Returns `(reduced values shaped like vals, the reduced flat buffers)`.
  """
  groups: dict = {}
  for j, x in enumerate(vals):
    groups.setdefault(jnp.result_type(x), []).append(j)
  out: list = [None] * len(vals)
  bufs = []
  for idx in groups.values():
    flat = [jnp.ravel(vals[j]) for j in idx]
    buf = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
    buf = jax.lax.psum(buf, axis_name)
    if reduce == "mean":
      buf = buf / jax.lax.axis_size(axis_name)
    bufs.append(buf)
    off = 0
    for j in idx:
      n = vals[j].size
      out[j] = buf[off:off + n].reshape(vals[j].shape)
      off += n
  return out, bufs


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

  def __init__(self, plan: CollectivePlan, split: Split, axis_name, reduce: str = "mean",
               defer: frozenset = frozenset()):
    self.plan = plan
    self.defer = frozenset(defer)  # leaves returned unreduced (cross-step overlap)
    self.split = split
    self.axis_name = axis_name
    self.reduce = reduce
    self._by_unit: dict[str, list] = {}
    for b in plan.buckets:
      self._by_unit.setdefault(b.after, []).append(b)
    self._reduced: dict[int, Any] = {}
    self._prev: Any = None       # the last issued bucket's reduced buffers
    self._grad_vars = split.jaxpr.jaxpr.outvars[split.grad_out_start:]

  def after_unit(self, unit: str, env: dict) -> None:
    for b in self._by_unit.get(unit, ()):
      self._issue(b, env)

  def outputs(self, outs: list, env: dict) -> list:
    """The flat outputs with every gradient replaced by its reduced value."""
    for b in self._by_unit.get("", ()):
      self._issue(b, env)
    outs = list(outs)
    start = self.split.grad_out_start
    for i, x in self._reduced.items():
      outs[start + i] = x
    return outs

  # --- internals ---------------------------------------------------------------
  def _value(self, env, i):
    v = self._grad_vars[i]
    if isinstance(v, _compat.Literal):
      return _compat.to_varying(jnp.asarray(v.val), self.axis_name)
    return env[v]

  def _issue(self, bucket, env) -> None:
    grads = tuple(i for i in bucket.grads if i not in self.defer)
    if not grads:
      return
    bucket = dataclasses.replace(bucket, grads=grads)
    vals = [self._value(env, i) for i in bucket.grads]
    vals = chain_after(self._prev, vals)  # this all-reduce after the previous one
    reduced, self._prev = reduce_buffers(vals, self.axis_name, self.reduce)
    self._reduced.update(zip(bucket.grads, reduced))
