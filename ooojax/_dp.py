"""mode="data_parallel" glue between `ooo.grad` and the collectives passes."""
from __future__ import annotations

import contextlib

import jax

from passes import _compat
from passes import collectives as _collectives
from passes.emit import emit as _emit
from passes.emit_collectives import BucketEmitter


def axis_size(opts) -> int | None:
  """Size of the data-parallel axis (part of the trace key), None in other modes.

  Raises JAX's `NameError` ("unbound axis name") when `axis_name` is not an
  axis of the enclosing `pmap` / `shard_map`.
  """
  if opts.mode != "data_parallel":
    return None
  return int(jax.lax.axis_size(opts.axis_name))


def plan(sp, sched, cm, opts) -> _collectives.CollectivePlan:
  return _collectives.plan(sp, sched, cm, axis_size(opts), opts.link,
                           opts.bucket_bytes, opts.first_k)


def emit(plan, dyn, opts, defer=frozenset(), consume: bool = False) -> list:
  """Re-binds the local gradient jaxpr and issues each bucket's all-reduce early.

  Gradient leaves in `defer` come back unreduced (per device): the cross-step
  train step reduces them at the start of the next step.
  """
  ax = opts.axis_name
  # Traced without vma types, the jaxpr is the per-device gradient; under
  # shard_map(check_vma=True) its inputs must be varying to type-check, which
  # also keeps AD's own psum of replicated parameters out (no double reduction).
  dyn = [_compat.to_varying(x, ax) for x in dyn]
  consts = [_compat.to_varying(x, ax) for x in plan.split.consts]
  emitter = BucketEmitter(plan.collectives, plan.split, ax, opts.reduce, defer)
  # Without vma types (pmap, check_vma=False) no equation needs a cast, and
  # emission may copy equations instead of binding each one.
  checked = any(_compat.varying_axes(x) for x in (*dyn, *consts))
  with _compat.vary_inputs(ax) if checked else contextlib.nullcontext():
    return _emit(plan.split, plan.collectives.schedule, consts, dyn,
                 ordering="none", annotate=False, collectives=emitter, consume=consume)
