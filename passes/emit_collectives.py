"""emit_collectives: issue each gradient bucket's all-reduce as soon as it is complete.

Contract: `BucketEmitter(plan, split, axis_name, reduce)`; `passes.emit.emit`
calls `emitter.after_unit(name, env)` after each compute unit, and
`emitter.outputs(outs)` swaps the reduced gradients into the flat outputs.

What reaches XLA per bucket: the bucket's gradient leaves flattened into one
buffer per dtype, one `psum` (one all-reduce), a scale by `1/n` for
`reduce="mean"`, and a split back. Two `lax.optimization_barrier` ties keep
the schedule in the compiled program (see `../README.md#data-parallel`):

* **chain**: bucket b+1's inputs pass through a barrier with bucket b's
  reduced buffer, so all-reduce b+1 depends on all-reduce b. XLA's all-reduce
  combiners (CPU and GPU) merge only independent all-reduces, so buckets stay
  apart without any compiler flag, and they run in bucket order.
* **carry**: after issuing bucket b, the values the rest of the backward
  reads pass through a barrier with the reduced buffer of bucket b-1, so the
  remaining backward is scheduled after all-reduce b-1 is done: the
  reductions are interleaved with the backward in the entry computation
  instead of sinking to its end, while all-reduce b stays in flight over the
  next dX segment.
"""
from __future__ import annotations

from collections.abc import Sequence
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

  def __init__(self, plan: CollectivePlan, split: Split, axis_name, reduce: str = "mean",
               carry: bool = True, control_deps: bool = False):
    self.plan = plan
    self.split = split
    self.axis_name = axis_name
    self.reduce = reduce
    self.carry = carry
    self.control_deps = control_deps
    self._by_unit: dict[str, list] = {}
    for b in plan.buckets:
      self._by_unit.setdefault(b.after, []).append(b)
    self._reduced: dict[int, Any] = {}
    self._prev: Any = None       # the last issued bucket's reduced buffers
    self._prev2: Any = None      # the one before (what the carry waits for)
    jaxpr = split.jaxpr.jaxpr
    self._grad_vars = jaxpr.outvars[split.grad_out_start:]
    # Last compute-unit position at which each jaxpr variable is read: the
    # carry barrier only needs the values still to be read.
    order = [a.unit for a in plan.schedule.streams[0]]
    units = {u.name: u for u in plan.schedule.units}
    self._pos = {name: i for i, name in enumerate(order)}
    self._last_read: dict = {}
    for i, name in enumerate(order):
      for k in units[name].eqns:
        for v in jaxpr.eqns[k].invars:
          if isinstance(v, _compat.Var):
            self._last_read[v] = i
    for v in jaxpr.outvars:
      if isinstance(v, _compat.Var):
        self._last_read[v] = len(order)

  def after_unit(self, unit: str, env: dict) -> None:
    for b in self._by_unit.get(unit, ()):
      self._issue(b, env)
      if self.carry:
        self._pin_rest(unit, env)

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
    self._prev2, self._prev = self._prev, reduced_bufs

  def _pin_rest(self, unit: str, env: dict) -> None:
    # The rest of the backward waits for the bucket issued before this one.
    if self._prev2 is None:
      return
    here = self._pos.get(unit, -1)
    live = [v for v, last in self._last_read.items() if last > here and v in env]
    if not live:
      return
    _, vals = jax.lax.optimization_barrier((self._prev2, [env[v] for v in live]))
    for v, x in zip(live, vals):
      env[v] = x
