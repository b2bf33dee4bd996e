"""Small real flax models the tests compare against jax.grad."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.gelu(nn.Dense(32)(x))
    return nn.Dense(10)(x)


class CNN(nn.Module):
  """Conv + BatchNorm: mutable batch_stats come back through has_aux."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = nn.Conv(16, (3, 3), strides=2)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = x.mean(axis=(1, 2))
    return nn.Dense(10)(x)


class Block(nn.Module):
  """Pre-LN transformer block: attention, LayerNorm, MLP, dropout."""

  dim: int = 32
  heads: int = 4

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, deterministic=not train)
    x = x + nn.Dropout(0.1, deterministic=not train)(h)
    h = nn.LayerNorm()(x)
    h = nn.Dense(4 * self.dim)(h)
    h = nn.gelu(h)
    h = nn.Dense(self.dim)(h)
    return x + nn.Dropout(0.1, deterministic=not train)(h)


class TiedLM(nn.Module):
  vocab: int = 50
  dim: int = 32

  @nn.compact
  def __call__(self, tokens):
    emb = nn.Embed(self.vocab, self.dim)
    x = emb(tokens)
    x = Block(self.dim, 4)(x, train=False)
    x = nn.LayerNorm()(x)
    return emb.attend(x)  # output projection shares the embedding


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def mlp_case():
  m = MLP()
  x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
  y = jnp.arange(8) % 10
  params = m.init(jax.random.PRNGKey(0), x)

  def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(m.apply(params, x), y).mean()

  return loss, (params, x, y)


def cnn_case():
  m = CNN()
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 8, 3))
  y = jnp.arange(4) % 10
  v = m.init(jax.random.PRNGKey(0), x)

  def loss(params, batch_stats, x, y):
    logits, upd = m.apply(
      {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
    )
    l = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return l, upd["batch_stats"]

  return loss, (v["params"], v["batch_stats"], x, y)


def block_case():
  m = Block()
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 32))
  params = m.init(jax.random.PRNGKey(0), x, train=False)

  def loss(params, x, rng):
    out = m.apply(params, x, train=True, rngs={"dropout": rng})
    return jnp.mean(out**2)

  return loss, (params, x, jax.random.PRNGKey(7))


def tied_lm_case():
  m = TiedLM()
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, 50)
  params = m.init(jax.random.PRNGKey(0), tokens)

  def loss(params, tokens):
    logits = m.apply(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return loss, (params, tokens)


def lstm_case(d=6, t=5, batch=2, time_major=True):
  """An LSTM over a `lax.scan` (shared weights every step): (loss, params, xs).

  xs is (t, batch, d) when `time_major`, else (batch, t, d) (batch sharded first).
  """
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  p = {
    "wx": jax.random.normal(k[0], (d, 4 * d)) * 0.3,
    "wh": jax.random.normal(k[1], (d, 4 * d)) * 0.3,
    "b": jnp.zeros(4 * d),
  }
  shape = (t, batch, d) if time_major else (batch, t, d)
  xs = jax.random.normal(k[2], shape)

  def loss(p, xs):
    def cell(carry, x):
      h, c = carry
      i, f, o, g = jnp.split(x @ p["wx"] + h @ p["wh"] + p["b"], 4, axis=-1)
      c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
      h = jax.nn.sigmoid(o) * jnp.tanh(c)
      return (h, c), h

    seq = xs if time_major else xs.swapaxes(0, 1)
    b = seq.shape[1]
    _, hs = jax.lax.scan(cell, (jnp.zeros((b, d)), jnp.zeros((b, d))), seq)
    return jnp.mean(hs**2)

  return loss, p, xs


def tanh_mlp(batches: int):
  """A 4-layer tanh MLP: (params, loss(p, x), `batches` batches of 32 x 16)."""
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {
    f"l{i}": {"w": jax.random.normal(k[i], (16, 16)) * 0.3, "b": jnp.zeros(16)} for i in range(4)
  }

  def loss(p, x):
    for i in range(4):
      x = jnp.tanh(x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
    return jnp.mean(x**2)

  xs = [jax.random.normal(jax.random.PRNGKey(10 + t), (32, 16)) for t in range(batches)]
  return params, loss, xs


def tanh_mlp_structs(layers: int, dim: int):
  """`tanh_mlp`'s loss at any size, with shapes only (compile-only tests):
  (params as `ShapeDtypeStruct`s, loss(p, x))."""
  params = {
    f"l{i}": {
      "w": jax.ShapeDtypeStruct((dim, dim), jnp.float32),
      "b": jax.ShapeDtypeStruct((dim,), jnp.float32),
    }
    for i in range(layers)
  }

  def loss(p, x):
    for i in range(layers):
      x = jnp.tanh(x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
    return jnp.mean(x**2)

  return params, loss
