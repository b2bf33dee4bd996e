"""Every user-facing jitted step stays on jit's C++ fast path.

Any effect in a jitted function's jaxpr (io_callback, debug callbacks, ordered
effects, an FFI effect) turns that path off, and every call then dispatches
through Python: 3.5 ms a step for the demo CNN on the H200, 31.6 ms for ResNet-50
(RESULTS, "The third GPU run"). For each step ooojax builds or a user jits, the
traced jaxpr has no effect, and repeated calls never reach Python
(`passes._compat.python_dispatches`, on CPU).
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ooojax as ooo
from ooojax import gpu_hlo
from ooojax.passes import _compat

D = 32


def _params(n=4):
  ks = jax.random.split(jax.random.key(0), n)
  return {f"w{i}": jax.random.normal(k, (D, D)) / 8 for i, k in enumerate(ks)}


def _loss(p, x):
  for i in range(len(p)):
    x = jnp.tanh(x @ p[f"w{i}"])
  return jnp.mean(x**2)


def _pipe_loss(p, x, y):
  for w in p["ws"]:
    x = jnp.tanh(x @ w)
  return jnp.mean((x - y) ** 2)


def _x(rows=16):
  return jax.random.normal(jax.random.key(1), (rows, D))


def _mesh(n, name, kind="Auto"):
  kind = (getattr(jax.sharding.AxisType, kind),)
  return jax.make_mesh((n,), (name,), devices=jax.devices()[:n], axis_types=kind)


def _user_jit(mode, **kw):
  p, x = _params(), _x()
  if mode == "data_parallel":  # a sharded jit: the batch split over the mesh (GSPMD)
    x = jax.device_put(x, NamedSharding(_mesh(4, "batch", "Explicit"), P("batch")))

  @jax.jit
  def step(p, x):
    loss, g = ooo.value_and_grad(_loss, mode=mode, **kw)(p, x)
    return loss, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

  return step, (p, x)


def _dp_shard_map():
  mesh = _mesh(4, "batch")
  f = jax.shard_map(
    lambda p, x: ooo.grad(_loss, mode="data_parallel", axis_name="batch")(p, x),
    mesh=mesh,
    in_specs=(P(), P("batch")),
    out_specs=P(),
  )
  return jax.jit(f), (_params(), _x())


def _pipeline_grad():
  p = {"ws": list(_params().values())}
  step = ooo.pipeline.value_and_grad(
    _pipe_loss, mesh=_mesh(2, "stage"), axis_name="stage", schedule="1f1b", microbatches=2
  )
  return jax.jit(step), (p, _x(), _x())


def _single_gpu_train(**kw):
  from ooojax import single_gpu

  step = single_gpu.make_train_step(_loss, optax.sgd(0.1), device="H100", **kw)
  p, x = _params(), _x()
  return step, (step.init(p, x), x)


def _dp_train():
  from ooojax import data_parallel

  step = data_parallel.make_train_step(_loss, optax.sgd(0.1), _mesh(4, "batch"))
  p, x = _params(), _x()
  return step, (step.init(p, x), x)


def _pipeline_train(steps=1):
  p = {"ws": list(_params().values())}
  step = ooo.pipeline.make_train_step(
    _pipe_loss,
    optax.adam(1e-2),
    mesh=_mesh(2, "stage"),
    axis_name="stage",
    schedule="zb-h2",
    microbatches=2,
    steps=steps,
  )
  x = _x() if steps == 1 else jnp.stack([_x()] * steps)
  return step, (step.init(p, x, x), x, x)


def _flax_train():
  import flax.linen as nn

  from ooojax.flax import TrainState, make_train_step

  model = nn.Sequential([nn.Dense(D), nn.tanh, nn.Dense(D)])
  x = _x()
  state = TrainState.create(
    apply_fn=model.apply, tx=optax.sgd(0.1), params=model.init(jax.random.key(0), x)["params"]
  )
  loss = lambda p, b, apply: jnp.mean(apply(p, b) ** 2)  # noqa: E731
  return make_train_step(loss, mode="single_gpu", device="H100"), (state, x)


def _nnx_grad():
  from flax import nnx

  from ooojax.flax import nnx_grad

  m = nnx.Linear(D, D, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(m)
  loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
  step = jax.jit(lambda s, x: nnx_grad(loss, mode="single_gpu")(nnx.merge(graphdef, s), x))
  return step, (state, _x())


def _pipeline_train_by_hand():
  opt = optax.sgd(0.1)
  run = ooo.pipeline.train(
    lambda w, x: jnp.tanh(x @ w),
    lambda y, t: jnp.mean((y - t) ** 2),
    opt,
    mesh=_mesh(2, "stage"),
    axis_name="stage",
    schedule="zb-h2",
    microbatches=2,
    steps=2,
  )
  w = jnp.stack(list(_params(2).values()))
  xs = jnp.stack([_x()] * 2)
  return jax.jit(run), (w, jax.vmap(opt.init)(w), (xs, xs))


def _equinox():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(D, D, D, 2, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  loss = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)  # noqa: E731

  @jax.jit
  def step(params, x):  # the module whole inside the jit, as eqx.filter_jit passes it
    return ooo.value_and_grad(loss, mode="single_gpu", device="H100")(
      eqx.combine(params, static), x
    )

  return step, (params, _x())


STEPS = {
  "single_gpu": lambda: _user_jit("single_gpu", device="H100"),
  "single_gpu control_deps": lambda: _user_jit(
    "single_gpu", device="H100", ordering="control_deps"
  ),
  "auto": lambda: _user_jit("auto", device="H100"),
  "data_parallel sharded jit": lambda: _user_jit("data_parallel"),
  "data_parallel shard_map": _dp_shard_map,
  "pipeline value_and_grad": _pipeline_grad,
  "single_gpu train step": lambda: _single_gpu_train(defer=("w3",)),
  "data_parallel train step": _dp_train,
  "pipeline train step": _pipeline_train,
  "pipeline tiled train step": lambda: _pipeline_train(steps=2),
  "pipeline train (a stack by hand)": _pipeline_train_by_hand,
  "equinox": _equinox,
  "flax train step": _flax_train,
  "flax nnx_grad": _nnx_grad,
}


def test_python_dispatches_are_counted():
  # the counter's control: a debug callback's effect sends every call through Python
  f = jax.jit(lambda x: (jax.debug.callback(lambda _: None, x), x * 2)[1])
  x = jnp.ones(3)
  f(x), f(x)
  with _compat.python_dispatches() as n:
    for _ in range(3):
      f(x)
  assert n() == 3


@pytest.mark.parametrize("name", list(STEPS))
def test_every_step_keeps_jits_fast_dispatch(name):
  step, args = STEPS[name]()
  step(*args)  # compiles; the second call is the first the C++ cache can serve
  step(*args)
  with _compat.python_dispatches() as n:
    for _ in range(3):
      jax.block_until_ready(step(*args))
  assert n() == 0, f"{name}: {n()} of 3 calls went through Python"
  jitted = getattr(step, "_step", step)  # a train step object's jax.jit
  assert jax.make_jaxpr(jitted)(*args).effects == set()


@pytest.mark.skipif(gpu_hlo.unavailable_reason() is not None, reason="no compile-only GPUs")
def test_pipeline_steps_for_gpus_carry_no_effect():
  # the tick loop a GPU mesh gets (its own lowering, `passes.pipeline.execute`) traced
  # for 2 compile-only H100s: no effect either (the single-GPU and data-parallel
  # jaxprs do not depend on the mesh's platform)
  g = gpu_hlo.mesh("H100", (2,), ("stage",))
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(g, P()))  # noqa: E731
  p, x, xs = {"ws": [sds(D, D)] * 4}, sds(16, D), sds(2, 16, D)
  kw = dict(mesh=g, axis_name="stage", schedule="zb-h2", microbatches=2)
  vg = ooo.pipeline.value_and_grad(_pipe_loss, **kw)
  assert jax.make_jaxpr(vg)(p, x, x).effects == set()
  for steps, b in ((1, x), (2, xs)):
    step = ooo.pipeline.make_train_step(_pipe_loss, optax.adam(1e-2), steps=steps, **kw)
    state = step.abstract_state(p, b, b)
    assert jax.make_jaxpr(step._jitted(state))(state, b, b).effects == set()
