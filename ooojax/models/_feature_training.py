"""Matrix rows for training-loop features: synchronized BatchNorm, dropout, bf16 with loss scaling, remat."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ooojax.models._common import init_params
from ooojax.models._feature_case import AXIS, Case, Stack, _ce, _mlp_stack_case, _stacked

# ---------------------------------------------------------------- ResNet-18


class _BasicBlock(nn.Module):
  filters: int
  strides: int = 1

  @nn.compact
  def __call__(self, x):
    norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9, axis_name=AXIS)
    r = x
    y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
    y = nn.relu(norm()(y))
    y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
    y = norm(scale_init=nn.initializers.zeros)(y)
    if r.shape != y.shape:
      r = norm()(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(r))
    return nn.relu(r + y)


class ResNet18(nn.Module):
  """flax's ImageNet example ResNet-18 (stages 2-2-2-2): BatchNorm statistics
  `pmean`-ed over the data axis (synchronized BatchNorm)."""

  width: int = 8
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(self.width, (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=AXIS)(x))
    for i, blocks in enumerate((2, 2, 2, 2)):
      for j in range(blocks):
        x = _BasicBlock(self.width * 2**i, 2 if i and not j else 1)(x)
    return nn.Dense(self.classes)(jnp.mean(x, (1, 2)))


def resnet18_sync_bn(real=False, batch=None, hw=None, width=None):
  batch = batch or (64 if real else 8)
  hw, width = hw or (32 if real else 8), width or (32 if real else 8)
  model = ResNet18(width=width)
  x = jax.random.normal(jax.random.key(0), (batch, hw, hw, 3))
  y = jax.random.randint(jax.random.key(1), (batch,), 0, 10)
  # BatchNorm's pmean needs the axis bound, at init too
  v = init_params(
    jax.vmap(lambda x: model.init(jax.random.key(2), x[None]), axis_name=AXIS, axis_size=1), x[:1]
  )
  params, stats = jax.tree.map(lambda a: a[0], (v["params"], v["batch_stats"]))

  def loss(params, stats, x, y):
    logits, upd = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
    ce = _ce(logits, y)
    return ce, {"batch_stats": upd["batch_stats"], "ce": ce}

  # batch statistics are an input the gradient is not taken for
  return Case(
    "resnet18_sync_bn",
    "synchronized BatchNorm (pmean in fwd and bwd), mutated batch_stats",
    loss,
    params,
    (stats, x, y),
    (False, True, True),
    axis=AXIS,
  )


# ---------------------------------------------------------------- dropout


class _DropMLP(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.Dropout(0.2, deterministic=False)(nn.relu(nn.Dense(self.hidden)(x)))
    return nn.Dense(10)(x)


def dropout_rng(real=False):
  d = 1024 if real else 256
  model = _DropMLP(d)
  x = jax.random.normal(jax.random.key(0), (256 if real else 128, d))
  y = jax.random.randint(jax.random.key(1), (x.shape[0],), 0, 10)
  params = init_params(model.init, jax.random.key(2), x[:1])["params"]

  def loss(params, x, y, key):
    # a different mask on every device of the data axis, as data-parallel code does
    key = jax.random.fold_in(key, jax.lax.axis_index(AXIS))
    drop, other = jax.random.split(key)
    logits = model.apply({"params": params}, x, rngs={"dropout": drop})
    noise = 1e-3 * jax.random.normal(other, logits.shape)
    ce = _ce(logits + noise, y)
    return ce, {"ce": ce, "acc": jnp.mean(jnp.argmax(logits, -1) == y)}

  return Case(
    "dropout_rng",
    "dropout from a PRNG-key input, fold_in(axis_index), metrics dict",
    loss,
    params,
    (x, y, jax.random.key(3)),
    (True, True, False),
    axis=AXIS,
  )


# ---------------------------------------------------------------- bf16

_BF16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


class _Bf16Block(nn.Module):
  dim: int

  @nn.compact
  def __call__(self, x):
    return x + nn.gelu(nn.Dense(self.dim, **_BF16)(nn.LayerNorm(**_BF16)(x)))


class _Bf16MLP(nn.Module):
  dim: int
  blocks: int = 4

  @nn.compact
  def __call__(self, x):
    for _ in range(self.blocks):
      x = _Bf16Block(self.dim)(x)
    return nn.Dense(10, **_BF16)(x)


def bf16_loss_scaling(real=False):
  d = 1024 if real else 256
  model = _Bf16MLP(d)
  x = jax.random.normal(jax.random.key(0), (256 if real else 128, d))
  y = jax.random.randint(jax.random.key(1), (x.shape[0],), 0, 10)
  # f32 master weights; the forward runs on a bf16 copy
  master = jax.tree.map(
    lambda a: a.astype(jnp.float32),
    init_params(model.init, jax.random.key(2), x[:1].astype(jnp.bfloat16))["params"],
  )
  bf16 = lambda t: jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)  # noqa: E731
  scale = jnp.float32(1024.0)

  def loss(master, x, y, scale):
    logits = model.apply({"params": bf16(master)}, x.astype(jnp.bfloat16))
    ce = _ce(logits.astype(jnp.float32), y)
    return ce * scale, {"ce": ce}  # scaled loss; the caller unscales the gradient

  block, head = _Bf16Block(d), nn.Dense(10, **_BF16)
  stack = Stack(
    lambda p, h: block.apply({"params": bf16(p)}, h),
    lambda h, y, p: _ce(head.apply({"params": bf16(p)}, h).astype(jnp.float32), y) * scale,
    _stacked([master[f"_Bf16Block_{i}"] for i in range(model.blocks)]),
    x,
    y,
    input_fn=lambda x, _: x.astype(jnp.bfloat16),
    shared=master["Dense_0"],
  )
  return Case(
    "bf16_loss_scaling",
    "bf16 params from f32 master weights, loss scaling",
    loss,
    master,
    (x, y, scale),
    (True, True, False),
    rtol=2e-2,
    stack=stack,
  )


# ---------------------------------------------------------------- remat


class _Block(nn.Module):
  dim: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = checkpoint_name(nn.Dense(4 * self.dim)(h), "up")
    return x + nn.Dense(self.dim)(nn.gelu(h))


REMAT_POLICIES = {
  "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
  "dots_saveable": jax.checkpoint_policies.dots_saveable,
  "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "save_only_these_names": jax.checkpoint_policies.save_only_these_names("up"),
  "offload_dot_with_no_batch_dims": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
    "device", "pinned_host"
  ),
}


def remat(policy="dots_saveable", real=False):
  dim = 512 if real else 128
  block = nn.remat(_Block, policy=REMAT_POLICIES[policy], prevent_cse=False)(dim)
  return _mlp_stack_case(
    f"remat_{policy}", f"jax.checkpoint, policy {policy}", block, dim, 4, 256 if real else 128, real
  )
