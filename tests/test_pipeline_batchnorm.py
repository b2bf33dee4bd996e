"""BatchNorm in automatic pipelines: per-microbatch statistics (GPipe), the updated
collection returned in the aux (`state_argnums`).

Reference (`_loop`): the loss run microbatch by microbatch with the whole
`batch_stats`, `jax.value_and_grad` of the mean loss, the aux averaged
(`mean_aux`: each microbatch's updated running statistics, averaged).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import ooojax as ooo
from tests.conftest import assert_trees_close
from tests.test_pipeline_auto import _jit, _mesh

O0 = {"xla_backend_optimization_level": 0}


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.BatchNorm(use_running_average=False, momentum=0.9)(nn.Dense(16)(x))
    return x + nn.relu(h)


class _Net(nn.Module):
  stem_running: bool = False  # the stem normalises with its running statistics
  head_bn: bool = False

  @nn.compact
  def __call__(self, x):  # a BatchNorm before the stack (first stage) and in every block
    x = nn.BatchNorm(use_running_average=self.stem_running, momentum=0.9)(nn.Dense(16)(x))
    for _ in range(4):
      x = _Block()(x)
    if self.head_bn:  # and after it (the last stage)
      x = nn.BatchNorm(use_running_average=False, momentum=0.8)(x)
    return nn.Dense(10)(x)


def _case(model):
  """`(loss, params, stats, x, y)`: the loss returns the updated collection in its aux."""
  x = jax.random.normal(jax.random.key(0), (16, 8))
  y = jax.random.randint(jax.random.key(1), (16,), 0, 10)
  v = model.init(jax.random.key(2), x)
  stats = jax.tree.map(lambda a: a + 0.5, v["batch_stats"])  # not the init values

  def loss(params, stats, x, y):
    logits, upd = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return ce, {"batch_stats": upd["batch_stats"], "ce": ce}

  return loss, v["params"], stats, x, y


@pytest.fixture(scope="module")
def bn():
  return _case(_Net())


def _loop(loss, microbatches):
  def mean(p, stats, x, y):
    outs = [
      loss(p, stats, *(b.reshape(microbatches, -1, *b.shape[1:])[m] for b in (x, y)))
      for m in range(microbatches)
    ]
    aux = jax.tree.map(lambda *xs: jnp.stack(xs), *[o[1] for o in outs])
    return sum(o[0] for o in outs) / microbatches, ooo.pipeline.mean_aux(aux)

  return jax.value_and_grad(mean, has_aux=True)


def _equals_the_loop(loss, params, stats, x, y, stages, schedule):
  """The pipelined value, aux and gradient against `_loop`'s; returns the pipeline's."""
  M = 2 * stages
  step = ooo.pipeline.value_and_grad(
    loss,
    mesh=_mesh(stages),
    axis_name="stage",
    schedule=schedule,
    microbatches=M,
    has_aux=True,
    state_argnums=1,
  )
  got = _jit(step)(params, stats, x, y)
  assert_trees_close(got, _jit(_loop(loss, M))(params, stats, x, y))
  return got


@pytest.mark.parametrize("stages,schedule", [(2, "1f1b"), (4, "zb-h2")])
def test_batchnorm_equals_the_microbatch_loop(bn, stages, schedule):
  loss, params, stats, x, y = bn
  got = _equals_the_loop(*bn, stages, schedule)
  # per-microbatch statistics: not those of the whole batch
  whole = loss(params, stats, x, y)[1]["batch_stats"]["_Block_3"]["BatchNorm_0"]["var"]
  assert (
    float(jnp.max(jnp.abs(got[0][1]["batch_stats"]["_Block_3"]["BatchNorm_0"]["var"] - whole)))
    > 1e-4
  )


def test_batchnorm_trains_as_pipeline_steps(bn):
  # interleaved (2 chunks per device: the state's stage rows in device order), 2 SGD
  # steps, each step's updated statistics fed to the next (not Adam: the Dense biases
  # before a BatchNorm have a true gradient of zero, so Adam would follow rounding noise)
  loss, params, stats, x, y = bn
  opt = optax.sgd(0.1, momentum=0.9)
  step = ooo.pipeline.make_train_step(
    loss,
    opt,
    mesh=_mesh(2),
    axis_name="stage",
    schedule="interleaved",
    microbatches=4,
    has_aux=True,
    state_argnums=1,
    compiler_options=O0,
  )
  ref = jax.jit(_loop(loss, 4), compiler_options=O0)
  state, o, p, s = step.init(params, stats, x, y), opt.init(params), params, stats
  got_s = stats
  for t in range(2):
    xt, yt = jnp.roll(x, t, 0), jnp.roll(y, t, 0)
    state, (l, aux) = step(state, got_s, xt, yt)
    (lr, auxr), g = ref(p, s, xt, yt)
    u, o = opt.update(g, o, p)
    p, s, got_s = optax.apply_updates(p, u), auxr["batch_stats"], aux["batch_stats"]
    assert_trees_close((l, aux), (lr, auxr))
  assert_trees_close(step.params(state), p)


def test_batchnorm_refusals(bn):
  loss, params, stats, x, y = bn
  kw = dict(mesh=_mesh(2), axis_name="stage", schedule="1f1b", microbatches=2, has_aux=True)
  # state in the batch, unnamed: its leaves are not batch rows (here 16 features
  # as 16 rows: split, the loss fails to trace, and a note names the argument)
  with pytest.raises(ValueError, match="state_argnums"):
    jax.eval_shape(ooo.pipeline.value_and_grad(loss, **kw), params, stats, x[:8], y[:8])
  with pytest.raises(TypeError) as e:
    jax.eval_shape(ooo.pipeline.value_and_grad(loss, **kw), params, stats, x, y)
  assert "state_argnums" in str(getattr(e.value, "__notes__", ""))
  with pytest.raises(ValueError, match="state_argnums=4 must name"):
    jax.eval_shape(ooo.pipeline.value_and_grad(loss, state_argnums=4, **kw), params, stats, x, y)
  # the tiled step cannot carry state the first stage's forward reads (a stem
  # BatchNorm normalising with its running statistics): the last stage updates it
  frozen, params, stats, x, y = _case(_Net(stem_running=True))
  tiled = ooo.pipeline.make_train_step(frozen, optax.sgd(0.1), steps=2, state_argnums=1, **kw)
  with pytest.raises(ValueError, match="read by the first stage's forward"):
    tiled.init(params, stats, jnp.stack([x, x]), jnp.stack([y, y]))


def test_explain_with_batchnorm_state(bn):
  loss, params, stats, x, y = bn
  r = ooo.pipeline.explain(
    loss, params, stats, x, y, stages=2, schedule="1f1b", has_aux=True, state_argnums=1
  )
  assert r.cut.layers == 4


class _StackNet(nn.Module):
  @nn.compact
  def __call__(self, x):  # BatchNorm in the stack's blocks only (the tiled step's case)
    x = nn.Dense(16)(x)
    for _ in range(4):
      x = _Block()(x)
    return nn.Dense(10)(x)


def _tiled_equals_one_step_steps(loss, params, stats, x, y, steps, schedule="zb-v"):
  """make_train_step(steps=n): each step's updated statistics are the next step's
  inside one program (zb-v: deferred W, two chunks per device in device order);
  the reference is the one-step step called n times, its aux's statistics fed back."""
  opt = optax.sgd(0.1, momentum=0.9)
  kw = dict(
    mesh=_mesh(2),
    axis_name="stage",
    schedule=schedule,
    microbatches=4,
    has_aux=True,
    state_argnums=1,
    compiler_options=O0,
  )
  xs = jnp.stack([jnp.roll(x, t, 0) for t in range(steps)])
  ys = jnp.stack([jnp.roll(y, t, 0) for t in range(steps)])
  one = ooo.pipeline.make_train_step(loss, opt, **kw)
  state, s, ref = one.init(params, stats, x, y), stats, []
  for t in range(steps):
    state, (l, aux) = one(state, s, xs[t], ys[t])
    s = aux["batch_stats"]
    ref.append((l, aux))
  tiled = ooo.pipeline.make_train_step(loss, opt, steps=steps, **kw)
  ts = tiled.init(params, stats, xs, ys)  # the state argument: once, not per step
  ts, (losses, aux), final = tiled(ts, stats, xs, ys)
  assert_trees_close(losses, jnp.stack([r[0] for r in ref]))
  assert_trees_close(aux, jax.tree.map(lambda *a: jnp.stack(a), *[r[1] for r in ref]))
  assert_trees_close(final, s)  # the collection after the last step
  assert_trees_close(tiled.params(ts), one.params(state))


class _StemOnly(nn.Module):
  @nn.compact
  def __call__(self, x):  # state in the stem only: nothing in the stack to carry
    x = nn.BatchNorm(use_running_average=False, momentum=0.9)(nn.Dense(16)(x))
    for _ in range(4):
      x = x + nn.relu(nn.Dense(16)(x))
    return nn.Dense(10)(x)


@pytest.mark.parametrize(
  "model,schedule",
  [(_StackNet(), "zb-v"), (_Net(head_bn=True), "zb-v"), (_StemOnly(), "zb-h1")],
  ids=["stack-zb-v", "stem-stack-head-zb-v", "stem-only-zb-h1"],
)
def test_batchnorm_tiled_step_equals_one_step_steps(model, schedule):
  """The stack's BatchNorm state travels with its layers; the stem's (trained on
  batch statistics: only its update reads the running ones, which the last
  stage's epilogue recomputes) and the head's as the last stage's shared weights,
  set at its update to the step's mean update."""
  _tiled_equals_one_step_steps(*_case(model), steps=3, schedule=schedule)


# --- BatchNorm inside an nn.scan: the statistics stacked over the layers -------------
class _ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.BatchNorm(use_running_average=False, momentum=0.9)(nn.Dense(16)(x))
    return x + nn.relu(h), None


class _ScanNet(nn.Module):
  reverse: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16)(x)
    x, _ = nn.scan(
      _ScanBlock,
      variable_axes={"params": 0, "batch_stats": 0},
      split_rngs={"params": True},
      length=4,
      reverse=self.reverse,
    )()(x, None)
    return nn.Dense(10)(x)


def _scan_bn(reverse=False):
  model = _ScanNet(reverse)
  x = jax.random.normal(jax.random.key(0), (16, 8))
  y = jax.random.randint(jax.random.key(1), (16,), 0, 10)
  v = model.init(jax.random.key(2), x)
  # (4, 16) per leaf; each layer's statistics differ, so a misplaced row shows
  stats = jax.tree.map(lambda a: a + 0.5 + jnp.arange(4.0)[:, None], v["batch_stats"])

  def loss(params, stats, x, y):
    logits, upd = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return ce, {"batch_stats": upd["batch_stats"], "ce": ce}

  return loss, v["params"], stats, x, y


@pytest.mark.parametrize(
  "stages,schedule,reverse", [(2, "1f1b", False), (4, "zb-h2", True), (2, "interleaved", False)]
)
def test_batchnorm_under_nn_scan_equals_the_microbatch_loop(stages, schedule, reverse):
  case = _scan_bn(reverse)
  got = _equals_the_loop(*case, stages, schedule)
  stats = case[2]
  assert jax.tree.map(jnp.shape, got[0][1]["batch_stats"]) == jax.tree.map(jnp.shape, stats)


def test_batchnorm_under_nn_scan_tiled_step_equals_one_step_steps():
  _tiled_equals_one_step_steps(*_scan_bn(reverse=True), steps=2)


def test_state_read_by_every_layer_of_a_scan_is_refused():
  # one statistics vector read by all the layers (a scan constant): whose update?
  def loss(w, stats, x):
    h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w) * stats, None), x, w)[0]
    return jnp.mean(h**2), {"stats": stats * 0.9}

  w, x = jnp.ones((4, 8, 8)) / 8, jnp.ones((8, 8))
  step = ooo.pipeline.value_and_grad(
    loss, mesh=_mesh(2), axis_name="stage", microbatches=2, has_aux=True, state_argnums=1
  )
  with pytest.raises(ValueError, match="model state in every layer"):
    jax.eval_shape(step, w, jnp.ones((8,)), x)


def test_explain_with_batchnorm_state_under_nn_scan():
  loss, params, stats, x, y = _scan_bn()
  r = ooo.pipeline.explain(
    loss, params, stats, x, y, stages=2, schedule="1f1b", has_aux=True, state_argnums=1
  )
  assert r.cut.layers == 4 and "scan" in r.cut.summary()


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_batchnorm_under_nn_scan_under_set_mesh(axis_type):
  # today's JAX: the step traced and run under `jax.set_mesh`
  loss, params, stats, x, y = _scan_bn()
  mesh = jax.make_mesh(
    (2,),
    ("stage",),
    devices=jax.devices()[:2],
    axis_types=(getattr(jax.sharding.AxisType, axis_type),),
  )
  step = ooo.pipeline.value_and_grad(
    loss,
    mesh=mesh,
    axis_name="stage",
    schedule="1f1b",
    microbatches=4,
    has_aux=True,
    state_argnums=1,
  )
  with jax.set_mesh(mesh):
    got = _jit(step)(params, stats, x, y)
  assert_trees_close(got, _jit(_loop(loss, 4))(params, stats, x, y))
