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
* a key made inside the loss from integers of the batch (`jax.random.key(seed)`,
  `wrap_key_data`): the pipeline gives each microbatch its own key by folding
  the microbatch index into the batch's typed keys, which it cannot do to a
  seed.

Random bits drawn from a typed key of the batch (dropout) are side values like
any other: microbatch m's key is `fold_in(key, m)` (`ooojax.pipeline`), so the
pipeline equals the loss run microbatch by microbatch with those keys.
"""

from __future__ import annotations

import jax
import numpy as np

from ooojax.passes import _compat
from ooojax.passes.pipeline.eqns import evaluate as _evaluate

__all__ = ["PARAMS", "RANDOM", "check", "evaluate_now", "is_key", "per_layer_constant"]

# Primitives that make a key from integers: the pipeline cannot fold a microbatch
# index into them.
_RANDOM_PRIMS = frozenset({"random_seed", "random_wrap", "threefry2x32"})

PARAMS = (
  "{where} reads a per-example value computed from parameters too ({aval}, e.g. "
  "a learned bias indexed by positions); a side input (a mask, positions, "
  "segment ids) is rebuilt on every stage from its microbatch's batch leaves, so "
  "it must depend on the batch alone: compute it from the batch only, or move the "
  "parameter into the layers"
)
RANDOM = (
  "{where} reads random bits of a key made from integers of the batch ({what}); "
  "the pipeline gives microbatch m the key fold_in(key, m) of each typed key in "
  "the batch (jax.random.key), which it cannot do to a seed or raw key data: "
  "pass a typed key (jax.random.key(seed)) in the batch instead"
)


def is_key(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def check(eqns, side_vars, where: str) -> str | None:
  """Why the side values `side_vars` (computed by `eqns` from the batch alone)
  cannot be rebuilt per microbatch, or None if they can."""
  del side_vars  # typed keys are fine: each microbatch gets its own
  for e in eqns:
    if e.primitive.name in _RANDOM_PRIMS:
      return RANDOM.format(where=where, what=f"{e.primitive.name} -> {e.outvars[0].aval}")
  return None


def per_layer_constant(e, value):
  """`(e', v, value)`: the `fold_in(key, data)` equation `e` reading its constant
  `data` from a new variable `v` instead. Flax linen folds a different literal
  (a hash of the module path) into each layer's dropout key, nnx a count it
  increments per draw: with the constant as an input the layers compare equal
  (`passes.pipeline.cut`), and each stage hands its layers their own values
  (`Cut.per_layer`, by the stage's index)."""
  data = e.invars[1]
  v = _compat.new_var(data.aval)
  return e.replace(invars=[e.invars[0], v]), v, np.asarray(value, data.aval.dtype)


def evaluate_now(eqns, consts: dict, var):
  """The concrete value of `var`, computed by `eqns` from constants alone (also
  under an outer `jit` trace)."""
  with jax.ensure_compile_time_eval():
    return _evaluate(eqns, dict(consts), [var])[0]
