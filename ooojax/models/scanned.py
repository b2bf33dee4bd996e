"""A BERT/GPT-like stack whose layers are one flax `nn.scan` (optionally `nn.remat`).

`make(layers=..., scan=True, remat=None | "full" | <jax.checkpoint_policies name>)`
returns `(loss_fn, args, kw)` like the other zoo models; `scan=False` builds
the same layers unrolled (separate parameters per layer), for comparisons.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from ooojax.models._common import init_params
from ooojax.models.transformer import Layer, mlm_loss


class _Step(nn.Module):
  """One scan step: `(x, _) -> (Layer(x), None)`."""

  dim: int
  heads: int
  causal: bool
  dropout: float
  train: bool

  @nn.compact
  def __call__(self, x, _):
    return Layer(self.dim, self.heads, self.causal, self.dropout)(x, self.train), None


def _remat(cls, remat):
  if remat is None:
    return cls
  policy = None if remat == "full" else getattr(jax.checkpoint_policies, remat)
  return nn.remat(cls, policy=policy, prevent_cse=False)


class ScanStack(nn.Module):
  layers: int
  dim: int
  heads: int
  vocab: int
  causal: bool = False
  dropout: float = 0.1
  scan: bool = True
  remat: str | None = None
  unroll: int = 1

  @nn.compact
  def __call__(self, tokens, train=True):
    emb = nn.Embed(self.vocab, self.dim)
    pos = self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
    x = emb(tokens) + pos
    step = _remat(_Step, self.remat)
    args = (self.dim, self.heads, self.causal, self.dropout, train)
    if self.scan:
      stack = nn.scan(
        step,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        length=self.layers,
        unroll=self.unroll,
      )
      x, _ = stack(*args, name="layers")(x, None)
    else:
      for i in range(self.layers):
        x, _ = step(*args, name=f"layer{i}")(x, None)
    return emb.attend(nn.LayerNorm()(x))  # tied output projection


def make(
  layers: int = 24,
  batch: int = 8,
  seq: int = 128,
  dim: int = 768,
  heads: int = 12,
  vocab: int = 30522,
  scan: bool = True,
  remat: str | None = None,
  unroll: int = 1,
  dropout: float = 0.1,
):
  """Scanned BERT-like encoder with an MLM loss; `(loss_fn, args, kw)`."""
  model = ScanStack(layers, dim, heads, vocab, False, dropout, scan, remat, unroll)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq), 0, vocab)
  params = init_params(lambda: model.init(jax.random.PRNGKey(0), tokens, train=False))
  rng = jax.random.PRNGKey(2)
  return mlm_loss(model, tokens), (params, tokens, rng), {}
