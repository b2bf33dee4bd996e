"""pipeline.side: per-example values a stack's layers read besides the activation.

Contract: `check(eqns, vars, where) -> str | None` (why the side slice `eqns`,
computing the side values `vars`, cannot be rebuilt per microbatch), and
`PARAMS` / `RANDOM` (the messages `passes.pipeline.cut` raises).

A padding mask built from the tokens, segment ids, positions: values of the
batch alone that every layer reads. Automatic cutting does not pass them
between stages: every device already holds the step's batch (the executor's
`shard_map` replicates it), so the stage running microbatch m rebuilds them
from m's batch leaves (the batch-only backward slice of what the layers read),
with no extra communication; they are not differentiated. Two kinds stay
refused:

* a value computed from parameters too (a learned bias indexed by positions):
  a stage would need the weights of another stage's layers;
* random bits drawn from a key in the batch (dropout): bits drawn for a
  microbatch's shape differ from those drawn for the whole batch, so no
  pipeline can reproduce `jax.grad` of the loss on the whole batch.
"""

from __future__ import annotations

import jax

from ooojax.passes import _compat

__all__ = ["PARAMS", "RANDOM", "check"]

# Primitives that turn a key into bits (or a new key): their result depends on the
# shape drawn, which a microbatch changes.
_RANDOM_PRIMS = frozenset(
  {
    "random_bits",
    "random_seed",
    "random_wrap",
    "random_unwrap",
    "random_split",
    "random_fold_in",
    "threefry2x32",
  }
)

PARAMS = (
  "{where} reads a per-example value computed from parameters too ({aval}, e.g. "
  "a learned bias indexed by positions); a side input (a mask, positions, "
  "segment ids) is rebuilt on every stage from its microbatch's batch leaves, so "
  "it must depend on the batch alone: compute it from the batch only, or move the "
  "parameter into the layers"
)
RANDOM = (
  "{where} reads random bits drawn from a key in the batch ({what}, e.g. "
  "dropout): bits drawn for a microbatch differ from those drawn for the whole "
  "batch, so no pipeline can match jax.grad of the loss; cut it with dropout off "
  "(deterministic=True), or draw the bits inside an explicit stage_fn"
)


def _is_key(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def check(eqns, side_vars, where: str) -> str | None:
  """Why the side values `side_vars` (computed by `eqns` from the batch alone)
  cannot be rebuilt per microbatch, or None if they can."""
  for v in side_vars:
    if isinstance(v, _compat.Var) and _is_key(v.aval):
      return RANDOM.format(where=where, what=f"a key {v.aval}")
  for e in eqns:
    if e.primitive.name in _RANDOM_PRIMS or any(
      isinstance(v, _compat.Var) and _is_key(v.aval) for v in e.invars
    ):
      return RANDOM.format(where=where, what=f"{e.primitive.name} -> {e.outvars[0].aval}")
  return None
