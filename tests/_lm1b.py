"""A small lm1b-style TransformerLM (flax's `examples/lm1b/models.py`, shrunk).

The loss reads the tokens both as inputs (shifted right) and as targets, with
a padding weight; sinusoidal positions, a Python loop of decoder blocks, a
padding-and-causal mask every block reads, dropout after the embedding and in
every block (linen `rngs={"dropout": key}`), and a metrics dict as aux.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def _sinusoid(length, dim):
  pos = np.arange(length)[:, None]
  div = np.exp(np.arange(0, dim, 2) * -(np.log(10000.0) / dim))
  pe = np.zeros((length, dim), np.float32)
  pe[:, 0::2], pe[:, 1::2] = np.sin(pos * div), np.cos(pos * div)
  return jnp.asarray(pe[None])


class _Block(nn.Module):
  dim: int
  heads: int
  rate: float

  @nn.compact
  def __call__(self, x, mask, train):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(self.heads, qkv_features=self.dim, deterministic=True)(
      h, mask=mask
    )
    x = x + nn.Dropout(self.rate)(h, deterministic=not train)
    h = nn.Dense(self.dim)(nn.relu(nn.Dense(2 * self.dim)(nn.LayerNorm()(x))))
    return x + nn.Dropout(self.rate)(h, deterministic=not train)


class TransformerLM(nn.Module):
  vocab: int = 16
  dim: int = 8
  heads: int = 2
  layers: int = 4
  rate: float = 0.1

  @nn.compact
  def __call__(self, inputs, train: bool = True):
    # shift right: predict token t from tokens < t (0 is padding and BOS)
    x = jnp.pad(inputs, ((0, 0), (1, 0)))[:, :-1]
    mask = nn.combine_masks(
      nn.make_attention_mask(inputs > 0, inputs > 0), nn.make_causal_mask(inputs)
    )
    embed = nn.Embed(self.vocab, self.dim)
    y = embed(x) + _sinusoid(inputs.shape[1], self.dim)
    y = nn.Dropout(self.rate)(y, deterministic=not train)
    for _ in range(self.layers):
      y = _Block(self.dim, self.heads, self.rate)(y, mask, train)
    return nn.Dense(self.vocab)(nn.LayerNorm()(y))


def make(layers=4, rate=0.1, batch=8, length=6):
  """`(model, loss, params, tokens)`; `loss(params, tokens, key) -> (loss, metrics)`."""
  model = TransformerLM(layers=layers, rate=rate)
  tokens = jax.random.randint(jax.random.key(0), (batch, length), 0, model.vocab)
  tokens = tokens.at[::3, -2:].set(0)  # some padding
  # one compile for the whole init (eagerly, each initializer op compiles on its own)
  init = jax.jit(lambda key, x: model.init(key, x, train=False)["params"])
  params = init(jax.random.key(1), tokens[:1])

  def loss(params, tokens, key):
    logits = model.apply({"params": params}, tokens, rngs={"dropout": key})
    weights = (tokens > 0).astype(jnp.float32)
    onehot = jax.nn.one_hot(tokens, model.vocab)
    nll = -jnp.sum(onehot * jax.nn.log_softmax(logits), -1) * weights
    acc = jnp.sum((jnp.argmax(logits, -1) == tokens) * weights)
    loss = jnp.sum(nll) / jnp.sum(weights)
    return loss, {"loss": loss, "accuracy": acc / jnp.sum(weights), "tokens": jnp.sum(tokens > 0)}

  return model, loss, params, tokens
