"""flax glue: linen TrainState steps and nnx grads train like plain JAX.

The loops use SGD with momentum: Adam turns float32 noise in near-zero
gradients into full-size steps of either sign, which would test chaos, not
ooojax (single-step gradients agree to ~1e-8 either way).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from ooojax import flax as oflax
from tests.models import NnxNet

OPTS = {"mode": "single_gpu", "device": "H100"}


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = nn.Dropout(0.2, deterministic=not train)(x)
    return nn.Dense(10)(x.mean(axis=(1, 2)))


def _linen_state():
  model = LinenNet()
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 8, 3))
  v = model.init(jax.random.PRNGKey(1), x, train=False)
  state = oflax.TrainState.create(
    apply_fn=model.apply,
    params=v["params"],
    batch_stats=v["batch_stats"],
    tx=optax.sgd(0.05, momentum=0.9),
  )
  batch = {"x": x, "y": jnp.arange(4) % 10}
  return state, batch


def _linen_loss(params, batch, apply):
  logits = apply(params, batch["x"], train=True)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def test_linen_train_state_loop_matches_plain_jax(close):
  state0, batch = _linen_state()
  rng = jax.random.key(3)
  out = {}
  for use_ooo in (True, False):
    step = oflax.make_train_step(
      _linen_loss, mutable=("batch_stats",), rngs=("dropout",), use_ooo=use_ooo, **OPTS
    )
    state = state0
    for _ in range(10):
      state, metrics = step(state, batch, rng)
    out[use_ooo] = state
  close(out[True].params, out[False].params, rtol=1e-4)
  close(out[True].batch_stats, out[False].batch_stats, rtol=1e-4)
  assert int(out[True].step) == 10
  # the loop really trained and really updated the running statistics
  assert not jnp.allclose(
    out[True].batch_stats["BatchNorm_0"]["mean"], state0.batch_stats["BatchNorm_0"]["mean"]
  )


def test_linen_step_errors():
  state, batch = _linen_state()
  plain = oflax.TrainState.create(apply_fn=state.apply_fn, params=state.params, tx=optax.sgd(0.1))
  from flax.training import train_state

  bare = train_state.TrainState.create(
    apply_fn=state.apply_fn, params=state.params, tx=optax.sgd(0.1)
  )
  step = oflax.make_train_step(_linen_loss, mutable=("batch_stats",), rngs=("dropout",))
  with pytest.raises(TypeError, match="rng"):
    step(state, batch)
  with pytest.raises(TypeError, match="no field"):
    step(bare, batch, jax.random.key(0))
  del plain
  with pytest.raises(TypeError, match="unknown option"):
    oflax.make_train_step(_linen_loss, streem=2)


def test_linen_has_aux_without_mutable_collections(close):
  model = nn.Dense(3)
  x = jnp.linspace(-1, 1, 8).reshape(4, 2)
  state = oflax.TrainState.create(
    apply_fn=model.apply, tx=optax.sgd(0.1), params=model.init(jax.random.PRNGKey(0), x)["params"]
  )

  def loss(params, x, apply):
    y = apply(params, x)
    return jnp.mean(y**2), {"max": jnp.max(y)}

  out = [
    oflax.make_train_step(loss, has_aux=True, use_ooo=u, **OPTS)(state, x) for u in (True, False)
  ]
  close(out[0], out[1])
  assert set(out[0][1]) == {"loss", "aux"} and "max" in out[0][1]["aux"]


def _nnx_train(grad_fn, steps, jit):
  model = NnxNet(nnx.Rngs(0, dropout=1))
  opt = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
  x = jax.random.normal(jax.random.PRNGKey(2), (6, 8))
  loss = lambda m, x: jnp.mean(m(x) ** 2)

  def step(model, opt, x):
    grads = grad_fn(loss)(model, x)
    opt.update(model, grads)

  step = nnx.jit(step) if jit else step
  for _ in range(steps):
    step(model, opt, x)
  return nnx.state(model), opt


@pytest.mark.parametrize("jit,steps", [(True, 10), (False, 3)])
def test_nnx_loop_matches_nnx_grad(jit, steps, close):
  got, opt = _nnx_train(lambda f: oflax.nnx_grad(f, **OPTS), steps, jit)
  want, _ = _nnx_train(nnx.grad, steps, jit)
  close(jax.tree.map(jnp.asarray, got), jax.tree.map(jnp.asarray, want), rtol=1e-4)
  assert int(opt.step[...]) == steps
  # BatchNorm statistics and the dropout RNG counter moved, as with nnx.grad
  assert int(got["drop"]["rngs"]["count"][...]) == steps
  assert float(jnp.abs(got["bn"]["mean"][...]).sum()) > 0


def test_nnx_other_module_arguments_are_updated(close):
  def run(grad):
    model, side = nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(1))
    f = lambda m, side, x, scale=1.0: scale * jnp.sum(side(m(x)) ** 2)
    grads = grad(f)(model, side, jnp.arange(12.0).reshape(3, 4)[:, :3], scale=0.5)
    return grads, nnx.state(side)

  (g_got, side_got), (g_want, side_want) = run(oflax.nnx_grad), run(nnx.grad)
  close(jax.tree.map(jnp.asarray, g_got), jax.tree.map(jnp.asarray, g_want))
  close(jax.tree.map(jnp.asarray, side_got), jax.tree.map(jnp.asarray, side_want))
  assert float(jnp.abs(side_got["mean"][...]).sum()) > 0  # only the first module is differentiated


def test_nnx_value_and_grad_has_aux_and_bad_input(close):
  model = NnxNet(nnx.Rngs(0, dropout=1))
  model.eval()
  x = jnp.ones((2, 8))
  f = lambda m, x: (jnp.sum(m(x)), {"n": x.shape[0]})
  (loss, aux), grads = oflax.nnx_value_and_grad(f, has_aux=True)(model, x)
  (loss2, aux2), grads2 = nnx.value_and_grad(f, has_aux=True)(model, x)
  close(loss, loss2)
  assert aux == aux2
  close(jax.tree.map(jnp.asarray, grads), jax.tree.map(jnp.asarray, grads2))
  with pytest.raises(TypeError, match="nnx.Module"):
    oflax.nnx_grad(lambda m: 0.0)({"not": "a module"})


def test_orbax_checkpoint_round_trip(tmp_path, close):
  import orbax.checkpoint as ocp  # in the test extras: a missing install fails, not skips

  state, batch = _linen_state()
  step = oflax.make_train_step(_linen_loss, mutable=("batch_stats",), rngs=("dropout",), **OPTS)
  rng = jax.random.key(5)
  for _ in range(3):
    state, _ = step(state, batch, rng)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "state", state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  close(restored.params, state.params)
  close(restored.batch_stats, state.batch_stats)
  assert int(restored.step) == 3
  a, _ = step(state, batch, rng)
  b, _ = step(restored, batch, rng)  # training resumes identically
  close(a.params, b.params)
