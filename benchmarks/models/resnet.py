"""ResNet (bottleneck) in flax linen: ResNet-50/101 by `stages`."""
from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

STAGES = {26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}


class Bottleneck(nn.Module):
  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = lambda: nn.BatchNorm(use_running_average=not train)
    r = x
    y = nn.relu(norm()(nn.Conv(self.features, (1, 1), use_bias=False)(x)))
    y = nn.relu(norm()(nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(y)))
    y = norm()(nn.Conv(4 * self.features, (1, 1), use_bias=False)(y))
    if r.shape != y.shape:
      r = norm()(nn.Conv(4 * self.features, (1, 1), self.strides, use_bias=False)(r))
    return nn.relu(y + r)


class ResNet(nn.Module):
  stages: Sequence[int] = STAGES[50]
  width: int = 64
  classes: int = 1000

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.width, (7, 7), 2, use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
    x = nn.max_pool(x, (3, 3), (2, 2), "SAME")
    for i, n in enumerate(self.stages):
      for j in range(n):
        x = Bottleneck(self.width * 2 ** i, 2 if i > 0 and j == 0 else 1)(x, train)
    return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def make(depth: int = 50, batch: int = 8, image: int = 224, width: int = 64):
  """Returns `(loss_fn, args)`; `loss_fn(params, batch_stats, x, y)` has aux."""
  model = ResNet(STAGES[depth], width)
  x = jnp.zeros((batch, image, image, 3), jnp.float32)
  y = jnp.zeros((batch,), jnp.int32)
  v = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x))
  v = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), v)

  def loss_fn(params, batch_stats, x, y):
    logits, upd = model.apply({"params": params, "batch_stats": batch_stats}, x,
                              mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd
  return loss_fn, (v["params"], v["batch_stats"], x, y)
