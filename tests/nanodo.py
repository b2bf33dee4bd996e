"""nanodo's decoder-only transformer and train step, as its authors write them (small).

After google-deepmind/nanodo (Apache-2.0: `model.py`, `fsdp.py`, `loss.py`,
`train.py`), rewritten for the tests: the same layers, initialisers and
FSDP partitioning (`nn.with_partitioning` on the "data" axis), the same
next-token loss closing over the batch, the same `_train_step` under
`jax.jit(in_shardings=..., out_shardings=...)` with the batch constrained to
`P("data")`, and `optax.MultiSteps(adamw)`. What is left out: metrics,
data loading, checkpoints, learning-rate schedules. `value_and_grad` is a
parameter so the tests can swap in ooojax's and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn, struct
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

PAD_ID = 0


@dataclasses.dataclass
class DoConfig:
  D: int  # model dim
  H: int  # heads
  L: int  # context length
  N: int  # blocks
  V: int  # vocab
  F: int  # MLP inner dim
  kernel_init: nn.initializers.Initializer = nn.initializers.xavier_uniform()
  embed_init: nn.initializers.Initializer = nn.initializers.variance_scaling(
    1.0, "fan_in", "normal", out_axis=0
  )
  dtype: jnp.dtype = jnp.float32
  fsdp_enabled: bool = True
  remat: bool = False


# FSDP: one dimension of each kernel split over "data" (nanodo's fsdp.py)
_FSDP = {
  "embedding": (None, "data"),
  "attn_in_proj": ("data", None, None),
  "attn_out_proj": (None, None, "data"),
  "mlp_kernel": ("data", None),
  "head": ("data", None),
}


def fsdp_init(kind: str, cfg: DoConfig):
  init = cfg.embed_init if kind == "embedding" else cfg.kernel_init
  return nn.with_partitioning(init, _FSDP[kind]) if cfg.fsdp_enabled else init


class Mlp(nn.Module):
  cfg: DoConfig

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(
      nn.Dense, kernel_init=fsdp_init("mlp_kernel", self.cfg), use_bias=False, dtype=self.cfg.dtype
    )
    return dense(self.cfg.D)(jax.nn.gelu(dense(self.cfg.F)(x)))


class CausalAttn(nn.Module):
  cfg: DoConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    dh = cfg.D // cfg.H
    proj = functools.partial(
      nn.DenseGeneral,
      axis=-1,
      features=(cfg.H, dh),
      kernel_init=fsdp_init("attn_in_proj", cfg),
      use_bias=False,
      dtype=cfg.dtype,
    )
    q, k, v = proj(name="query")(x), proj(name="key")(x), proj(name="value")(x)
    q /= dh**0.5
    att = jnp.einsum("...qhd,...khd->...hqk", q, k).astype(jnp.float32)
    length = x.shape[1]
    causal = jnp.tril(jnp.ones((1, 1, length, length), dtype=jnp.bool_))
    att = jnp.where(causal, att, jnp.finfo(cfg.dtype).min)
    att = jax.nn.softmax(att, axis=-1).astype(cfg.dtype)
    out = jnp.einsum("...hqk,...khd->...qhd", att, v)
    return nn.DenseGeneral(
      features=cfg.D,
      name="attn_out_proj",
      axis=(-2, -1),
      kernel_init=fsdp_init("attn_out_proj", cfg),
      use_bias=False,
      dtype=cfg.dtype,
    )(out)


class TBlock(nn.Module):
  docfg: DoConfig

  @nn.compact
  def __call__(self, x_in):
    cfg = self.docfg
    x = nn.LayerNorm(dtype=cfg.dtype, use_bias=False)(x_in)
    x = CausalAttn(cfg)(x) + x_in
    z = Mlp(cfg)(nn.LayerNorm(dtype=cfg.dtype, use_bias=False)(x))
    return x + z


class TransformerDo(nn.Module):
  docfg: DoConfig

  def setup(self):
    cfg = self.docfg
    self.embed = nn.Embed(cfg.V, cfg.D, embedding_init=fsdp_init("embedding", cfg))
    self.pos_embed = nn.Embed(cfg.L, cfg.D, embedding_init=fsdp_init("embedding", cfg))
    block = nn.remat(TBlock) if cfg.remat else TBlock
    self.blocks = [block(cfg) for _ in range(cfg.N)]
    self.out_ln = nn.LayerNorm(dtype=cfg.dtype, use_bias=False)

  def __call__(self, y_BxL):
    y = self.embed(y_BxL)
    y += self.pos_embed(jnp.arange(0, y_BxL.shape[1])[None, ...])
    for block in self.blocks:
      y = block(y)
    return self.embed.attend(self.out_ln(y).astype(jnp.float32))


@struct.dataclass
class LossAuxData:
  ntokens: jax.Array
  state: dict
  log_perplexity: jax.Array


def get_in_out(in_BxL, pad_id: int = PAD_ID):
  """Inputs, next-token targets and their weights (nanodo's data.get_in_out)."""
  y = jnp.pad(in_BxL[:, 1:], ((0, 0), (0, 1)), mode="constant", constant_values=pad_id)
  return in_BxL, y, jnp.where(y != pad_id, 1, 0).astype(jnp.float32)


def get_default_loss_fn(in_BxL, apply_fn, c):
  """nanodo's loss factory: the loss closes over the batch."""

  def loss_fn(params):
    x, y, weights = get_in_out(in_BxL)
    logits, state = apply_fn({"params": params}, x, mutable=())
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    ntokens = weights.sum()
    mean_loss = jnp.sum(losses * weights) / ntokens
    return mean_loss, LossAuxData(ntokens=ntokens, state=state, log_perplexity=mean_loss)

  return loss_fn


def _train_step(state, in_BxL, c, mesh=None, value_and_grad=jax.value_and_grad):
  """nanodo's `_train_step` (metrics left out); `value_and_grad` is the swapped-in part."""
  if mesh is not None:
    in_BxL = jax.lax.with_sharding_constraint(in_BxL, NamedSharding(mesh, P("data")))
  grad_fn = value_and_grad(get_default_loss_fn(in_BxL, state.apply_fn, c), has_aux=True)
  (loss, aux), grads = grad_fn(state.params)
  updates, new_opt_state = state.tx.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  new_state = state.replace(
    step=state.opt_state.gradient_step + 1, params=new_params, opt_state=new_opt_state
  )
  return new_state, {"loss": loss, "ntokens": aux.ntokens}


def get_optimizer(lr: float = 3e-3):
  return optax.MultiSteps(optax.adamw(lr, weight_decay=0.1), 1)


def init_train_state(cfg: DoConfig, mesh: Mesh, seed: int = 0):
  """nanodo's `_init_train_state`: shardings from the partitioning metadata."""
  module = TransformerDo(cfg)
  inputs = jax.ShapeDtypeStruct((1, cfg.L), jnp.int32)

  def init(rng, inputs):
    params = module.init(rng, inputs)
    return TrainState.create(apply_fn=module.apply, params=params["params"], tx=get_optimizer())

  abstract = jax.eval_shape(init, jax.random.PRNGKey(seed), inputs)
  shardings = nn.get_sharding(abstract, mesh)
  state = jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(seed), inputs)
  return shardings, state


def make_step(shardings, mesh, c=None, value_and_grad=jax.value_and_grad):
  """nanodo's `Trainer.step_fn` (donation left out: the tests reuse their inputs)."""
  return jax.jit(
    functools.partial(_train_step, c=c, mesh=mesh, value_and_grad=value_and_grad),
    in_shardings=(shardings, NamedSharding(mesh, P())),
    out_shardings=(shardings, NamedSharding(mesh, P())),
  )


def mesh(n: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:n]), ("data",))


def batches(cfg: DoConfig, batch: int, steps: int, seed: int = 1):
  """Token batches with no padding inside (ids 1..V-1): equal token counts per shard."""
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.integers(1, cfg.V, (batch, cfg.L)), jnp.int32) for _ in range(steps)]


def unbox(tree):
  """Params without flax's partitioning boxes (for a plain comparison)."""
  return nn.meta.unbox(tree)
