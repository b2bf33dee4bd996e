"""A pipeline-ready stack: residual GELU MLP blocks, parameters stacked per stage.

The pipeline benchmarks' model (`benchmarks/_mlp_model.py`), installed with
the package so that `python -m ooojax hlo --mode pipeline` and
`ooo.pipeline.explain` have a stack to cut without the benchmarks: `layers`
blocks `x + gelu(LN(x) @ w1) @ w2` (LN without learned parameters), MSE loss;
each (virtual) stage runs `layers / vstages` consecutive blocks, so the
parameters are `{"w1": (V, L/V, D, H), "w2": (V, L/V, H, D)}`.

>>> stage_fn, loss_fn, params, batch = make(vstages=2, layers=4, dim=8, hidden=16, batch=4)
>>> params["w1"].shape, batch[0].shape
((2, 2, 8, 16), (4, 8))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def layer_norm(x):
  m = x.mean(-1, keepdims=True)
  return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)


def stage_fn(p, x):
  """The blocks of one (virtual) stage, in order (a Python loop: unrolled)."""
  for j in range(p["w1"].shape[0]):
    x = x + jax.nn.gelu(layer_norm(x) @ p["w1"][j]) @ p["w2"][j]
  return x


def loss_fn(y, t):
  return jnp.mean((y - t) ** 2)


def make(
  vstages: int = 4,
  layers: int = 8,
  dim: int = 1024,
  hidden: int = 4096,
  batch: int = 32,
  dtype=jnp.float32,
):
  """`(stage_fn, loss_fn, stage_params, (inputs, targets))`, all arrays as
  `jax.ShapeDtypeStruct`s (shapes are all that explain and compiling need)."""
  if layers % vstages:
    raise ValueError(f"layers={layers} must divide into vstages={vstages} equal stages")
  per = layers // vstages
  sd = lambda *s: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
  params = {"w1": sd(vstages, per, dim, hidden), "w2": sd(vstages, per, hidden, dim)}
  return stage_fn, loss_fn, params, (sd(batch, dim), sd(batch, dim))
