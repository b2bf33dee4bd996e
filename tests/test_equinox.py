"""Equinox modules as the differentiated argument: trained as eqx.filter_value_and_grad trains them."""

import functools

import jax
import jax.numpy as jnp
import pytest

eqx = pytest.importorskip("equinox")

import ooojax as ooo  # noqa: E402
from ooojax import equinox as oeqx  # noqa: E402
from tests import _eqx_models as M  # noqa: E402

MODELS = {
  "cnn": (M.cnn_loss, M.cnn_data, True),
  "fields": (M.fields_loss, M.fields_data, False),
  "encoder": (M.encoder_loss, functools.partial(M.encoder_data, n_layers=2), True),
}


def _same(a, b, close):
  la, lb = a[0], b[0]
  assert la == pytest.approx(lb, rel=1e-5, abs=1e-6)
  close(eqx.filter(a[1], eqx.is_inexact_array), eqx.filter(b[1], eqx.is_inexact_array))


@pytest.mark.parametrize(
  "name,spelling,mode",
  [
    ("cnn", "module", "auto"),
    ("fields", "filter", "in_order"),
    ("encoder", "module", "single_gpu"),
  ],
)
def test_adam_steps_match_filter_value_and_grad(name, spelling, mode, close):
  loss, data, keyed = MODELS[name]
  model, batch = data()
  key = jax.random.key(5) if keyed else None
  ref = M.train(eqx.filter_value_and_grad, loss, model, batch, key=key)
  if spelling == "module":
    vg = functools.partial(ooo.value_and_grad, mode=mode)
  else:
    vg = functools.partial(oeqx.filter_value_and_grad, mode=mode)
  _same(M.train(vg, loss, model, batch, key=key), ref, close)


def test_grads_hold_none_at_static_leaves():
  model, (x,) = M.fields_data()
  g = ooo.grad(M.fields_loss)(model, x)
  ref = eqx.filter_grad(M.fields_loss)(model, x)
  assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(ref)
  assert g.steps is None and g.act is None and g.scale is None
  g2 = oeqx.filter_grad(M.fields_loss)(model, x)
  assert jnp.allclose(g2.w, ref.w, rtol=1e-5, atol=1e-7)


def test_plain_tree_with_static_leaf_names_its_path():
  params = {"w": jnp.ones((3, 2)), "blocks": [{"act": jax.nn.relu}]}
  loss = lambda p, x: jnp.sum(p["blocks"][0]["act"](x @ p["w"]))  # noqa: E731
  with pytest.raises(TypeError, match=r"\['blocks'\]\[0\]\['act'\].*filter_value_and_grad"):
    ooo.grad(loss)(params, jnp.ones((4, 3)))
  # the same tree filtered: the function left static
  g = oeqx.filter_grad(loss)(params, jnp.ones((4, 3)))
  assert g["blocks"][0]["act"] is None and g["w"].shape == (3, 2)


def test_int_leaf_error_names_its_path():
  with pytest.raises(TypeError, match="int32") as e:
    ooo.grad(lambda p: p["a"].sum())({"a": jnp.ones(3), "n": jnp.ones(3, int)})
  assert any("['n']" in n for n in e.value.__notes__)


@pytest.mark.parametrize("name", ["cnn", "encoder"])
def test_explain_takes_the_module(name):
  # the max-pool's init=-inf and Dropout's p stay Python floats (no jvp of init)
  loss, data, keyed = MODELS[name]
  model, batch = data()
  args = (*batch, jax.random.key(0)) if keyed else batch
  r = ooo.explain(loss, model, *args)
  assert r.counts["DW"] > 0
