"""Pipelines of the losses people write: aux metrics, dropout keys, the tiled
explain on a causal LM whose targets are its inputs, and optimizers with masks of
the user's tree (BatchNorm: `test_pipeline_batchnorm.py`).

Reference (`_loop`): the loss run microbatch by microbatch, microbatch m with the
key `fold_in(key, m)`, its loss and floating aux averaged (`jax.value_and_grad` of
that mean), integer aux stacked.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import ooojax as ooo
from tests import _lm1b
from tests.conftest import assert_trees_close
from tests.test_pipeline_auto import _jit, _mesh

O0 = {"xla_backend_optimization_level": 0}
M = 4


def _loop(loss, microbatches=M):
  """`(params, *batch) -> ((loss, aux), grads)`: the microbatch loop, scalar keys folded."""

  def mean(p, *batch):
    outs = []
    for m in range(microbatches):
      part = [
        jax.random.fold_in(b, m)
        if ooo.pipeline.is_key(b)
        else b.reshape(microbatches, -1, *b.shape[1:])[m]
        for b in batch
      ]
      outs.append(loss(p, *part))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[o[1] for o in outs])
    return sum(o[0] for o in outs) / microbatches, stacked

  def run(p, *batch):
    (l, aux), g = jax.value_and_grad(mean, has_aux=True)(p, *batch)
    return (l, ooo.pipeline.mean_aux(aux)), g

  return run


@pytest.fixture(scope="module")
def lm():
  return _lm1b.make(layers=4, rate=0.1)


def test_dropout_and_metrics_equal_the_microbatch_loop(lm):
  # linen nn.Dropout in every block and after the embedding, rngs={"dropout": key}:
  # each block folds its own constant into the key, the stage hands it over (zb-v:
  # two chunks per device in a V, so the stage index matters); 1f1b and zb-h2 below
  _, loss, params, tokens = lm
  key = jax.random.key(7)
  step = ooo.pipeline.value_and_grad(
    loss, mesh=_mesh(2), axis_name="stage", schedule="zb-v", microbatches=M, has_aux=True
  )
  got = _jit(step)(params, tokens, key)
  want = _jit(_loop(loss))(params, tokens, key)
  assert_trees_close(got, want)
  assert got[0][1]["tokens"].shape == (M,)  # integer aux: stacked per microbatch
  # the bits really differ per microbatch: the same key for all gives another loss
  same = _jit(step)(params, tokens, jax.random.key(8))
  assert abs(float(same[0][0]) - float(got[0][0])) > 1e-4


class _NnxBlock(nnx.Module):
  def __init__(self, dim, rngs):
    self.up, self.down = nnx.Linear(dim, 2 * dim, rngs=rngs), nnx.Linear(2 * dim, dim, rngs=rngs)
    self.drop = nnx.Dropout(0.2)

  def __call__(self, x, rngs):
    return x + self.drop(self.down(nnx.gelu(self.up(x))), rngs=rngs)


class _NnxNet(nnx.Module):
  def __init__(self, dim, layers, rngs):
    self.inp, self.out = nnx.Linear(3, dim, rngs=rngs), nnx.Linear(dim, 2, rngs=rngs)
    self.blocks = nnx.List([_NnxBlock(dim, rngs) for _ in range(layers)])

  def __call__(self, x, rngs):
    x = self.inp(x)
    for b in self.blocks:
      x = b(x, rngs)
    return self.out(x)


def test_nnx_rngs_dropout_and_the_users_aux_reduce():
  # nnx.Rngs(dropout=key) made in the loss: each draw folds the stream's count into
  # the key (a constant per block); interleaved chunks; the user's own aux reduction
  graph, params = nnx.split(_NnxNet(8, 4, nnx.Rngs(0)), nnx.Param)

  def loss(params, x, y, key):
    out = nnx.merge(graph, params)(x, nnx.Rngs(dropout=key))
    mse = jnp.mean((out - y) ** 2)
    return mse, {"mse": mse, "big": jnp.sum(jnp.abs(out) > 0.5)}

  ks = jax.random.split(jax.random.key(0), 2)
  batch = (jax.random.normal(ks[0], (8, 3)), jax.random.normal(ks[1], (8, 2)), jax.random.key(5))
  step = ooo.pipeline.value_and_grad(
    loss, mesh=_mesh(2), axis_name="stage", schedule="interleaved", microbatches=M, has_aux=True
  )
  assert_trees_close(_jit(step)(*(params,) + batch), _jit(_loop(loss))(params, *batch))
  total = ooo.pipeline.value_and_grad(
    loss,
    mesh=_mesh(2),
    axis_name="stage",
    schedule="interleaved",
    microbatches=M,
    has_aux=True,
    aux_reduce=lambda a: {"mse": a["mse"], "big": a["big"].sum()},
  )
  (_, aux), _ = _jit(total)(params, *batch)
  want = _jit(_loop(loss))(params, *batch)[0][1]
  assert aux["mse"].shape == (M,) and int(aux["big"]) == int(want["big"].sum())


ADAM = optax.adam(1e-2, eps=1e-4)


def _reference_steps(loss, opt, params, batches):
  grad = _loop(loss)

  def one(params, o, *b):  # one compile for the whole step (eager optax compiles per op)
    (l, aux), g = grad(params, *b)
    u, o = opt.update(g, o, params)
    return (l, aux), optax.apply_updates(params, u), o

  run = jax.jit(one, compiler_options=O0)
  o, out = jax.jit(opt.init)(params), []
  for b in batches:
    (l, aux), params, o = run(params, o, *b)
    out.append((l, aux, params))
  return out


@pytest.fixture(scope="module")
def lm_steps(lm):
  """3 batches with a new key each, and the microbatch loop's 3 Adam steps on them."""
  _, loss, params, tokens = lm
  batches = [
    (jnp.roll(tokens, t, axis=0), jax.random.fold_in(jax.random.key(3), t)) for t in range(3)
  ]
  return batches, _reference_steps(loss, ADAM, params, batches)


@pytest.mark.parametrize("schedule,steps", [("1f1b", 1), ("zb-h2", 3)])
def test_dropout_lm_trains_as_pipeline_steps(lm, lm_steps, schedule, steps):
  # 4 stages, 3 Adam steps with a new key each step: 1F1B one step per call,
  # ZB-H2 the three steps as one table tiled over steps (one reference for both)
  _, loss, params, tokens = lm
  opt = ADAM
  batches, ref = lm_steps
  step = ooo.pipeline.make_train_step(
    loss,
    opt,
    mesh=_mesh(4),
    axis_name="stage",
    schedule=schedule,
    microbatches=M,
    has_aux=True,
    steps=steps,
    compiler_options=O0,
  )
  if steps == 1:
    state = step.init(params, *batches[0])
    for t, b in enumerate(batches):
      state, (l, aux) = step(state, *b)
      assert_trees_close((l, aux), ref[t][:2])
  else:
    stacked = tuple(jnp.stack(xs) for xs in zip(*batches))
    state = step.init(params, *stacked)
    state, (ls, aux) = step(state, *stacked)
    for t in range(3):
      assert_trees_close((ls[t], jax.tree.map(lambda a, t=t: a[t], aux)), ref[t][:2])
  assert_trees_close(step.params(state), ref[-1][2])


def test_explain_tiled_on_a_causal_lm_every_schedule():
  # the loss reads the tokens as inputs and as targets (and a dropout key, and returns
  # metrics); explain(steps=n) traces the ends at one microbatch's shapes (the whole
  # batch would not broadcast against the equations traced at a microbatch's)
  _, loss, params, tokens = _lm1b.make(layers=8, batch=16)
  for schedule in ooo.pipeline.SCHEDULES:
    r = ooo.pipeline.explain(
      loss,
      params,
      tokens,
      jax.random.key(0),
      stages=4,
      schedule=schedule,
      microbatches=8,
      steps=2,
      has_aux=True,
    )
    assert r.steady_state().steps == 2 and r.cut.layers == 8, schedule


def _masked_opts(params):
  decay = jax.tree.map(lambda x: x.ndim > 1, params)  # the user's tree
  labels = jax.tree.map(lambda x: "fast" if x.ndim > 1 else "slow", params)
  return [
    # a mask function sees the user's tree: on the stacked layout it would see
    # the biases as 3-d and decay them
    optax.chain(
      optax.masked(optax.add_decayed_weights(0.5), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
      optax.sgd(0.1),
    ),
    optax.adamw(1e-2, weight_decay=0.5, mask=decay),  # a mask tree, inside adamw
    optax.partition({"fast": optax.sgd(0.2), "slow": optax.sgd(0.01)}, labels),
    # a mask function among inject_hyperparams' static hyperparameters (it builds
    # adamw, and its masked, on every call)
    optax.inject_hyperparams(optax.adamw, static_args="mask")(
      learning_rate=1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    ),
  ]


@pytest.mark.parametrize("k", range(4))
def test_masked_optimizers_see_the_users_tree(k):
  # optax.masked (a function; a tree, in adamw) and partition labels, made for the
  # user's parameters, against the same optimizer on the microbatch loop's gradients
  from tests.test_pipeline_auto import _mlp

  loss, params, batch = _mlp()
  opt = _masked_opts(params)[k]
  step = ooo.pipeline.make_train_step(
    loss,
    opt,
    mesh=_mesh(2),
    axis_name="stage",
    schedule="1f1b",
    microbatches=2,
    compiler_options=O0,
  )
  state = step.init(params, *batch)
  run = jax.jit(jax.value_and_grad(lambda p, *b: _loop(lambda *a: (loss(*a), {}), 2)(p, *b)[0][0]))
  o, p = opt.init(params), params
  for _ in range(2):
    state, _ = step(state, *batch)
    g = run(p, *batch)[1]
    u, o = opt.update(g, o, p)
    p = optax.apply_updates(p, u)
  assert_trees_close(step.params(state), p)


def test_masks_that_differ_between_layers_are_refused():
  from tests.test_pipeline_auto import _mlp

  loss, params, batch = _mlp()
  mask = jax.tree.map(lambda x: False, params)
  mask["layers"][1]["w"] = True  # one layer's weight decayed, the others not
  opt = optax.masked(optax.add_decayed_weights(0.1), mask)
  step = ooo.pipeline.make_train_step(
    loss, opt, mesh=_mesh(2), axis_name="stage", schedule="1f1b", microbatches=2
  )
  with pytest.raises(ValueError, match="different values"):
    step.init(params, *batch)


def test_mask_functions_that_cannot_be_laid_out_are_refused():
  # a mask function kept where no known transform keeps it would be called with
  # StageParams: refused by name, not silently applied to the stacked layout
  from tests.test_pipeline_auto import _mlp

  loss, params, batch = _mlp()
  decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731

  def my_decay(mask):  # a custom transform closing over its mask
    def update(u, s, p=None):
      return jax.tree.map(lambda g, w, m: g + 0.1 * w * m, u, p, mask(p)), s

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

  kw = dict(mesh=_mesh(2), axis_name="stage", schedule="1f1b", microbatches=2)
  cases = [
    (optax.chain(my_decay(decay), optax.sgd(0.1)), "'mask'.*optax.masked"),
    # inject_hyperparams takes a callable for a schedule unless static_args names it
    (optax.inject_hyperparams(optax.adamw)(learning_rate=0.1, mask=decay), "static_args='mask'"),
  ]
  for opt, match in cases:
    with pytest.raises(ValueError, match=match):
      ooo.pipeline.make_train_step(loss, opt, **kw).init(params, *batch)


def test_scanned_dropout_keys_refused():
  # nn.scan splits the dropout key per layer and scans over the keys: refused, naming it
  import flax.linen as nn

  from tests.test_pipeline_auto import _raises

  class Body(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.Dropout(0.5, deterministic=False)(nn.Dense(4)(x)), None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(
        Body, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True}, length=4
      )
      return scan()(x, None)[0]

  model, x = Net(), jnp.ones((8, 4))
  params = model.init(jax.random.key(0), x)["params"]

  def loss(p, x, key):
    return jnp.mean(model.apply({"params": p}, x, rngs={"dropout": key}) ** 2)

  _raises(loss, params, (x, jax.random.key(1)), "per-layer keys split from a key")
