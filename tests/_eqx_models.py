"""Small Equinox models as Equinox's examples write them (tests/test_equinox*.py).

A CNN with max pooling (its `init=-inf` a Python float field) and `Dropout(p=0)`;
a module with int and function fields; an MLP of square `Linear` layers; a transformer encoder whose blocks read
a padding mask, draw dropout from per-layer keys (`split(key, n_layers)`) and
per-example keys (`split(key, batch)`, vmapped over the rows).
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax


class CNN(eqx.Module):
  layers: list

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.layers = [
      eqx.nn.Conv2d(1, 3, kernel_size=3, key=k1),
      eqx.nn.MaxPool2d(kernel_size=2, stride=2),
      jax.nn.relu,
      jnp.ravel,
      eqx.nn.Dropout(p=0.0),
      eqx.nn.Linear(3 * 5 * 5, 4, key=k2),
    ]

  def __call__(self, x, key):
    for layer in self.layers:
      x = layer(x, key=key) if isinstance(layer, eqx.nn.Dropout) else layer(x)
    return x


def cnn_loss(model, x, y, key):
  keys = jax.random.split(key, x.shape[0])
  logits = jax.vmap(model)(x, keys)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def cnn_data():
  x = jax.random.normal(jax.random.key(1), (8, 1, 12, 12))
  return CNN(jax.random.key(0)), (x, jnp.arange(8) % 4)


class Fields(eqx.Module):
  """A module with int and function fields beside its arrays."""

  w: jax.Array
  b: jax.Array
  steps: int
  act: Callable
  scale: float

  def __call__(self, x):
    for _ in range(self.steps):
      x = self.act(x @ self.w + self.b) * self.scale
    return x


def fields_loss(model, x):
  return jnp.mean(model(x) ** 2)


def fields_data():
  k1, k2 = jax.random.split(jax.random.key(0))
  m = Fields(jax.random.normal(k1, (4, 4)) * 0.5, jnp.zeros(4), 2, jax.nn.tanh, 1.5)
  return m, (jax.random.normal(k2, (6, 4)),)


class MLP(eqx.Module):
  """`n` square `eqx.nn.Linear` layers and a function field: big enough at d=256 that
  the H100/H200 cost model puts the dW GEMMs on stream 1 when a call is cheap."""

  layers: list
  act: Callable

  def __init__(self, d=16, n=8, key=None):
    self.layers = [eqx.nn.Linear(d, d, key=k) for k in jax.random.split(key, n)]
    self.act = jax.nn.tanh

  def __call__(self, x):
    for layer in self.layers:
      x = self.act(layer(x))
    return x


def mlp_loss(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def mlp_data(batch=16, d=16, n=8):
  k0, k1, k2 = jax.random.split(jax.random.key(4), 3)
  x, y = jax.random.normal(k1, (batch, d)), jax.random.normal(k2, (batch, d))
  return MLP(d, n, key=k0), (x, y)


class Block(eqx.Module):
  attn: eqx.nn.MultiheadAttention
  norm1: eqx.nn.LayerNorm
  norm2: eqx.nn.LayerNorm
  mlp1: eqx.nn.Linear
  mlp2: eqx.nn.Linear
  drop: eqx.nn.Dropout

  def __init__(self, d, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.attn = eqx.nn.MultiheadAttention(2, d, key=k1)
    self.norm1 = eqx.nn.LayerNorm(d)
    self.norm2 = eqx.nn.LayerNorm(d)
    self.mlp1 = eqx.nn.Linear(d, 2 * d, key=k2)
    self.mlp2 = eqx.nn.Linear(2 * d, d, key=k3)
    self.drop = eqx.nn.Dropout(p=0.1)

  def __call__(self, x, mask, key):
    k1, k2 = jax.random.split(key)
    h = jax.vmap(self.norm1)(x)
    x = x + self.drop(self.attn(h, h, h, mask=mask), key=k1)
    h = jax.vmap(self.norm2)(x)
    h = jax.vmap(self.mlp2)(jax.nn.gelu(jax.vmap(self.mlp1)(h)))
    return x + self.drop(h, key=k2)


class Encoder(eqx.Module):
  embed: eqx.nn.Embedding
  blocks: list
  head: eqx.nn.Linear

  def __init__(self, vocab=11, d=8, n_layers=4, key=None):
    ke, kb, kh = jax.random.split(key, 3)
    self.embed = eqx.nn.Embedding(vocab, d, key=ke)
    self.blocks = [Block(d, k) for k in jax.random.split(kb, n_layers)]
    self.head = eqx.nn.Linear(d, 2, key=kh)

  def __call__(self, tokens, key):
    # one example: a padding mask every block reads, a dropout key per block
    mask = (tokens != 0)[None, :] & (tokens != 0)[:, None]
    x = jax.vmap(self.embed)(tokens)
    keys = jax.random.split(key, len(self.blocks))
    for block, k in zip(self.blocks, keys):
      x = block(x, mask, k)
    return self.head(x[0])


def encoder_loss(model, tokens, labels, key):
  keys = jax.random.split(key, tokens.shape[0])  # per-example keys
  logits = jax.vmap(model)(tokens, keys)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def encoder_data(batch=8, seq=6, n_layers=4):
  k1, k2 = jax.random.split(jax.random.key(2))
  tokens = jax.random.randint(k1, (batch, seq), 1, 11)
  tokens = tokens.at[:, seq - 2 :].set(jnp.where(jnp.arange(batch)[:, None] % 2, 0, 3))
  return Encoder(n_layers=n_layers, key=k2), (tokens, jnp.arange(batch) % 2)


def train(value_and_grad, loss, model, batch, steps=3, key=None, lr=1e-2, sharding=None):
  """`steps` Adam steps inside eqx.filter_jit; returns (losses, model).

  `sharding`: the batch's, applied in the step with `eqx.filter_shard` as
  Equinox's data-parallel example does."""
  opt = optax.adam(lr)
  state = opt.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def step(model, state, batch, key):
    if sharding is not None:
      batch = eqx.filter_shard(batch, sharding)
    args = (*batch, key) if key is not None else batch
    value, grads = value_and_grad(loss)(model, *args)
    updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
    return value, eqx.apply_updates(model, updates), state

  losses = []
  for i in range(steps):
    k = None if key is None else jax.random.fold_in(key, i)
    value, model, state = step(model, state, batch, k)
    losses.append(float(value))
  return losses, model
