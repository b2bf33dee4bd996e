"""A data-parallel shard's aux outputs combined over the data axis (`combine_aux`), and
which of them are sums or the same on every shard."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ooojax.passes import _compat

_PASS_THROUGH = ("convert_element_type", "copy", "copy_p", "reshape", "squeeze")


def sum_outputs(jaxpr, start: int, n: int) -> tuple[bool, ...]:
  """Whether each of `jaxpr`'s outputs start..start+n is computed last by a sum
  (`reduce_sum`, looking through casts and reshapes): a count or total."""
  made = {v: e for e in jaxpr.eqns for v in e.outvars}
  out = []
  for v in jaxpr.outvars[start : start + n]:
    e = made.get(v) if isinstance(v, _compat.Var) else None
    while e is not None and e.primitive.name in _PASS_THROUGH:
      v = e.invars[0]
      e = made.get(v) if isinstance(v, _compat.Var) else None
    out.append(e is not None and e.primitive.name == "reduce_sum")
  return tuple(out)


def combine_aux(x, axis, batch_rows: frozenset, is_sum: bool = False, per_shard: bool = True):
  """One shard's aux leaf combined over the data axis (the same on every device).

  A leaf whose leading dimension is the shard's batch size (per-example
  values) is gathered back to the full batch; a leaf computed last by a sum
  (a token count, a total) and integer leaves are summed; other floating
  leaves are averaged (like the loss); a bool leaf is true where any shard's is.
  A leaf computed from the replicated inputs alone (`per_shard` False: nnx's
  RNG keys and counts carried through) is the same on every device: device 0's.
  """
  if not hasattr(x, "dtype") or not _compat.is_tracer(x):
    return x
  if not per_shard:  # the same on every device: device 0's, made invariant
    return _first_device(x, axis)
  if jnp.issubdtype(x.dtype, jnp.bool_):
    return jax.lax.psum(x.astype(jnp.int32), axis) > 0
  if not jnp.issubdtype(x.dtype, jnp.number):
    raise TypeError(
      f"mode='data_parallel' inside jax.jit cannot combine an aux leaf of "
      f"dtype {x.dtype} over the data axis {axis!r}: return it outside the "
      "differentiated function"
    )
  if x.ndim and x.shape[0] in batch_rows:  # per-example rows: this shard's, in place
    n = jax.lax.axis_size(axis)
    full = jnp.zeros((n * x.shape[0], *x.shape[1:]), x.dtype)
    full = jax.lax.dynamic_update_slice_in_dim(full, x, jax.lax.axis_index(axis) * x.shape[0], 0)
    return jax.lax.psum(full, axis)
  if jnp.issubdtype(x.dtype, jnp.inexact) and not is_sum:
    return jax.lax.pmean(x, axis)
  return jax.lax.psum(x, axis)


def _first_device(x, axis):
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = _first_device(jax.random.key_data(x), axis)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  mine = jax.lax.axis_index(axis) == 0
  if jnp.issubdtype(x.dtype, jnp.bool_):
    return jax.lax.psum(jnp.where(mine, x, False).astype(jnp.int32), axis) > 0
  return jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis)


def _per_shard(closed, split: list, consts: set) -> list:
  """Per output of `closed` (the forward, a ClosedJaxpr), whether it may differ
  between shards: all but those computed from the replicated inputs alone
  (an nnx RNG key or count carried through). An output computed from no input
  may still read the batch's shape (a row count): per shard."""

  def reach(seed) -> set:
    dep = set(seed)
    for e in closed.jaxpr.eqns:
      if any(isinstance(v, _compat.Var) and v in dep for v in e.invars):
        dep.update(e.outvars)
    return dep

  const_vars = list(zip(closed.jaxpr.constvars, closed.consts))
  on_batch = reach(
    [v for v, d in zip(closed.jaxpr.invars, split) if d]
    + [v for v, c in const_vars if id(c) in consts]
  )
  on_replicated = reach([v for v, d in zip(closed.jaxpr.invars, split) if not d])
  return [
    not isinstance(v, _compat.Var) or v in on_batch or v not in on_replicated
    for v in closed.jaxpr.outvars
  ]
