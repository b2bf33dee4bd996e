"""pipeline.state: model state that travels with a stack's layers (BatchNorm statistics).

Contract: `emit(x, probes, news) -> x`, and `columns(cols, counts)` /
`layers_of(column, counts)` / `rows_of(column, counts)` (a stack's per-layer
leaves laid out by virtual stage and back). Read by `passes.pipeline.cut`.

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

__all__ = ["columns", "emit", "layers_of", "rows_of"]


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
  """Per-layer columns as the executor wants them, virtual stage v holding the next
  `counts[v]` layers, then zero rows. A column stacked over the layers, `(layers,
  ...)` (a scan's leaf), becomes one `(V, max(counts), ...)` array; a list of the
  layers' own arrays (a loop's leaf) becomes `max(counts)` arrays `(V, ...)`, row j
  holding each virtual stage's j-th layer. A loop's layers so stay arrays of their
  own: a stage reads each whole, where a row of a stack is a slice that XLA:CPU,
  and XLA:GPU before a Triton GEMM, copies out before every GEMM that reads it."""
  V, rows = len(counts), max(counts)
  at = np.cumsum([0, *counts])
  out: list = []
  for a in cols:
    if isinstance(a, (list, tuple)):
      zero = jnp.zeros_like(a[0])
      out += [
        jnp.stack([a[at[v] + j] if j < counts[v] else zero for v in range(V)]) for j in range(rows)
      ]
    elif min(counts) == rows:
      out.append(a.reshape(V, rows, *a.shape[1:]))
    else:
      rest = [(0, 0)] * (a.ndim - 1)
      out.append(
        jnp.stack(
          [jnp.pad(a[at[v] : at[v + 1]], [(0, rows - n), *rest]) for v, n in enumerate(counts)]
        )
      )
  return tuple(out)


def layers_of(col, counts: Sequence[int]) -> list:
  """The inverse of `columns` for one column (an array, or a loop's tuple of row
  arrays): its layers' values in order, padding dropped."""
  if isinstance(col, (list, tuple)):
    return [col[j][v] for v, n in enumerate(counts) for j in range(n)]
  return [col[v, j] for v, n in enumerate(counts) for j in range(n)]


def rows_of(col, counts: Sequence[int]):
  """`layers_of` stacked: `(layers, ...)`."""
  if isinstance(col, (list, tuple)):
    return jnp.stack(layers_of(col, counts))
  return jnp.concatenate([col[v, :n] for v, n in enumerate(counts)])
