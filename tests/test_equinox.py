"""Equinox modules as the differentiated argument: trained as eqx.filter_value_and_grad trains them."""

import functools
import json

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


def test_calibrated_single_gpu_admission_on_a_module(tmp_path, monkeypatch, close):
  # single_gpu prices stream calls with the shipped H200 calibration (76 us a pinned
  # call): on this MLP no dW cluster pays for one, and explain says so; a cheap call
  # (a calibration file of 0.1 us) admits the GEMM clusters, and the pinned-call step
  # equals Equinox's gradient. abstract_plan takes the module (its function field static).
  from ooojax.passes import calibration, cost, stream_cost

  model, (x, y) = M.mlp_data(batch=128, d=256, n=4)
  monkeypatch.delenv(calibration.ENV)  # the shipped ooojax/calibration/h200.json
  s = ooo.explain(M.mlp_loss, model, x, y, mode="single_gpu", device="H200").schedule
  assert s.calls == () and s.predicted_speedup == 1.0
  assert stream_cost.too_dear(cost.get_spec("H200").pinned_call) in {w for _, w in s.kept}
  entry = {"format": 1, "device": "H200", "jax": jax.__version__, "call_seconds": 1e-7}
  (tmp_path / "h200.json").write_text(json.dumps({**entry, "pinned_call_seconds": 1e-7}))
  monkeypatch.setenv(calibration.ENV, str(tmp_path))
  vg = oeqx.filter_value_and_grad(M.mlp_loss, mode="single_gpu", device="H200")
  plan = vg.abstract_plan(model, x, y)
  assert plan.schedule.calls and plan.schedule.predicted_speedup > 1.0
  loss, g = eqx.filter_jit(vg)(model, x, y)
  ref, rg = eqx.filter_value_and_grad(M.mlp_loss)(model, x, y)
  close(loss, ref)
  close(eqx.filter(g, eqx.is_inexact_array), eqx.filter(rg, eqx.is_inexact_array))


def test_single_gpu_train_step_takes_the_partitioned_module(close):
  # make_train_step's params are float arrays: the module's function field is named
  # with the fix (eqx.partition / eqx.combine), and the fix trains as a plain loop does
  import optax

  from ooojax import single_gpu

  model, (x, y) = M.mlp_data(n=4)
  opt = optax.sgd(0.1)
  step = single_gpu.make_train_step(lambda m, b: M.mlp_loss(m, *b), opt, defer="auto")
  with pytest.raises(TypeError, match=r"params\.act is a .*eqx\.partition"):
    step.init(model, (x, y))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  loss = lambda p, b: M.mlp_loss(eqx.combine(p, static), *b)  # noqa: E731
  step = single_gpu.make_train_step(loss, opt, defer="auto")
  state, p, got, want = step.init(params, (x, y)), params, [], []
  for _ in range(2):
    state, v = step(state, (x, y))
    got.append(v)
    v, g = jax.value_and_grad(loss)(p, (x, y))
    p, _ = optax.apply_updates(p, jax.tree.map(lambda t: -0.1 * t, g)), want.append(v)
  close(jnp.stack(got), jnp.stack(want))
