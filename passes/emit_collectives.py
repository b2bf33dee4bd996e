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

from typing import Any

import jax
import jax.numpy as jnp

from passes import _compat
from passes.collectives import CollectivePlan
from passes.ir import Split


def _zero_from(x, dtype):
  """An exact 0 that data-depends on `x` (NaN/inf safe: a predicate times 0).

  XLA:CPU expands optimization barriers into control edges before its
  all-reduce combiner runs, and the combiner ignores control edges; a data
  edge is what keeps two all-reduces apart there. XLA does not fold a float
  multiply by zero, so this survives to the compiled program (one scalar op).
  """
  x0 = jnp.ravel(x)[0]
  return (x0 != x0).astype(dtype) * jnp.zeros((), dtype)


class BucketEmitter:
  """Emits the bucketed reductions of a `CollectivePlan` during `emit`."""

  def __init__(self, plan: CollectivePlan, split: Split, axis_name, reduce: str = "mean"):
    self.plan = plan
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
    vals = [self._value(env, i) for i in bucket.grads]
    if self._prev is not None:  # chain: this all-reduce after the previous one
      # The barrier keeps XLA from seeing through the zero; the zero keeps the
      # data edge on CPU, where barriers become control edges early.
      _, vals = jax.lax.optimization_barrier((self._prev, vals))
      vals[0] = vals[0] + _zero_from(self._prev[0], vals[0].dtype)
    groups: dict = {}
    for i, x in zip(bucket.grads, vals):
      groups.setdefault(jnp.result_type(x), []).append((i, x))
    reduced_bufs = []
    for items in groups.values():
      flat = [jnp.ravel(x) for _, x in items]
      buf = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
      buf = jax.lax.psum(buf, self.axis_name)
      if self.reduce == "mean":
        buf = buf / jax.lax.axis_size(self.axis_name)
      reduced_bufs.append(buf)
      off = 0
      for i, x in items:
        n = x.size
        self._reduced[i] = buf[off:off + n].reshape(x.shape)
        off += n
    self._prev = reduced_bufs
