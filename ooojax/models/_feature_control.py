"""Matrix rows for control flow and scanned stacks: cond / fori_loop / while_loop, a while_loop
jax.grad refuses, linen `nn.scan` and `nnx.scan`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from ooojax.models._common import init_params
from ooojax.models._feature_case import Case, Stack, _ce, _mlp_stack_case
from ooojax.models._feature_training import _Block

# ---------------------------------------------------------------- control flow


class _Control(nn.Module):
  """`lax.cond` on the data, a `fori_loop` over a layer, and a `while_loop` on
  non-differentiated values (a data-dependent trip count)."""

  dim: int

  @nn.compact
  def __call__(self, x):
    a = self.param("a", nn.initializers.lecun_normal(), (self.dim, self.dim))
    x = jax.lax.cond(jnp.mean(x) > 0, lambda x: jnp.tanh(x @ a), lambda x: x - x @ a, x)
    w = self.param("w", nn.initializers.orthogonal(0.5), (self.dim, self.dim))
    x = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w) + h, x)
    norm = jax.lax.stop_gradient(jnp.max(jnp.abs(x)))
    halvings = jax.lax.while_loop(lambda c: c[1] > 1.0, lambda c: (c[0] + 1, c[1] / 2), (0, norm))[
      0
    ]
    return x / 2.0**halvings


def cond_while(real=False):
  dim = 512 if real else 256
  return _mlp_stack_case(
    "cond_while",
    "lax.cond, fori_loop, while_loop (trip count from data)",
    _Control(dim),
    dim,
    2,
    256 if real else 128,
    real,
  )


def while_differentiated(real=False):
  dim = 16

  def loss(w, x):
    h = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]
    return jnp.sum(h**2), {}

  x = jax.random.normal(jax.random.key(0), (8, dim))
  # reverse-mode through a while_loop on the differentiated value: jax.grad refuses
  return Case(
    "while_differentiated",
    "while_loop carrying the differentiated value (jax.grad refuses it too)",
    loss,
    jnp.eye(dim) * 0.5,
    (x,),
    (True,),
    raises=ValueError,
  )


# ---------------------------------------------------------------- scanned stacks


class _ScanBlock(nn.Module):
  dim: int

  @nn.compact
  def __call__(self, x, _):
    return _Block(self.dim)(x), None


class _LinenScan(nn.Module):
  dim: int
  layers: int

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.dim)(x)
    x, _ = nn.scan(
      _ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers
    )(self.dim)(x, None)
    self.sow("intermediates", "features", x)
    return nn.Dense(10)(x)


def linen_scan(real=False):
  dim, layers = (1024, 4) if real else (128, 4)
  model = _LinenScan(dim, layers)
  x = jax.random.normal(jax.random.key(0), (256 if real else 128, dim))
  y = jax.random.randint(jax.random.key(1), (x.shape[0],), 0, 10)
  params = init_params(model.init, jax.random.key(2), x[:1])["params"]

  def loss(params, x, y):
    logits, cols = model.apply({"params": params}, x, mutable=["intermediates"])
    ce = _ce(logits, y)
    return ce, {"ce": ce, "intermediates": cols["intermediates"]}

  block, dense = _Block(dim), nn.Dense(dim)
  stack = Stack(
    lambda p, h: block.apply({"params": p}, h),
    lambda h, y, p: _ce(nn.Dense(10).apply({"params": p["Dense_1"]}, h), y),
    params["Scan_ScanBlock_0"]["_Block_0"],
    x,
    y,
    input_fn=lambda x, p: dense.apply({"params": p["Dense_0"]}, x),
    shared={k: params[k] for k in ("Dense_0", "Dense_1")},
  )
  return Case(
    "linen_scan",
    "nn.scan stack, sown intermediates",
    loss,
    params,
    (x, y),
    (True, True),
    stack=stack,
  )


class _NnxBlock(nnx.Module):
  def __init__(self, dim, rngs):
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(self.norm(x))))


class _NnxScan(nnx.Module):
  def __init__(self, dim, layers, rngs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return _NnxBlock(dim, rngs)

    self.blocks = blocks(rngs)
    self.head = nnx.Linear(dim, 10, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(h, block):
      return block(h)

    return self.head(run(x, self.blocks))


def nnx_scan(real=False):
  dim, layers = (1024, 4) if real else (128, 4)
  graph, params = nnx.split(_NnxScan(dim, layers, nnx.Rngs(0)), nnx.Param)
  x = jax.random.normal(jax.random.key(0), (256 if real else 128, dim))
  y = jax.random.randint(jax.random.key(1), (x.shape[0],), 0, 10)

  def loss(params, x, y):
    ce = _ce(nnx.merge(graph, params)(x), y)
    return ce, {"ce": ce}

  block = nnx.split(_NnxBlock(dim, nnx.Rngs(0)), nnx.Param)[0]
  head = nnx.split(nnx.Linear(dim, 10, rngs=nnx.Rngs(0)), nnx.Param)[0]
  stack = Stack(
    lambda p, h: nnx.merge(block, p)(h),
    lambda h, y, p: _ce(nnx.merge(head, p)(h), y),
    params["blocks"],
    x,
    y,
    input_fn=lambda x, _: x,
    shared=params["head"],
  )
  return Case(
    "nnx_scan",
    "nnx.scan over nnx.vmap-created blocks",
    loss,
    params,
    (x, y),
    (True, True),
    stack=stack,
  )
