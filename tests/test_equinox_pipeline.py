"""Equinox modules in the pipeline: the module as the parameters, per-layer keys
(`keys[i]` of a split) and a padding mask read by every block cut with the stack,
per-example keys (`split(key, batch)`) taken as each microbatch's rows of the
whole batch's split: the reference is `eqx.filter_value_and_grad` on the whole
batch."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

eqx = pytest.importorskip("equinox")

import ooojax as ooo  # noqa: E402
from ooojax.passes.pipeline.cut import cut  # noqa: E402
from tests import _eqx_models as M  # noqa: E402


def _mesh(n):
  return jax.make_mesh((n,), ("stage",), devices=jax.devices()[:n])


def _inexact(m):
  return eqx.filter(m, eqx.is_inexact_array)


def test_encoder_module_pipelines_as_the_whole_batch(close):
  model, (tokens, labels) = M.encoder_data(batch=8, n_layers=2)
  key = jax.random.key(3)
  step = ooo.pipeline.value_and_grad(
    M.encoder_loss, mesh=_mesh(2), axis_name="stage", schedule="1f1b", microbatches=2
  )
  loss, g = eqx.filter_jit(step)(model, tokens, labels, key)
  ref, rg = eqx.filter_jit(eqx.filter_value_and_grad(M.encoder_loss))(model, tokens, labels, key)
  close(loss, ref)
  close(_inexact(g), _inexact(rg))
  assert g.blocks[0].drop.p is None  # Dropout's p: static, as in Equinox's gradient


def test_explain_takes_the_module():
  model, (tokens, labels) = M.encoder_data(batch=8, n_layers=4)
  r = ooo.pipeline.explain(
    M.encoder_loss, model, tokens, labels, jax.random.key(0), stages=2, microbatches=2
  )
  assert r.cut.layers == 4 and r.cut.first == (".embed.weight",)
  # the tokens (the mask) and the key's whole-batch split (the per-example keys)
  assert r.cut.side == ("batch[0]", "split(batch[2])")


def test_keys_picked_one_per_layer_are_not_per_example_keys():
  # split(key, 4) with 4 rows a microbatch, read as keys[i] by layer i: per-layer
  # keys, traced as written (folded per microbatch), not the batch's split
  def loss(params, x, key):
    keys = jax.random.split(key, 4)
    for w, k in zip(params, keys):
      x = jnp.where(jax.random.bernoulli(k, 0.9, x.shape), jnp.tanh(x @ w), 0.0)
    return jnp.mean(x**2)

  params = [jnp.eye(3) * 0.5 for _ in range(4)]
  r = ooo.pipeline.explain(
    loss, params, jnp.ones((8, 3)), jax.random.key(0), stages=2, microbatches=2
  )
  assert r.cut.layers == 4 and r.cut.side == ("batch[1]",)


@pytest.mark.parametrize("index", ["zip", "subscript"])
def test_per_layer_keys_cut_with_the_stack(index):
  # a plain loss: block i draws its dropout mask from keys[i] of one split
  def loss(params, x, key):
    keys = jax.random.split(key, len(params["w"]))
    for i, w in enumerate(params["w"]):
      k = list(keys)[i] if index == "zip" else keys[i]
      keep = jax.random.bernoulli(k, 0.9, x.shape)
      x = jnp.where(keep, jnp.tanh(x @ w), 0.0) / 0.9
    return jnp.mean(x**2)

  params = {"w": [jnp.eye(3) * 0.5 for _ in range(4)]}
  leaves, tree = jax.tree.flatten(params)
  flat = lambda *xs: loss(tree.unflatten(xs[:4]), *xs[4:])  # noqa: E731
  c = cut(jax.make_jaxpr(flat)(*leaves, jnp.ones((2, 3)), jax.random.key(0)), 4)
  assert c.layers == 4 and len(c.per_layer) == 1
  assert c.per_layer[0].tolist() == [0, 1, 2, 3]  # each layer's index into the split


def test_make_train_step_keeps_the_static_fields(close):
  model, (tokens, labels) = M.encoder_data(batch=8, n_layers=2)
  key = jax.random.key(3)
  opt = optax.adam(1e-2)
  step = ooo.pipeline.make_train_step(
    M.encoder_loss, opt, mesh=_mesh(2), axis_name="stage", schedule="1f1b", microbatches=2
  )
  state, loss = step(step.init(model, tokens, labels, key), tokens, labels, key)
  trained = step.params(state)
  assert isinstance(trained, M.Encoder) and trained.blocks[0].drop.p == 0.1
  ref, g = eqx.filter_value_and_grad(M.encoder_loss)(model, tokens, labels, key)
  updates, _ = opt.update(g, opt.init(_inexact(model)))
  close(loss, ref)
  close(_inexact(trained), _inexact(eqx.apply_updates(model, updates)))


def test_plain_tree_with_a_function_leaf_names_its_path():
  params = {"w": [jnp.eye(3)] * 2, "act": jnp.tanh}
  step = ooo.pipeline.value_and_grad(
    lambda p, x: jnp.mean(p["act"](x @ p["w"][0] @ p["w"][1])),
    mesh=_mesh(2),
    axis_name="stage",
    schedule="1f1b",
    microbatches=2,
  )
  with pytest.raises(TypeError, match=r"\['act'\].*filter_value_and_grad"):
    step(params, jnp.ones((4, 3)))


def _fsdp_mlp():
  """The MLP on a (2 data x 4 stage) explicit mesh, every Linear's weight split over
  the data axis on its input dimension (FSDP within the stage), the batch over data."""
  model, (x, y) = M.mlp_data()
  explicit = (jax.sharding.AxisType.Explicit,) * 2
  mesh = jax.make_mesh((2, 4), ("data", "stage"), devices=jax.devices()[:8], axis_types=explicit)
  x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
  split = NamedSharding(mesh, P(None, "data"))
  model = eqx.tree_at(
    lambda m: [layer.weight for layer in m.layers],
    model,
    [jax.device_put(layer.weight, split) for layer in model.layers],
  )
  return model, x, y, mesh


@pytest.mark.parametrize("fsdp", ["regather", "keep"])
def test_fsdp_within_stages_on_a_module(close, fsdp):
  # (2 data x 4 stage) explicit mesh, every Linear's weight split over the data axis
  # on its input dimension (FSDP within the stage, issue 49): each action gathers it
  # (regather; keep gathers the stages before the loop and reduce-scatters the
  # gradients after it), its gradient comes back split the same way and equals Equinox's
  model, x, y, mesh = _fsdp_mlp()
  kw = dict(mesh=mesh, axis_name="stage", data_axis="data", microbatches=4, schedule="1f1b")
  loss, g = eqx.filter_jit(ooo.pipeline.value_and_grad(M.mlp_loss, fsdp=fsdp, **kw))(model, x, y)
  ref, rg = eqx.filter_jit(eqx.filter_value_and_grad(M.mlp_loss))(model, x, y)
  close(loss, ref)
  close(_inexact(g), _inexact(rg))
  assert g.act is None and g.layers[0].weight.sharding.spec == P(None, "data")
  r = ooo.pipeline.explain(M.mlp_loss, model, x, y, fsdp="regather", **kw)
  assert r.fsdp.leaves == (".layers[0].weight",) and r.fsdp.held * 2 == r.fsdp.whole


def test_train_step_gives_back_the_module_as_optax_updates_it(close):
  # FSDP within the stages: step.params is the module given, updated, each weight
  # split over the data axis as it was (a checkpoint or an eval reads it as is)
  from tests.test_pipeline_data_stage import same_tree

  model, x, y, mesh = _fsdp_mlp()
  opt = optax.adam(1e-2)
  kw = dict(mesh=mesh, axis_name="stage", data_axis="data", microbatches=4, schedule="1f1b")
  with jax.set_mesh(mesh):
    _, g = eqx.filter_jit(eqx.filter_value_and_grad(M.mlp_loss))(model, x, y)
    u, _ = opt.update(g, opt.init(_inexact(model)), _inexact(model))
    want = eqx.filter_jit(eqx.apply_updates)(model, u)
    step = ooo.pipeline.make_train_step(M.mlp_loss, opt, **kw)
    state, _ = step(step.init(model, x, y), x, y)
    got = step.params(state)
  assert got.act is model.act  # the static fields as given
  same_tree(_inexact(got), _inexact(want))
