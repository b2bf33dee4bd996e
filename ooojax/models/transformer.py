"""BERT-style encoder (MLM loss, dropout) and GPT-style decoder (next-token loss)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ooojax.models._common import init_params


class Layer(nn.Module):
  dim: int
  heads: int
  causal: bool
  dropout: float

  @nn.compact
  def __call__(self, x, train=True):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2])) if self.causal else None
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
    x = x + nn.Dropout(self.dropout, deterministic=not train)(h)
    h = nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(nn.LayerNorm()(x))))
    return x + nn.Dropout(self.dropout, deterministic=not train)(h)


class Stack(nn.Module):
  layers: int
  dim: int
  heads: int
  vocab: int
  causal: bool
  dropout: float = 0.1

  @nn.compact
  def __call__(self, tokens, train=True):
    emb = nn.Embed(self.vocab, self.dim)
    pos = self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
    x = emb(tokens) + pos
    for _ in range(self.layers):
      x = Layer(self.dim, self.heads, self.causal, self.dropout)(x, train)
    return emb.attend(nn.LayerNorm()(x))  # tied output projection


def _make(causal, layers, batch, seq, dim, heads, vocab):
  model = Stack(layers, dim, heads, vocab, causal)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq), 0, vocab)
  params = init_params(lambda: model.init(jax.random.PRNGKey(0), tokens, train=False))
  rng = jax.random.PRNGKey(2)
  if causal:

    def loss_fn(params, tokens, rng):
      logits = model.apply(params, tokens, rngs={"dropout": rng})[:, :-1]
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  else:
    loss_fn = mlm_loss(model, tokens)
  return loss_fn, (params, tokens, rng), {}


def mlm_loss(model, tokens):
  """A BERT-style masked-LM loss over a fixed 15% mask of `tokens`."""
  masked = jax.random.bernoulli(jax.random.PRNGKey(3), 0.15, tokens.shape)

  def loss_fn(params, tokens, rng):
    inputs = jnp.where(masked, 0, tokens)  # token 0 plays [MASK]
    logits = model.apply(params, inputs, rngs={"dropout": rng})
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    return jnp.sum(ce * masked) / jnp.maximum(masked.sum(), 1)

  return loss_fn


def make_bert(
  layers: int = 12,
  batch: int = 8,
  seq: int = 128,
  dim: int = 768,
  heads: int = 12,
  vocab: int = 30522,
):
  """BERT-style encoder with an MLM loss; `(loss_fn, args, kw)`."""
  return _make(False, layers, batch, seq, dim, heads, vocab)


def make_gpt(
  layers: int = 12,
  batch: int = 8,
  seq: int = 128,
  dim: int = 768,
  heads: int = 12,
  vocab: int = 50257,
):
  """GPT-style decoder with a next-token loss; `(loss_fn, args, kw)`."""
  return _make(True, layers, batch, seq, dim, heads, vocab)
