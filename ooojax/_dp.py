"""mode="data_parallel" glue between `ooo.grad` and the collectives passes."""

from __future__ import annotations

import contextlib

import jax

from ooojax.passes import _compat
from ooojax.passes.collectives import plan as _collectives
from ooojax.passes.collectives.emit import BucketEmitter
from ooojax.passes.emit import emit as _emit


def axis_size(opts) -> int | None:
  """Size of the data-parallel axis (part of the trace key), None in other modes.

  Raises JAX's `NameError` ("unbound axis name") when `axis_name` is not an
  axis of the enclosing `pmap` / `shard_map`.
  """
  if opts.mode != "data_parallel":
    return None
  return int(jax.lax.axis_size(opts.axis_name))


def traced(trace, opts, args, kwargs):
  """`trace(args, kwargs, vary)` (`ooo.grad`'s tracer), typed for `emit` in data_parallel.

  The per-device gradient is traced with types `emit` can copy as they are:

  * no input varies over the axis (every device holds the same values, or
    no vma types: pmap, `check_vma=False`): the inputs' own, invariant types,
    as `jax.value_and_grad` traces them, if nothing inside varies either
    (`axis_index`, a closed-over sharded value): else AD would reduce the
    replicated parameters' gradients itself;
  * otherwise from leaves made to vary over the axis (`varying_leaf`).

  User code may type a value as invariant where it varies: a scan carry
  initialised with `jnp.zeros` whose body mixes in the sharded batch fails
  to trace from varying leaves, as it does under `jax.grad`. Such a function
  is traced again untyped (no varying axes at all); `emit` then re-binds each
  equation with casts.
  """
  if opts.mode != "data_parallel":
    return trace(args, kwargs)
  axis_size(opts)  # JAX's NameError for an unbound axis, before any cast
  if not any(
    _compat.is_tracer(x) and _compat.varying_axes(x)
    for x in jax.tree_util.tree_leaves((args, kwargs))
  ):
    out = trace(args, kwargs)
    if _compat.invariant_program(out[0]):
      return out
  try:
    return trace(args, kwargs, opts.axis_name)
  except (TypeError, ValueError):
    pass  # retried outside the handler: a real error is reported without this one
  return trace(args, kwargs, None, False)


def varying_leaf(x, axis_name):
  """`(x varying over axis_name, the struct to trace it as)`, or `(x, None)`.

  Traced from varying leaves, the gradient jaxpr is the per-device one, typed
  as `emit` binds it under `shard_map(check_vma=True)`: AD adds no psum of
  replicated parameters, and each equation is copied into the caller's trace
  as it is (`_compat.emit_eqns`), not re-bound with casts.
  """
  if isinstance(x, jax.ShapeDtypeStruct):  # `explain`: shapes only
    return x, None
  x = _compat.to_varying(x, axis_name)
  return x, _compat.shape_dtype(jax.typeof(x))


def plan(sp, sched, cm, opts, loss: bool = False) -> _collectives.CollectivePlan:
  """`loss`: the caller all-reduces the value and aux leaves too (`emit`'s `early`)."""
  return _collectives.plan(
    sp,
    sched,
    cm,
    axis_size(opts),
    opts.link,
    opts.bucket_bytes,
    opts.first_k,
    loss=loss,
    reduce_dtype=opts.reduce_dtype,
  )


def emit(
  plan, dyn, opts, defer=frozenset(), consume: bool = False, scatter=None, early=None
) -> list:
  """Re-binds the local gradient jaxpr and issues each bucket's all-reduce early.

  Gradient leaves in `defer` come back unreduced (per device): the cross-step
  train step reduces them at the start of the next step. Leaves in `scatter`
  (position -> dimension) are reduce-scattered over that dimension (FSDP).
  `early`: combines the value and aux leaves over the axis ahead of the first bucket
  (`passes.collectives.emit.BucketEmitter`).
  """
  ax = opts.axis_name
  invars = plan.split.jaxpr.jaxpr.invars[1:]  # (*consts, *dyn), after the cotangent
  ins = [*plan.split.consts, *dyn]
  # Traced as `traced` does, the jaxpr's types match the values (up to casts
  # to varying): its equations are copied as they are.
  typed = all(_compat.varying_axes(x) <= _compat.varying_axes(v.aval) for x, v in zip(ins, invars))
  if typed:
    ins = [_compat.like_varying(x, v.aval) for x, v in zip(ins, invars)]
  else:
    # Traced without vma types, the jaxpr is the per-device gradient; under
    # shard_map(check_vma=True) its inputs must be varying to type-check (so
    # AD's own psum of replicated parameters stays out), and each equation
    # is re-bound with the casts it needs (slower).
    ins = [_compat.to_varying(x, ax) for x in ins]
  n = len(plan.split.consts)
  emitter = BucketEmitter(
    plan.collectives, plan.split, ax, opts.reduce, defer, scatter, early, opts.reduce_dtype
  )
  with contextlib.nullcontext() if typed else _compat.vary_inputs(ax):
    return _emit(
      plan.split,
      plan.collectives.schedule,
      ins[:n],
      ins[n:],
      ordering="none",
      annotate=False,
      collectives=emitter,
      consume=consume,
    )
