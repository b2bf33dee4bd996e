"""MobileNetV3 small / large (inverted residuals, depthwise convs, SE, h-swish)."""

from __future__ import annotations

import flax.linen as nn

from ooojax.models._common import image_classifier

# (kernel, expansion, out, squeeze-excite, hard-swish, stride) per block
SMALL = [
  (3, 16, 16, True, False, 2),
  (3, 72, 24, False, False, 2),
  (3, 88, 24, False, False, 1),
  (5, 96, 40, True, True, 2),
  (5, 240, 40, True, True, 1),
  (5, 240, 40, True, True, 1),
  (5, 120, 48, True, True, 1),
  (5, 144, 48, True, True, 1),
  (5, 288, 96, True, True, 2),
  (5, 576, 96, True, True, 1),
  (5, 576, 96, True, True, 1),
]
LARGE = [
  (3, 16, 16, False, False, 1),
  (3, 64, 24, False, False, 2),
  (3, 72, 24, False, False, 1),
  (5, 72, 40, True, False, 2),
  (5, 120, 40, True, False, 1),
  (5, 120, 40, True, False, 1),
  (3, 240, 80, False, True, 2),
  (3, 200, 80, False, True, 1),
  (3, 184, 80, False, True, 1),
  (3, 184, 80, False, True, 1),
  (3, 480, 112, True, True, 1),
  (3, 672, 112, True, True, 1),
  (5, 672, 160, True, True, 2),
  (5, 960, 160, True, True, 1),
  (5, 960, 160, True, True, 1),
]


def _ch(c, width):
  return max(8, int(c * width + 4) // 8 * 8)


class Block(nn.Module):
  kernel: int
  expand: int
  out: int
  se: bool
  hswish: bool
  stride: int

  @nn.compact
  def __call__(self, x, train=True):
    act = nn.hard_swish if self.hswish else nn.relu
    bn = lambda: nn.BatchNorm(use_running_average=not train)
    y = x
    if self.expand != x.shape[-1]:
      y = act(bn()(nn.Conv(self.expand, (1, 1), use_bias=False)(y)))
    y = nn.Conv(
      self.expand,
      (self.kernel, self.kernel),
      self.stride,
      feature_group_count=self.expand,
      use_bias=False,
    )(y)
    y = act(bn()(y))
    if self.se:
      s = y.mean(axis=(1, 2), keepdims=True)
      s = nn.relu(nn.Dense(_ch(self.expand / 4, 1.0))(s))
      y = y * nn.hard_sigmoid(nn.Dense(self.expand)(s))
    y = bn()(nn.Conv(self.out, (1, 1), use_bias=False)(y))
    return x + y if self.stride == 1 and x.shape[-1] == self.out else y


class MobileNetV3(nn.Module):
  size: str = "small"
  width: float = 1.0
  classes: int = 1000

  @nn.compact
  def __call__(self, x, train=True):
    cfg = SMALL if self.size == "small" else LARGE
    x = nn.Conv(_ch(16, self.width), (3, 3), 2, use_bias=False)(x)
    x = nn.hard_swish(nn.BatchNorm(use_running_average=not train)(x))
    for k, e, o, se, hs, s in cfg:
      x = Block(k, _ch(e, self.width), _ch(o, self.width), se, hs, s)(x, train)
    x = nn.hard_swish(
      nn.BatchNorm(use_running_average=not train)(
        nn.Conv(_ch(cfg[-1][1], self.width), (1, 1), use_bias=False)(x)
      )
    )
    x = nn.hard_swish(nn.Dense(1024 if self.size == "small" else 1280)(x.mean(axis=(1, 2))))
    return nn.Dense(self.classes)(x)


def make(
  size: str = "small", batch: int = 32, image: int = 224, width: float = 1.0, classes: int = 1000
):
  """Returns `(loss_fn, args, kw)`: `loss_fn(params, batch_stats, x, y)` has aux."""
  return image_classifier(MobileNetV3(size, width, classes), batch, image, classes)
