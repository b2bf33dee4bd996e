"""Pipelined loss and gradients equal jax.grad of the unpipelined model (forced CPU devices)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import ooojax as ooo
from tests.conftest import assert_trees_close
from tests.models import Block


def _jit(f):
  # Correctness tests compile at XLA O0: a third less compile time on 2 shared cores.
  return jax.jit(f, compiler_options={"xla_backend_optimization_level": 0})


def _mesh(n):
  return jax.make_mesh((n,), ("stage",), devices=jax.devices()[:n])


def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _reference(stage_fn, loss_fn, params, inputs, targets, input_fn=None, shared=None, jit=_jit):
  """The same model without a pipeline: jax.value_and_grad of the plain stack."""

  def loss(params, *extra):
    h = inputs if input_fn is None else input_fn(inputs, *extra)
    for j in range(jax.tree.leaves(params)[0].shape[0]):
      h = stage_fn(jax.tree.map(lambda a: a[j], params), h)
    return loss_fn(h, targets, *extra)

  if shared is None:
    return jit(jax.value_and_grad(loss))(params)
  return jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, shared)


class Layer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.gelu(nn.Dense(8)(nn.relu(nn.Dense(16)(x))))


def _mlp(n_vstages):
  layer = Layer()
  keys = jax.random.split(jax.random.key(0), n_vstages)
  params = _stack([layer.init(k, jnp.zeros((1, 8)))["params"] for k in keys])
  stage_fn = lambda p, x: layer.apply({"params": p}, x)  # noqa: E731
  loss_fn = lambda y, t: jnp.mean((y - t) ** 2)  # noqa: E731
  x = jax.random.normal(jax.random.key(1), (8, 8))
  t = jax.random.normal(jax.random.key(2), (8, 8))
  return stage_fn, loss_fn, params, x, t


def check_mlp_schedule(name, stages=2, lag=0):
  """The MLP stack pipelined by schedule `name` equals jax.grad's loss and grads
  (the check every tick lowering runs: switch, select, CUDA graphs, weight slices)."""
  sched = ooo.pipeline.schedule(name, stages=stages, microbatches=4, lag=lag)
  stage_fn, loss_fn, params, x, t = _mlp(sched.virtual_stages)
  step = ooo.pipeline.value_and_grad(
    stage_fn, loss_fn, mesh=_mesh(stages), axis_name="stage", schedule=sched
  )
  loss, grads = _jit(step)(params, (x, t))
  ref_loss, ref_grads = _reference(stage_fn, loss_fn, params, x, t)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)


@pytest.mark.parametrize(
  "stages,name,lag",
  [
    (2, "gpipe", 0),
    (2, "1f1b", 0),
    (2, "ooo", 0),
    (2, "zb-h1", 1),
    (2, "zb-h2", 0),
    (2, "interleaved", 0),
    (4, "ooo", 0),
    (4, "interleaved", 0),
    (4, "zb-v", 1),
    # lag 1 sends on the pairs a table uses: interleaved's last -> first hop, 1F1B's none
    (4, "interleaved", 1),
    (4, "1f1b", 1),
  ],
)
def test_mlp_matches_jax_grad(stages, name, lag):
  # lag=1: transfers received a tick after the send (overlapped with compute).
  check_mlp_schedule(name, stages, lag)


def test_transformer_stack_matches_jax_grad():
  block = Block(dim=16, heads=2)
  x = jax.random.normal(jax.random.key(1), (4, 5, 16))
  params = _stack(
    [block.init(k, x[:1], train=False)["params"] for k in jax.random.split(jax.random.key(0), 2)]
  )
  stage_fn = lambda p, h: block.apply({"params": p}, h, train=False)  # noqa: E731
  loss_fn = lambda y, t: jnp.mean((y - t) ** 2)  # noqa: E731
  t = jax.random.normal(jax.random.key(2), x.shape)
  step = ooo.pipeline.value_and_grad(
    stage_fn, loss_fn, mesh=_mesh(2), axis_name="stage", schedule="zb-h1", microbatches=4
  )
  loss, grads = _jit(step)(params, (x, t))
  ref_loss, ref_grads = _reference(stage_fn, loss_fn, params, x, t)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)


def _tied():
  vocab, dim = 11, 8
  layer = Layer()
  params = _stack(
    [layer.init(k, jnp.zeros((1, dim)))["params"] for k in jax.random.split(jax.random.key(0), 2)]
  )
  shared = {"emb": jax.random.normal(jax.random.key(3), (vocab, dim)) * 0.3}
  input_fn = lambda tok, sh: sh["emb"][tok]  # noqa: E731

  def loss_fn(y, labels, sh):  # the output projection reuses the embedding
    logits = y @ sh["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  stage_fn = lambda p, x: layer.apply({"params": p}, x)  # noqa: E731
  tokens = jax.random.randint(jax.random.key(4), (8,), 0, vocab)
  labels = jax.random.randint(jax.random.key(5), (8,), 0, vocab)
  return stage_fn, loss_fn, input_fn, params, shared, tokens, labels


def test_tied_embeddings_reduced_once():
  stage_fn, loss_fn, input_fn, params, shared, tokens, labels = _tied()
  step = ooo.pipeline.value_and_grad(
    stage_fn,
    loss_fn,
    mesh=_mesh(2),
    axis_name="stage",
    schedule="ooo",
    microbatches=2,
    input_fn=input_fn,
  )
  loss, grads = _jit(step)(params, (tokens, labels), shared)
  ref_loss, ref_grads = _reference(stage_fn, loss_fn, params, tokens, labels, input_fn, shared)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)  # (stage grads, shared grads): not double-counted


def test_checkpoint_inside_a_stage():
  stage_fn, loss_fn, params, x, t = _mlp(2)
  remat = jax.checkpoint(stage_fn)
  step = ooo.pipeline.value_and_grad(
    remat, loss_fn, mesh=_mesh(2), axis_name="stage", schedule="zb-h1", microbatches=2
  )
  loss, grads = _jit(step)(params, (x, t))
  ref_loss, ref_grads = _reference(stage_fn, loss_fn, params, x, t)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)


def test_jitted_optax_step_trains_identically():
  stage_fn, loss_fn, params, x, t = _mlp(2)
  opt = optax.adam(1e-2)
  step = ooo.pipeline.value_and_grad(
    stage_fn, loss_fn, mesh=_mesh(2), axis_name="stage", schedule="ooo", microbatches=4
  )

  def make(grad_fn):
    @jax.jit
    def train(params, state):
      loss, g = grad_fn(params)
      updates, state = opt.update(g, state, params)
      return optax.apply_updates(params, updates), state, loss

    return train

  pipe = make(lambda p: step(p, (x, t)))
  ref = make(lambda p: _reference(stage_fn, loss_fn, p, x, t, jit=lambda f: f))
  pa, sa = params, opt.init(params)
  pb, sb = params, opt.init(params)
  for _ in range(3):
    pa, sa, la = pipe(pa, sa)
    pb, sb, lb = ref(pb, sb)
    assert_trees_close(la, lb)
  assert_trees_close(pa, pb)


def test_bad_arguments():
  stage_fn, loss_fn, params, x, t = _mlp(2)
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    ooo.pipeline.value_and_grad(stage_fn, loss_fn, mesh=_mesh(2), axis_name="pp")
  sched = ooo.pipeline.schedule("1f1b", stages=4, microbatches=4)
  with pytest.raises(ValueError, match="has 4 stages but mesh axis 'stage' has 2"):
    ooo.pipeline.value_and_grad(stage_fn, loss_fn, mesh=_mesh(2), axis_name="stage", schedule=sched)
  step = ooo.pipeline.value_and_grad(
    stage_fn, loss_fn, mesh=_mesh(2), axis_name="stage", schedule="1f1b", microbatches=3
  )
  with pytest.raises(ValueError, match="divisible by microbatches=3"):
    step(params, (x, t))
  step = ooo.pipeline.value_and_grad(
    stage_fn, loss_fn, mesh=_mesh(2), axis_name="stage", schedule="interleaved", microbatches=2
  )
  with pytest.raises(ValueError, match="leading axis of 4"):
    step(params, (x, t))


def test_hand_cut_stages_under_explicit_set_mesh():
  # stage functions traced as the shard_map body runs them (every axis manual)
  stage_fn, loss_fn, params, x, t = _mlp(4)
  explicit = (jax.sharding.AxisType.Explicit,)
  mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2], axis_types=explicit)
  sched = ooo.pipeline.schedule("interleaved", stages=2, microbatches=4)
  step = ooo.pipeline.value_and_grad(
    stage_fn, loss_fn, mesh=mesh, axis_name="stage", schedule=sched
  )
  want = _reference(stage_fn, loss_fn, params, x, t)
  with jax.set_mesh(mesh):
    assert_trees_close(_jit(step)(params, (x, t)), want)
