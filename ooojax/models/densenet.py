"""DenseNet-121 (block config 6/12/24/16), growth rate configurable."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from ooojax.models._common import image_classifier


class DenseNet(nn.Module):
  blocks: Sequence[int] = (6, 12, 24, 16)
  growth: int = 32
  classes: int = 1000

  @nn.compact
  def __call__(self, x, train=True):
    bn = lambda: nn.BatchNorm(use_running_average=not train)
    x = nn.Conv(2 * self.growth, (7, 7), 2, use_bias=False)(x)
    x = nn.max_pool(nn.relu(bn()(x)), (3, 3), (2, 2), "SAME")
    for i, n in enumerate(self.blocks):
      for _ in range(n):
        y = nn.Conv(4 * self.growth, (1, 1), use_bias=False)(nn.relu(bn()(x)))
        y = nn.Conv(self.growth, (3, 3), use_bias=False)(nn.relu(bn()(y)))
        x = jnp.concatenate([x, y], axis=-1)
      if i < len(self.blocks) - 1:  # transition
        x = nn.Conv(x.shape[-1] // 2, (1, 1), use_bias=False)(nn.relu(bn()(x)))
        x = nn.avg_pool(x, (2, 2), (2, 2))
    return nn.Dense(self.classes)(nn.relu(bn()(x)).mean(axis=(1, 2)))


def make(
  batch: int = 32,
  image: int = 224,
  growth: int = 32,
  blocks: Sequence[int] = (6, 12, 24, 16),
  classes: int = 1000,
):
  """Returns `(loss_fn, args, kw)`: `loss_fn(params, batch_stats, x, y)` has aux."""
  return image_classifier(DenseNet(tuple(blocks), growth, classes), batch, image, classes)
