"""Side inputs: pipeline stages whose layers read a per-example value besides the
activation (a padding mask built from the tokens, segment ids). Every stage rebuilds
it from its microbatch's batch leaves; gradients equal `jax.value_and_grad`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import ooojax as ooo
from ooojax.passes.pipeline.cut import cut
from tests.conftest import assert_trees_close
from tests.test_pipeline_auto import _check, _jit, _mesh, _raises
from tests.test_pipeline_train_step import _follow, _make, _reference


# --- a small LM: tokens padded with 0, causal + padding (+ segment) masks --------------
class _Block(nn.Module):
  dim: int
  heads: int

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(self.heads, qkv_features=self.dim)(h, mask=mask)
    return x + nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(nn.LayerNorm()(x))))


class _ScanBlock(_Block):
  def __call__(self, x, mask):
    return super().__call__(x, mask), None


class _LM(nn.Module):
  vocab: int = 11
  dim: int = 8
  heads: int = 2
  layers: int = 4
  scan: bool = True

  @nn.compact
  def __call__(self, tokens, segments=None):
    emb = nn.Embed(self.vocab, self.dim)
    x = emb(tokens)
    mask = nn.combine_masks(  # packed sequences: attend within one's segment only
      nn.make_causal_mask(tokens),
      nn.make_attention_mask(tokens != 0, tokens != 0),
      None if segments is None else nn.make_attention_mask(segments, segments, jnp.equal),
    )
    if self.scan:  # the mask is a scan constant
      x, _ = nn.scan(
        _ScanBlock,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=nn.broadcast,
        length=self.layers,
      )(self.dim, self.heads)(x, mask)
    else:  # every block reads it
      for _ in range(self.layers):
        x = _Block(self.dim, self.heads)(x, mask)
    return emb.attend(nn.LayerNorm()(x))


def _lm(scan=True, segments=False):
  model = _LM(scan=scan)
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  tokens = jax.random.randint(k1, (8, 7), 1, model.vocab)
  lengths = jax.random.randint(k2, (8, 1), 3, 8)
  tokens = jnp.where(jnp.arange(7) < lengths, tokens, 0)  # padded tails
  segs = (jnp.arange(6) >= jax.random.randint(k3, (8, 1), 1, 6)).astype(jnp.int32)
  params = model.init(jax.random.key(1), tokens[:1, :-1], segs[:1] if segments else None)["params"]

  def loss(params, tokens, *seg):
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits = model.apply({"params": params}, inputs, *seg)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.mean(ce * (labels != 0))

  return loss, params, (tokens, segs) if segments else (tokens,)


@pytest.mark.parametrize(
  "scan,stages,schedule",
  [(True, 2, "1f1b"), (True, 4, "zb-h1"), (False, 2, "interleaved"), (False, 4, "zb-h1")],
)
def test_padding_mask_lm(scan, stages, schedule):
  loss, params, batch = _lm(scan)
  _check(loss, params, batch, stages, schedule)


def test_segment_ids_beside_the_tokens():
  # a second batch leaf that only the layers read (packed sequences' segment ids)
  loss, params, batch = _lm(scan=False, segments=True)
  _check(loss, params, batch, 2, "1f1b")


def test_cut_records_the_side_leaves():
  loss, params, batch = _lm(scan=True, segments=True)
  leaves, tree = jax.tree.flatten(params)
  flat = lambda *xs: loss(tree.unflatten(xs[: len(leaves)]), *xs[len(leaves) :])  # noqa: E731
  c = cut(jax.make_jaxpr(flat)(*leaves, *batch), len(leaves))
  assert c.side == (0, 1) and c.inputs == (0,) and c.targets == (0,)


def test_scalar_side_input():
  # a scalar batch leaf every block reads (a temperature): whole to every microbatch
  def loss(params, x, y, temp):
    h = x @ params["in"]
    for w in params["w"]:
      h = h + jnp.tanh(h @ w) * temp
    return jnp.mean((h @ params["out"] - y) ** 2)

  ks = jax.random.split(jax.random.key(0), 5)
  params = {
    "in": jax.random.normal(ks[0], (5, 4)),
    "out": jax.random.normal(ks[1], (4, 3)),
    "w": [jax.random.normal(k, (4, 4)) * 0.5 for k in jax.random.split(ks[2], 4)],
  }
  x, y, temp = jax.random.normal(ks[3], (8, 5)), jax.random.normal(ks[4], (8, 3)), 0.7
  step = ooo.pipeline.value_and_grad(
    loss, mesh=_mesh(2), axis_name="stage", schedule="1f1b", microbatches=2
  )
  mean = lambda p: (loss(p, x[:4], y[:4], temp) + loss(p, x[4:], y[4:], temp)) / 2  # noqa: E731
  assert_trees_close(
    _jit(step)(params, x, y, jnp.float32(temp)), _jit(jax.value_and_grad(mean))(params)
  )


# --- what stays refused ----------------------------------------------------------------
def _scan_loss(side):
  def loss(params, x, key):
    s = side(params, x, key)
    h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w) * s, None), x, params["w"])[0]
    return jnp.mean((h @ params["out"]) ** 2)

  params = {"w": jnp.ones((2, 3, 3)) * 0.3, "g": jnp.ones((3, 3)), "out": jnp.ones((3, 2))}
  return loss, params, (jnp.ones((4, 3)), jax.random.key(0))


def test_side_value_of_parameters_refused():
  # the scan reads tanh(x @ g): per example, but of a parameter too
  loss, params, batch = _scan_loss(lambda p, x, key: jnp.tanh(x @ p["g"]))
  _raises(loss, params, batch, "computed from parameters too")


def test_dropout_key_refused():
  # a dropout mask drawn from a key in the batch: a microbatch's bits differ
  loss, params, batch = _scan_loss(
    lambda p, x, key: jax.random.bernoulli(key, 0.9, x.shape).astype(x.dtype)
  )
  _raises(loss, params, batch, "bits drawn for a microbatch differ")


# --- the explicit form: batch = (inputs, targets, side) --------------------------------
def test_explicit_side():
  stage_fn = lambda w, h, m: jnp.tanh(h @ w) * m[:, None]  # noqa: E731
  loss_fn = lambda y, t: jnp.mean((y - t) ** 2)  # noqa: E731
  w = jax.random.normal(jax.random.key(0), (2, 4, 4)) * 0.5
  x, t = jax.random.normal(jax.random.key(1), (8, 4)), jnp.zeros((8, 4))
  m = (jnp.arange(8) % 3 != 0).astype(jnp.float32)
  step = ooo.pipeline.value_and_grad(
    stage_fn, loss_fn, mesh=_mesh(2), axis_name="stage", schedule="zb-h1", microbatches=2
  )

  def mean_over_microbatches(w):
    rows = [slice(0, 4), slice(4, 8)]
    return sum(loss_fn(stage_fn(w[1], stage_fn(w[0], x[r], m[r]), m[r]), t[r]) for r in rows) / 2

  assert_trees_close(_jit(step)(w, (x, t, m)), _jit(jax.value_and_grad(mean_over_microbatches))(w))


def test_explicit_side_data_by_stage():
  # each data replica gets its rows of side, as of inputs and targets
  stage_fn = lambda w, h, m: jnp.tanh(h @ w) * m[:, None]  # noqa: E731
  loss_fn = lambda y, t: jnp.sum((y - t) ** 2)  # noqa: E731 - a sum: rows seen matter
  w = jax.random.normal(jax.random.key(0), (2, 4, 4)) * 0.5
  x, t = jax.random.normal(jax.random.key(1), (8, 4)), jnp.zeros((8, 4))
  m = jnp.arange(8, dtype=jnp.float32) / 8
  mesh = jax.make_mesh((2, 2), ("data", "stage"), devices=jax.devices()[:4])
  step = ooo.pipeline.value_and_grad(
    stage_fn,
    loss_fn,
    mesh=mesh,
    axis_name="stage",
    data_axis="data",
    schedule="1f1b",
    microbatches=2,
  )

  def mean_of_pieces(w):
    xs, ts, ms = x.reshape(4, 2, 4), t.reshape(4, 2, 4), m.reshape(4, 2)
    return (
      sum(loss_fn(stage_fn(w[1], stage_fn(w[0], a, c), c), b) for a, b, c in zip(xs, ts, ms)) / 4
    )

  assert_trees_close(_jit(step)(w, (x, t, m)), _jit(jax.value_and_grad(mean_of_pieces))(w))


# --- make_train_step ---------------------------------------------------------------------
def test_train_step_masked_lm():
  loss, params, (tokens,) = _lm(scan=False)
  batches = [(jnp.roll(tokens, t, axis=0),) for t in range(2)]
  opt = optax.adam(1e-2, eps=1e-4)
  ref = _reference(loss, opt, params, batches, 2)
  step = _make(loss, opt, _mesh(2), schedule="1f1b")
  state = step.init(params, *batches[0])
  _follow(step, state, batches, ref)  # loss and parameters after every step
