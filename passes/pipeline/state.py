"""pipeline.state: model state that travels with a stack's layers (BatchNorm statistics).

Contract: `emit(x, probes, news) -> x`, and `columns(rows, counts)` /
`rows_of(columns, counts)` (a stack's per-layer leaves laid out by virtual
stage and back). Read by `passes.pipeline.cut`.

A loss that takes a mutable collection (flax's `mutable=["batch_stats"]`)
reads, in each layer, that layer's running statistics, and returns the
updated ones (in its aux). GPipe's answer is per-microbatch statistics: each
microbatch normalises with its own, and the updated collection is the mean
over microbatches of each microbatch's update (the microbatch loop, its aux
averaged). The layer's state leaves travel with the layer like its
parameters, stacked by stage and not differentiated.

The updated leaves leave a layer by the only per-layer channel the executor
has back from every stage, the gradient accumulation: each layer gets one
zero "probe" leaf per updated leaf, and `emit` is the identity on the
activation whose backward hands the probe the updated value (the activation's
cotangent passes through unchanged). The executor sums the probes' "gradients"
over microbatches (and averages them over data replicas), so their sum
divided by the microbatches is the mean update, on every schedule, one-step,
with no change to the executor. The backward returns the value whatever the
cotangent, so a probe's sum is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["columns", "emit", "rows_of"]


@jax.custom_vjp
def emit(x, probes, news):
  """`x`; the backward gives `probes` the cotangent `news` (see the module)."""
  del probes, news
  return x


def _emit_fwd(x, probes, news):
  del probes
  return x, news


def _emit_bwd(news, g):
  return g, tuple(news), tuple(jnp.zeros_like(n) for n in news)


emit.defvjp(_emit_fwd, _emit_bwd)


def columns(cols: Sequence, counts: Sequence[int]) -> tuple:
  """Per-layer columns `(layers, ...)` as the executor wants them: `(V, max(counts),
  ...)`, virtual stage v holding the next `counts[v]` layers, then zero rows."""
  V, rows = len(counts), max(counts)
  if min(counts) == rows:
    return tuple(a.reshape(V, rows, *a.shape[1:]) for a in cols)
  at = np.cumsum([0, *counts])
  pad = (
    lambda a, v: jnp.pad(  # noqa: E731
      a[at[v] : at[v + 1]], [(0, rows - counts[v])] + [(0, 0)] * (a.ndim - 1)
    )
  )
  return tuple(jnp.stack([pad(a, v) for v in range(V)]) for a in cols)


def rows_of(col, counts: Sequence[int]):
  """The inverse of `columns` for one column: `(layers, ...)` (padding dropped)."""
  return jnp.concatenate([col[v, :n] for v, n in enumerate(counts)])
