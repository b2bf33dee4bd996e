"""Models with the features real training code has: the rows of the model matrix.

Each `make(name, real=False)` returns a `Case`: `loss(params, *batch) ->
(scalar, aux)` with `has_aux` semantics, its arguments, and how the batch
splits over a data axis. `real=True` gives sizes for the compiled-H100 overlap
figures; the default sizes compile in seconds on a 2-core CPU and are just
big enough (GEMMs of 2^23 FLOPs and up) that the H100 cost model puts dW
clusters on stream 1, so the CPU cells run the pinned-call path too.

Cases whose model is a stack of identical blocks also carry a `Stack`: the
same model as `ooo.pipeline.value_and_grad`'s `(stage_fn, loss_fn, input_fn)`
with per-block parameters stacked on a leading axis.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ooojax.models._common import init_params

AXIS = "batch"  # the data axis a case's collectives (sync BatchNorm, axis_index) name


@dataclasses.dataclass(frozen=True)
class Stack:
  """The model as a pipeline: `loss_fn(stage_fn(p[L-1], ... stage_fn(p[0], input_fn(x))), t)`."""

  stage_fn: Callable
  loss_fn: Callable
  params: Any  # leaves stacked on a leading axis of blocks
  inputs: Any
  targets: Any
  input_fn: Callable | None = None
  shared: Any = None  # tied weights read by input_fn and loss_fn


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  features: str  # what real training code it stands for
  loss: Callable  # (params, *batch) -> (scalar, aux)
  params: Any
  batch: tuple
  split: tuple  # per batch argument: True if it splits over the data axis
  axis: str | None = None  # the loss names this mapped axis (needs one bound)
  rtol: float = 1e-5
  stack: Stack | None = None
  # jax.grad raises this (and ooo.grad must raise the same type): an error cell
  raises: type[Exception] | None = None

  @property
  def args(self) -> tuple:
    return (self.params, *self.batch)


def _stacked(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _ce(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


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


def _mlp_stack_case(name, features, block, dim, layers, batch, real, **kw):
  x = jax.random.normal(jax.random.key(0), (batch, dim))
  t = jax.random.normal(jax.random.key(1), (batch, dim))
  keys = jax.random.split(jax.random.key(2), layers)
  stacked = init_params(jax.vmap(block.init, in_axes=(0, None)), keys, x[:1])["params"]
  per = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(layers)]
  stage_fn = lambda p, h: block.apply({"params": p}, h)  # noqa: E731
  loss_fn = lambda h, t: jnp.mean((h - t) ** 2)  # noqa: E731

  def loss(params, x, t):
    h = x
    for p in params:
      h = stage_fn(p, h)
    mse = loss_fn(h, t)
    return mse, {"mse": mse}

  return Case(
    name,
    features,
    loss,
    per,
    (x, t),
    (True, True),
    stack=Stack(stage_fn, loss_fn, stacked, x, t),
    **kw,
  )


def remat(policy="dots_saveable", real=False):
  dim = 512 if real else 128
  block = nn.remat(_Block, policy=REMAT_POLICIES[policy], prevent_cse=False)(dim)
  return _mlp_stack_case(
    f"remat_{policy}", f"jax.checkpoint, policy {policy}", block, dim, 4, 256 if real else 128, real
  )


# ---------------------------------------------------------------- attention


class _Attention(nn.Module):
  """Causal + padding-masked self-attention block, or one whose attention is a
  `custom_vjp` kernel (hand-written backward, as flash-attention kernels are)."""

  dim: int
  heads: int
  kernel: bool = False

  @nn.compact
  def __call__(self, x, pad=None):
    b, s, _ = x.shape
    h = nn.LayerNorm()(x)
    qkv = nn.DenseGeneral((3, self.heads, self.dim // self.heads))(h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    mask = jnp.tril(jnp.ones((s, s), bool))[None, None]
    if pad is not None:
      mask = mask & pad[:, None, None, :]
    o = attention_kernel(q, k, v, mask) if self.kernel else _attention(q, k, v, mask)
    x = x + nn.DenseGeneral(self.dim, axis=(-2, -1))(o)
    return x + nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(nn.LayerNorm()(x))))


def _attention(q, k, v, mask):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@jax.custom_vjp
def attention_kernel(q, k, v, mask):
  return _attention(q, k, v, mask)


def _kernel_fwd(q, k, v, mask):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v), (q, k, v, p, mask)


def _kernel_bwd(res, do):
  q, k, v, p, mask = res
  dv = jnp.einsum("bhqk,bqhd->bkhd", p, do)
  dp = jnp.einsum("bqhd,bkhd->bhqk", do, v)
  ds = p * (dp - jnp.sum(dp * p, -1, keepdims=True)) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k)
  dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q)
  return dq, dk, dv, None


attention_kernel.defvjp(_kernel_fwd, _kernel_bwd)


class _TiedLM(nn.Module):
  vocab: int
  dim: int
  heads: int
  layers: int
  kernel: bool

  @nn.compact
  def __call__(self, tokens):
    emb = nn.Embed(self.vocab, self.dim)
    pad = tokens != 0  # token 0 pads
    x = emb(tokens)
    for _ in range(self.layers):
      x = _Attention(self.dim, self.heads, self.kernel)(x, pad)
    return emb.attend(nn.LayerNorm()(x))  # tied output projection


def _lm_case(name, features, kernel, real):
  vocab, dim, heads, layers = (512, 512, 8, 2) if real else (128, 128, 4, 2)
  batch, seq = (16, 128) if real else (8, 32)
  model = _TiedLM(vocab, dim, heads, layers, kernel)
  tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 1, vocab)
  tokens = tokens.at[:, -2:].set(0)  # padded tails
  params = init_params(model.init, jax.random.key(1), tokens[:1, :-1])["params"]

  def loss(params, tokens):
    logits = model.apply({"params": params}, tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    w = (tokens[:, 1:] != 0).astype(ce.dtype)
    lm = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)
    return lm, {"lm": lm, "tokens": jnp.sum(w)}

  # the same blocks as a pipeline: embedding on the first stage, tied head on the last
  block = _Attention(dim, heads, kernel)
  x = jnp.zeros((1, seq, dim))
  keys = jax.random.split(jax.random.key(2), 2 * layers)
  stacked = init_params(jax.vmap(block.init, in_axes=(0, None)), keys, x)["params"]
  emb = params["Embed_0"]["embedding"]
  stack = Stack(
    lambda p, h: block.apply({"params": p}, h),
    lambda h, t, e: _ce(h @ e.T, t),
    stacked,
    tokens[:, :-1],
    tokens[:, 1:],
    input_fn=lambda tok, e: e[tok],
    shared=emb,
  )
  return Case(name, features, loss, params, (tokens,), (True,), stack=stack)


def attention_masked(real=False):
  return _lm_case(
    "attention_masked", "causal + padding masks, tied embeddings, integer token inputs", False, real
  )


def attention_custom_vjp(real=False):
  return _lm_case("attention_custom_vjp", "attention as a custom_vjp kernel", True, real)


# ---------------------------------------------------------------- MoE


class _MoE(nn.Module):
  """Top-k routed experts with a capacity, as GShard/Switch-style code writes
  them: tokens scattered into per-expert slots, expert GEMMs, gathered back and
  scatter-added into their tokens (assignments past the capacity are dropped)."""

  dim: int
  experts: int = 4
  k: int = 2

  @nn.compact
  def __call__(self, x):
    b, d = x.shape
    e_n, k = self.experts, self.k
    cap = -(-5 * b * k // (4 * e_n))  # capacity factor 1.25
    h = nn.LayerNorm()(x)
    gates, idx = jax.lax.top_k(jax.nn.softmax(nn.Dense(e_n)(h)), k)
    w1 = self.param("w1", nn.initializers.lecun_normal(), (e_n, d, 2 * d))
    w2 = self.param("w2", nn.initializers.lecun_normal(), (e_n, 2 * d, d))
    e = idx.reshape(-1)  # expert of each assignment
    tok = jnp.repeat(jnp.arange(b), k)  # its token
    pos = (jnp.cumsum(jax.nn.one_hot(e, e_n, dtype=jnp.int32), 0) - 1)[jnp.arange(b * k), e]
    keep = pos < cap
    slots = jnp.zeros((e_n, cap, d), x.dtype).at[e, pos].set(h[tok], mode="drop")  # scatter
    y = jnp.einsum("ecf,efd->ecd", nn.gelu(jnp.einsum("ecd,edf->ecf", slots, w1)), w2)
    y = y[e, jnp.minimum(pos, cap - 1)] * (gates.reshape(-1) * keep)[:, None]  # gather
    return x + jnp.zeros_like(x).at[tok].add(y)  # scatter-add combine


def moe_top_k(real=False):
  dim = 256 if real else 128
  return _mlp_stack_case(
    "moe_top_k",
    "mixture of experts: top-2 routing, capacity, scatter/gather dispatch",
    _MoE(dim),
    dim,
    2,
    256 if real else 128,
    real,
  )


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


CASES = {
  "resnet18_sync_bn": resnet18_sync_bn,
  "dropout_rng": dropout_rng,
  "bf16_loss_scaling": bf16_loss_scaling,
  **{f"remat_{p}": functools.partial(remat, p) for p in REMAT_POLICIES},
  "attention_masked": attention_masked,
  "attention_custom_vjp": attention_custom_vjp,
  "moe_top_k": moe_top_k,
  "cond_while": cond_while,
  "while_differentiated": while_differentiated,
  "linen_scan": linen_scan,
  "nnx_scan": nnx_scan,
}


# the cases whose model is a stack of identical blocks (they carry a `Stack`)
STACKED = (
  "bf16_loss_scaling",
  *(f"remat_{p}" for p in REMAT_POLICIES),
  "attention_masked",
  "attention_custom_vjp",
  "moe_top_k",
  "cond_while",
  "linen_scan",
  "nnx_scan",
)


def make(name: str, real: bool = False) -> Case:
  """The matrix row `name` (one of `CASES`), tiny or at a `real` size."""
  if name not in CASES:
    raise ValueError(f"unknown case {name!r}; known: {sorted(CASES)}")
  return CASES[name](real=real)
