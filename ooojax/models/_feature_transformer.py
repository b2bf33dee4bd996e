"""Matrix rows for transformer layers: masked attention (tied embeddings), a custom_vjp
attention kernel, and a routed mixture of experts."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ooojax.models._common import init_params
from ooojax.models._feature_case import Case, Stack, _ce, _mlp_stack_case

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
