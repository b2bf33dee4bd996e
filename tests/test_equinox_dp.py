"""Equinox modules, data parallel under a sharded jax.jit (4 CPU devices).

Per-example keys (`split(key, batch)` vmapped over the rows) give each shard
its rows of the whole batch's split, so the loss and gradients equal
`eqx.filter_value_and_grad`'s on the whole batch. The batch is constrained in
the step with `eqx.filter_shard`, as Equinox's data-parallel example does.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

eqx = pytest.importorskip("equinox")

import ooojax as ooo  # noqa: E402
from ooojax import equinox as oeqx  # noqa: E402
from tests import _eqx_models as M  # noqa: E402


def _sharding():
  mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
  return NamedSharding(mesh, P("data"))


def _both(vg, loss, model, batch, key):
  data = _sharding()

  def step(vg, model, batch, key):
    return vg(loss)(model, *eqx.filter_shard(batch, data), key)

  return [eqx.filter_jit(step)(f, model, batch, key) for f in (vg, eqx.filter_value_and_grad)]


@pytest.mark.parametrize(
  "name,make",
  [("encoder", ooo.value_and_grad), ("cnn", oeqx.filter_value_and_grad)],
)
def test_data_parallel_equals_the_whole_batch(name, make, close):
  # the encoder: dropout from per-example keys (3 rows a shard) and per-layer
  # keys; the CNN: a max-pool's init=-inf and Dropout(p=0) left static
  if name == "encoder":
    model, batch = M.encoder_data(batch=12, n_layers=2)
    loss = M.encoder_loss
  else:
    (model, batch), loss = M.cnn_data(), M.cnn_loss
  vg = functools.partial(make, mode="data_parallel")
  (v, g), (rv, rg) = _both(vg, loss, model, batch, jax.random.key(7))
  close(v, rv)
  close(eqx.filter(g, eqx.is_inexact_array), eqx.filter(rg, eqx.is_inexact_array))


def test_make_train_step_takes_the_module(close):
  # ooojax.data_parallel's own step (its shard_map, cross-step overlap): the module's
  # inexact arrays are the state's params, held(state) gives the module back
  import optax

  from ooojax import data_parallel as dp

  model, (x, y) = M.cnn_data()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("batch",))
  opt = optax.sgd(0.1)
  loss = lambda m, b: M.cnn_loss(m, *b, jax.random.key(0))  # noqa: E731
  step = dp.make_train_step(loss, opt, mesh, cross_step=False)
  state, got = step(step.init(model, (x, y)), (x, y))
  trained = step.held(state)
  assert isinstance(trained, M.CNN) and trained.layers[1].init == -float("inf")
  ref, g = eqx.filter_value_and_grad(loss)(model, (x, y))
  close(got, ref)
  updates, _ = opt.update(g, opt.init(eqx.filter(model, eqx.is_inexact_array)))
  close(
    eqx.filter(trained, eqx.is_inexact_array),
    eqx.filter(eqx.apply_updates(model, updates), eqx.is_inexact_array),
  )


def test_bf16_reduction_on_a_module():
  # reduce_dtype on the module as the user holds it: gradients come back f32, within
  # bf16 rounding of the whole batch's, and not bit-equal (the reduction ran in bf16)
  import jax.numpy as jnp

  (model, batch), loss = M.cnn_data(), M.cnn_loss
  vg = functools.partial(
    oeqx.filter_value_and_grad, mode="data_parallel", reduce_dtype=jnp.bfloat16
  )
  (v, g), (rv, rg) = _both(vg, loss, model, batch, jax.random.key(7))
  got = jax.tree.leaves(eqx.filter(g, eqx.is_inexact_array))
  ref = jax.tree.leaves(eqx.filter(rg, eqx.is_inexact_array))
  assert all(a.dtype == b.dtype == jnp.float32 for a, b in zip(got, ref))
  np.testing.assert_allclose(v, rv, rtol=1e-5)
  for a, b in zip(got, ref):
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * float(np.abs(b).max()))
  assert any(not np.array_equal(a, b) for a, b in zip(got, ref))
