"""ResNet (bottleneck) in flax linen: ResNet-50/101 by `stages`."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn

from ooojax.models._common import image_classifier

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
        x = Bottleneck(self.width * 2**i, 2 if i > 0 and j == 0 else 1)(x, train)
    return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def make(
  depth: int = 50, batch: int = 8, image: int = 224, width: int = 64, real_init: bool = True
):
  """Returns `(loss_fn, args, kw)`; `loss_fn(params, batch_stats, x, y)` has aux.

  `real_init=False` gives zero parameters (shapes only): enough for tracing.
  """
  return image_classifier(ResNet(STAGES[depth], width), batch, image, 1000, real_init)
