"""The pipeline benchmarks' model: residual GELU MLP blocks (pipeline.py, pipeline_mp.py).

SpectraX's pipeline benchmark model: `layers` blocks `x + gelu(LN(x) @ w1) @ w2`
(LN without learned parameters), MSE loss. As pipeline stages each (virtual)
stage runs `layers / stages` consecutive blocks, so the parameters are stacked
`{"w1": (V, L/V, D, H), "w2": (V, L/V, H, D)}`. Plain numpy in, so the stage
workers, the unpipelined baseline and the test build bit-identical inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# the model itself ships with ooojax (`python -m ooojax hlo --mode pipeline`)
from ooojax.models.mlp_stack import layer_norm, loss_fn, stage_fn  # noqa: F401


def flat_loss(params, batch):
  """The same model without a pipeline: every stage's blocks in one program."""
  x, t = batch
  for s in range(params["w1"].shape[0]):
    x = stage_fn(jax.tree.map(lambda a: a[s], params), x)
  return loss_fn(x, t)


def accumulated(micro: int):
  """`(params, batch) -> (loss, grads)`: value_and_grad of `flat_loss` accumulated over
  `micro` microbatches in a scan on one device: the pipeline's per-microbatch
  kernels without a pipeline (small microbatches run below a CPU's GEMM peak)."""
  step = accumulated_loss(flat_loss, micro)
  return lambda params, batch: step(params, batch)


def make_params(vstages: int, layers: int, dim: int, hidden: int, seed: int = 0) -> dict:
  if layers % vstages:
    raise ValueError(f"{layers} layers do not divide evenly over {vstages} (virtual) stages")
  rng = np.random.default_rng(seed)
  k = layers // vstages
  # w2 scaled down so the residual stream stays O(1) through the stack.
  return {
    "w1": (rng.standard_normal((vstages, k, dim, hidden)) / dim**0.5).astype(np.float32),
    "w2": (rng.standard_normal((vstages, k, hidden, dim)) * 0.5 / hidden**0.5).astype(np.float32),
  }


def make_batch(batch: int, dim: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  return (
    rng.standard_normal((batch, dim)).astype(np.float32),
    rng.standard_normal((batch, dim)).astype(np.float32),
  )


def flax_loop(params: dict):
  """`(loss, flax_params)`: the same blocks as a flax module with a Python loop,
  the form automatic cutting takes (`ooo.pipeline.value_and_grad(loss, ...)`),
  holding `params`' weights (one virtual stage's worth: `make_params(1, ...)`)."""
  import flax.linen as nn

  _, layers, dim, hidden = params["w1"].shape

  class Blocks(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(layers):
        h = jax.nn.gelu(nn.Dense(hidden, use_bias=False)(layer_norm(x)))
        x = x + nn.Dense(dim, use_bias=False)(h)
      return x

  net = Blocks()
  weights = [w for j in range(layers) for w in (params["w1"][0, j], params["w2"][0, j])]
  flax_params = {"params": {f"Dense_{i}": {"kernel": w} for i, w in enumerate(weights)}}

  def loss(p, x, t):
    return loss_fn(net.apply(p, x), t)

  return loss, flax_params


def accumulated_loss(loss, micro: int):
  """`(params, *batch) -> (loss, grads)`: `jax.value_and_grad(loss)` accumulated
  over `micro` microbatches in a scan on one device (`accumulated` for any loss)."""
  vg = jax.value_and_grad(loss)

  def step(params, *batch):
    split = lambda a: a.reshape(micro, -1, *a.shape[1:])  # noqa: E731

    def one(acc, mb):
      return jax.tree.map(jnp.add, acc, vg(params, *mb)), None

    mb = jax.tree.map(lambda a: a[: a.shape[0] // micro], batch)
    zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(vg, params, *mb))
    (l, grads), _ = jax.lax.scan(one, zero, jax.tree.map(split, batch))
    return l / micro, jax.tree.map(lambda g: g / micro, grads)

  return step
