"""Per-example keys in the pipeline: a microbatch's rows of the whole batch's split.

A loss that gives each example its own key, `keys = jax.random.split(key,
batch)` then `vmap` over the rows (Equinox's examples, much hand-written JAX),
is traced at one microbatch, where the split has the microbatch's rows: a
split of the microbatch's key, not the rows of the whole batch's. To equal
`jax.value_and_grad` on the whole batch, each scalar key leaf of the batch
gets an extra batch leaf, `split(key, B)` over the whole batch's B rows,
split over microbatches (and data replicas) like any batch array; while the
loss is traced, a split of that very key into the microbatch's row count
reads the extra leaf instead (`passes._compat.splits_replaced`). Any other use
of the key keeps the pipeline's key semantics (folded with the microbatch's
index), as does a split read entry by entry (`keys[i]`: per-layer keys that
happen to be as many as the microbatch's rows; `picked`).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from ooojax.passes import _compat


def key_leaves(b_leaves, scalar) -> tuple[int, ...]:
  """The batch leaves that are scalar typed keys (each gets an extra leaf)."""
  return tuple(
    i
    for i, (x, sc) in enumerate(zip(b_leaves, scalar))
    if sc and jnp.ndim(x) == 0 and jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)
  )


def avals(b_leaves, keys, rows: int) -> list:
  """The extra leaves at one microbatch's `rows`, to trace with."""
  return [jax.ShapeDtypeStruct((rows,), jnp.result_type(b_leaves[i])) for i in keys]


def extra(b_leaves, keys, total: int) -> list:
  """The extra leaves of the whole batch: `split(key, total)` per key leaf."""
  return [jax.random.split(b_leaves[i], total) for i in keys]


def tracing(key_tracers, extra_tracers, rows: int):
  """The context the loss is traced in: a split of one of `key_tracers` into `rows`
  gives its extra leaf."""
  if not key_tracers:
    return contextlib.nullcontext()
  return _compat.splits_replaced({id(k): (rows, e) for k, e in zip(key_tracers, extra_tracers)})


def picked(jaxpr, start: int) -> bool:
  """Whether an extra leaf (`jaxpr.invars[start:]`) is read entry by entry (an
  `unstack` or a one-wide `slice`): keys split as many as the microbatch's rows
  but used one per layer, not one per example; those are traced as written."""
  extra_vars = set(jaxpr.invars[start:])
  return any(
    e.invars
    and isinstance(e.invars[0], _compat.Var)
    and e.invars[0] in extra_vars
    and _compat.key_picks(e)
    for e in jaxpr.eqns
  )
