"""mode="data_parallel" inside a jax.jit over a mesh (GSPMD), FSDP, on 4 CPU devices.

The reference everywhere is `jax.value_and_grad` of the full-batch mean loss
(nanodo: the authors' own train step and optax loop).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import ooojax as ooo
from tests import nanodo as nd

N = 4
DP = functools.partial(ooo.value_and_grad, mode="data_parallel")


def _mlp():
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"w1": jax.random.normal(k[0], (16, 32)) / 4, "w2": jax.random.normal(k[1], (32, 8)) / 6}
  x, y = jax.random.normal(k[2], (8, 16)), jax.random.normal(k[3], (8, 8))

  def loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

  return loss, params, x, y


def _mesh(axis_type=AxisType.Auto, shape=(N,), names=("data",)):
  return jax.make_mesh(
    shape, names, axis_types=(axis_type,) * len(shape), devices=jax.devices()[: int(np.prod(shape))]
  )


# --- finding the data axis ------------------------------------------------------
def test_auto_axes_batch_constrained_in_the_step(close):
  loss, params, x, y = _mlp()
  mesh = _mesh()
  data = NamedSharding(mesh, P("data"))

  def step(p, x, y):  # the batch's sharding shows in the constraint that made it
    x, y = (jax.lax.with_sharding_constraint(v, data) for v in (x, y))
    return DP(loss)(p, x, y)

  close(jax.jit(step)(params, x, y), jax.value_and_grad(loss)(params, x, y))


def test_auto_axes_closed_over_batch_and_axis_name(close):
  loss, params, x, y = _mlp()
  mesh = _mesh()
  ref = jax.value_and_grad(loss)(params, x, y)

  def step(p, x, y):  # nanodo's shape: the loss closes over its (constrained) batch
    x, y = (jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P("data"))) for v in (x, y))
    return DP(lambda p: loss(p, x, y))(p)

  close(jax.jit(step)(params, x, y), ref)
  # nothing shows a sharding: axis_name= and a context mesh; the non-differentiated
  # arguments are the batch
  shard = (NamedSharding(mesh, P()), NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    out = jax.jit(lambda p, x, y: DP(loss, axis_name="data")(p, x, y), in_shardings=shard)(
      params, x, y
    )
  close(out, ref)


def test_explicit_axes_data_parallel_and_fsdp(close):
  loss, params, x, y = _mlp()
  ref = jax.value_and_grad(loss)(params, x, y)
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    xs, ys = jax.device_put(x, P("data")), jax.device_put(y, P("data"))
    close(jax.jit(DP(loss))(params, xs, ys), ref)
    # FSDP / ZeRO-3 with explicit axes: the loss gathers its sharded parameters
    pf = jax.device_put(params, {"w1": P("data", None), "w2": P(None, "data")})
    gathered = lambda p, x, y: loss(jax.tree.map(lambda w: jax.sharding.reshard(w, P()), p), x, y)
    v, g = jax.jit(DP(gathered))(pf, xs, ys)
    assert jax.typeof(g["w1"]).sharding.spec == P("data", None)
    assert jax.typeof(g["w2"]).sharding.spec == P(None, "data")
  close((v, g), ref)


def test_auto_axes_fsdp_reduce_scatters_gradients(close):
  loss, params, x, y = _mlp()
  mesh = _mesh()
  specs = {"w1": P("data", None), "w2": P(None, "data")}

  def step(p, x, y):  # parameters constrained to their FSDP sharding, as the batch
    p = jax.lax.with_sharding_constraint(p, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    x, y = (jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P("data"))) for v in (x, y))
    return DP(loss)(p, x, y)

  f = jax.jit(step)
  close(f(params, x, y), jax.value_and_grad(loss)(params, x, y))
  hlo = f.lower(params, x, y).compile().as_text()
  # one all-gather per parameter in the forward, one reduce-scatter per gradient bucket
  assert "reduce-scatter" in hlo and "all-gather" in hlo


def _adam_steps(mesh, specs, value_and_grad, steps=5):
  """5 optax Adam steps of a tanh MLP (weights sharded by `specs`, a replicated
  bias) under one sharded jit, the batch split over "data"."""
  import optax

  loss, params, x, y = _mlp()
  params = {**params, "b": jnp.linspace(-0.5, 0.5, 32)}
  f = lambda p, x, y: (
    loss({"w1": p["w1"], "w2": p["w2"]}, x, y) + jnp.mean(jnp.tanh(x @ p["w1"] + p["b"]) ** 2)
  )
  tx = optax.adam(1e-2)
  shard = {k: NamedSharding(mesh, s) for k, s in specs.items()}

  @jax.jit
  def step(p, o, x, y):
    p = jax.lax.with_sharding_constraint(p, shard)
    x, y = (jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P("data"))) for v in (x, y))
    v, g = value_and_grad(f)(p, x, y)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, v

  p, o, vals = params, tx.init(params), []
  text = step.lower(params, o, x, y).as_text()
  for i in range(steps):
    p, o, v = step(p, o, x + i / 10, y)
    vals.append(v)
  return p, (jnp.stack(vals) if vals else None), text


def test_fsdp_mixed_data_and_model_axes_over_optax_steps(close):
  """ZeRO-3 with a model (tensor-parallel) axis kept beside the data axis and a
  replicated bias on the all-reduce path: 5 Adam steps equal the plain loop's; each
  FSDP weight is gathered again in the backward (more gathers than weights)."""
  mesh = _mesh(shape=(2, 2), names=("data", "model"))
  specs = {"w1": P("data", "model"), "w2": P("model", "data"), "b": P()}
  got = _adam_steps(mesh, specs, functools.partial(DP, fsdp="regather"))
  want = _adam_steps(mesh, specs, jax.value_and_grad)
  close(got[:2], want[:2])
  assert "reduce_scatter" in got[2]
  keep = _adam_steps(mesh, specs, functools.partial(DP, fsdp="keep"), 0)  # gathered once
  assert got[2].count("all_gather") > keep[2].count("all_gather")
  # the default (fsdp="auto") keeps: a small model on a CPU, its memory not known
  auto = _adam_steps(mesh, specs, DP, 0)
  assert auto[2].count("all_gather") == keep[2].count("all_gather")


def test_fsdp_temp_memory_at_most_plain_jit():
  """ZeRO-3 holds 1/N of the parameters: the compiled step's temporary memory (XLA:CPU's
  `memory_analysis`, 6 FSDP layers of 256 KB) is at most 1.05x plain `jax.jit`'s, and
  well under that of gathering the whole model once (`fsdp="keep"`)."""
  layers, d = 6, 256
  mesh = _mesh()
  w_spec = [NamedSharding(mesh, P("data", None))] * layers
  data = NamedSharding(mesh, P("data"))

  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.mean(x**2)

  def temp(vg):
    def step(ws, x):
      ws = jax.lax.with_sharding_constraint(ws, w_spec)
      v, g = vg(loss)(ws, jax.lax.with_sharding_constraint(x, data))
      return v, jax.tree.map(lambda w, g: w - 0.1 * g, ws, g)

    f = jax.jit(step, in_shardings=(w_spec, data), out_shardings=(None, w_spec))
    args = ([jax.ShapeDtypeStruct((d, d), jnp.float32)] * layers, jnp.zeros((8, d)))
    return f.lower(*args).compile().memory_analysis().temp_size_in_bytes

  plain, ours = temp(jax.value_and_grad), temp(functools.partial(DP, fsdp="regather"))
  keep = temp(functools.partial(DP, fsdp="keep"))
  assert ours <= 1.05 * plain, (ours, plain)
  assert ours <= 0.6 * keep, (ours, keep)


def test_explain_predicts_fsdp_memory_beside_plain_gspmd():
  """explain's memory section: parameters held at 1/N over the data axis (and 1/M over
  a model axis), a replicated bias whole; gathered weights two layers at a time
  (fsdp="regather") against the whole FSDP model (fsdp="keep")."""
  mesh = _mesh(shape=(2, 2), names=("data", "model"))
  put = lambda x, *s: jax.device_put(x, NamedSharding(mesh, P(*s)))
  ws = {
    f"l{i}": {"w": put(jnp.ones((64, 64)), "data", "model" if i == 1 else None)} for i in range(4)
  }
  ws["bias"] = {"b": put(jnp.ones(64))}

  def loss(p, x):
    for i in range(4):
      x = jnp.tanh(x @ p[f"l{i}"]["w"])
    return jnp.mean((x + p["bias"]["b"]) ** 2)

  r = ooo.explain(loss, ws, put(jnp.ones((8, 64)), "data"), mesh=mesh, mode="data_parallel")
  m, w = r.memory, 64 * 64 * 4
  assert m.params == m.grads == 3 * w // 2 + w // 4 + 64 * 4
  assert (m.gathered, m.gathered_keep, m.fsdp_leaves) == (2 * w, 3 * w + w // 2, 4)
  assert "memory per device" in repr(r) and "fsdp='keep'" in repr(r)
  assert "fsdp='auto' runs 'keep' here" in repr(r) and m.fsdp == "keep"


def test_fsdp_auto_keeps_unless_memory_demands_regather():
  """fsdp="auto": nanodo D 2048 x8's 1.08 GB of FSDP weights are kept on H100s (the
  compiled programs replayed 9.68 ms for regather against 6.89 for keep on NVLink);
  30 GB are regathered (over a quarter of 80 GB); a CPU's memory is not known."""
  from ooojax.passes.collectives import fsdp_mode
  from ooojax.passes.collectives.plan import get_link

  nv = get_link("nvlink")
  keep = fsdp_mode.choose("auto", 1_080_000_000, 8, nv, "H100", 24)
  assert keep.mode == "keep" and "fits the 80 GB H100" in keep.reason, keep
  big = fsdp_mode.choose("auto", 30_000_000_000, 8, nv, "H100", 24)
  assert big.mode == "regather" and "memory demands" in big.reason, big
  cpu = fsdp_mode.choose("auto", 30_000_000_000, 8, nv, "CPU", 4)
  assert cpu.mode == "keep" and "memory unknown" in cpu.reason, cpu
  assert fsdp_mode.choose("regather", 1, 8, nv, "H100", 1).mode == "regather"


def test_other_mesh_axes_are_left_to_the_partitioner(close):
  loss, params, x, y = _mlp()
  mesh = _mesh(shape=(2, 2), names=("data", "model"))

  def step(p, x, y):
    p = jax.lax.with_sharding_constraint(p, NamedSharding(mesh, P(None, "model")))
    x, y = (jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P("data"))) for v in (x, y))
    return DP(loss)(p, x, y)

  close(jax.jit(step)(params, x, y), jax.value_and_grad(loss)(params, x, y))


def test_aux_is_combined_over_shards(close):
  _, params, x, y = _mlp()
  mesh = _mesh()

  def with_aux(p, x, y):
    err = (jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2
    return err.mean(), {
      "rows": err.mean(1),
      "count": jnp.sum(jnp.ones(x.shape[0])),
      "n": x.shape[0] + jnp.zeros((), jnp.int32),
      "mean": err.mean(),
    }

  def step(p, x, y):
    x, y = (jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P("data"))) for v in (x, y))
    return DP(with_aux, has_aux=True)(p, x, y)

  (v, aux), g = jax.jit(step)(params, x, y)
  (rv, raux), rg = jax.value_and_grad(with_aux, has_aux=True)(params, x, y)
  close((v, g), (rv, rg))
  close(aux, raux)  # rows gathered, sums summed, means averaged


def test_errors_name_axis_name_and_the_mesh_axes():
  loss, params, x, y = _mlp()
  mesh = _mesh(shape=(2, 2), names=("data", "model"))
  rep = NamedSharding(mesh, P())
  with jax.set_mesh(mesh):
    with pytest.raises(
      ValueError,
      match=r"axis_name='batch' is not an axis of the mesh "
      r"\(its axes: \('data', 'model'\)\)",
    ):
      jax.jit(DP(loss, axis_name="batch"))(params, x, y)
    # nothing shows which axis the batch is split over
    with pytest.raises(ValueError, match=r"axis_name=.*\('data', 'model'\)"):
      jax.jit(DP(loss), in_shardings=(rep, rep, rep))(params, x, y)

  def step(p, x, y):  # a batch reached through an object, not the closure
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))
    box = type("Box", (), {})()
    box.x = x
    return DP(lambda p, y: loss(p, box.x, y))(
      p, jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P("data")))
    )

  with pytest.raises(ValueError, match="pass it as an argument"):
    jax.jit(step)(params, x, y)
  with pytest.raises(ValueError, match=r"fsdp must be one of \('auto', 'regather', 'keep'\)"):
    DP(loss, fsdp="once")


# --- nanodo: the authors' train step under its sharded jit, 5 AdamW steps -------------
_CFG = dict(D=16, H=2, L=8, N=1, V=32, F=32)
_REF: dict = {}
_INIT: dict = {}  # fsdp -> (shardings, state): the step does not donate, so it is reused


def _train(fsdp: bool, value_and_grad, steps: int = 5):
  cfg = nd.DoConfig(**_CFG, fsdp_enabled=fsdp)
  mesh = nd.mesh(N)
  if fsdp not in _INIT:
    _INIT[fsdp] = nd.init_train_state(cfg, mesh)
  shardings, state = _INIT[fsdp]
  step = nd.make_step(shardings, mesh, value_and_grad=value_and_grad)
  losses, counts = [], []
  for batch in nd.batches(cfg, 2 * N, steps):
    state, metrics = step(state, batch)
    losses.append(metrics["loss"])
    counts.append(metrics["ntokens"])
  return jnp.stack(losses), jnp.stack(counts), nd.unbox(state.params), state.opt_state


def _reference(fsdp: bool):
  if fsdp not in _REF:
    _REF[fsdp] = _train(fsdp, jax.value_and_grad)
  return _REF[fsdp]


@pytest.mark.parametrize("fsdp", [False, True], ids=["dp", "fsdp"])
def test_nanodo_data_parallel_matches_authors_loop(fsdp, close):
  got = _train(fsdp, DP)
  close(got, _reference(fsdp), rtol=2e-5, atol_scale=2e-5)


@pytest.mark.parametrize("mode", ["in_order", "single_gpu"])
def test_nanodo_other_modes_under_the_sharded_jit(mode, close):
  # single_gpu: the default ordering's control_dep does not partition yet (issue 32,
  # the sharding-faithful part); barriers do
  opts = {"ordering": "barriers"} if mode == "single_gpu" else {}
  got = _train(False, functools.partial(ooo.value_and_grad, mode=mode, **opts))
  close(got, _reference(False), rtol=2e-5, atol_scale=2e-5)


# --- data_parallel.make_train_step: has_aux, a flax TrainState, nnx (graphdef, params) ---
def test_make_train_step_takes_train_state_and_aux(close):
  import optax
  from flax.training.train_state import TrainState

  from ooojax import data_parallel as dp
  from tests.models import tanh_mlp

  params, loss, xs = tanh_mlp(3)
  tx = optax.adam(1e-2)

  def with_aux(p, x):
    return loss(p, x), {"mean_x": jnp.mean(x), "rows": jnp.sum(x, 1)}

  ref_p, ref_o = params, tx.init(params)
  ref_aux = []
  for x in xs:  # the plain loop
    (_, aux), g = jax.value_and_grad(with_aux, has_aux=True)(ref_p, x)
    u, ref_o = tx.update(g, ref_o, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
    ref_aux.append(aux)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("batch",))
  held = TrainState.create(apply_fn=None, params=params, tx=tx)
  step = dp.make_train_step(with_aux, None, mesh, has_aux=True, first_k=1)
  state = step.init(held, xs[0])
  for x, want in zip(xs, ref_aux):
    state, (_, aux) = step(state, x)
    close(aux, want)
  out = step.held(state)
  assert isinstance(out, TrainState) and int(out.step) == len(xs)
  close(out.params, ref_p)


def test_make_train_step_takes_nnx_graphdef_and_params(close):
  import optax
  from flax import nnx

  from ooojax import data_parallel as dp

  model = nnx.Sequential(
    nnx.Linear(6, 8, rngs=nnx.Rngs(0)), nnx.tanh, nnx.Linear(8, 3, rngs=nnx.Rngs(1))
  )
  graphdef, params = nnx.split(model, nnx.Param)
  xs = [jax.random.normal(jax.random.PRNGKey(i), (2 * N, 6)) for i in range(3)]
  loss = lambda m, x: jnp.mean(m(x) ** 2)
  tx = optax.sgd(0.1)
  ref = params
  for x in xs:
    g = jax.grad(lambda p: loss(nnx.merge(graphdef, p), x))(ref)
    ref = optax.apply_updates(ref, tx.update(g, tx.init(ref), ref)[0])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("batch",))
  step = dp.make_train_step(loss, tx, mesh, cross_step=False)
  state = step.init((graphdef, params), xs[0])
  for x in xs:
    state, _ = step(state, x)
  gd, got = step.held(state)
  assert gd == graphdef
  close(got, ref)


def test_explain_takes_the_mesh_and_finds_the_data_axis():
  """explain(mode="data_parallel", mesh=) on nanodo's loss as its user holds it
  (no named axis in the loss, the global batch placed on the mesh): the axis
  size comes from the mesh, the axis from the batch's sharding or axis_name=,
  and the report is that of one device's shard."""
  cfg = nd.DoConfig(**_CFG, fsdp_enabled=False)
  mesh = nd.mesh(N)
  if False not in _INIT:
    _INIT[False] = nd.init_train_state(cfg, mesh)
  state = _INIT[False][1]

  def loss(params, batch):
    return nd.get_default_loss_fn(batch, state.apply_fn, None)(params)

  tokens = nd.batches(cfg, 2 * N, 1)[0]
  batch = jax.device_put(tokens, NamedSharding(mesh, P("data")))
  kw = dict(has_aux=True, mode="data_parallel")
  found = ooo.explain(loss, state.params, batch, mesh=mesh, **kw)
  named = ooo.explain(loss, state.params, batch, mesh=mesh, axis_name="data", **kw)
  shard = ooo.explain(loss, state.params, tokens[:2], axis_name="data", axis_size=N, **kw)
  assert found.axis_name == "data" and found.plan.n_devices == N
  assert repr(found) == repr(named) == repr(shard)
  # nothing shows the data axis: the error names axis_name= and the mesh's axes
  with pytest.raises(ValueError, match=r"axis_name=.*\['data'\]"):
    ooo.explain(loss, state.params, tokens, mesh=mesh, **kw)
  with pytest.raises(ValueError, match=r"axis_name='batch' is not an axis of mesh="):
    ooo.explain(loss, state.params, batch, mesh=mesh, axis_name="batch", **kw)


def test_explain_takes_fsdp_params_in_flax_boxes():
  """nanodo with fsdp_enabled=True: its parameters in nn.with_partitioning boxes, whose
  unboxing constrains them to P(..., 'data'); explain traces one device's shard, where
  that constraint is dropped as in the step, and reports the FSDP leaves."""
  cfg = nd.DoConfig(**_CFG, fsdp_enabled=True)
  mesh = nd.mesh(N)
  if True not in _INIT:
    _INIT[True] = nd.init_train_state(cfg, mesh)
  state = _INIT[True][1]

  def loss(params, batch):
    return nd.get_default_loss_fn(batch, state.apply_fn, None)(params)

  tokens = nd.batches(cfg, 2 * N, 1)[0]
  batch = jax.device_put(tokens, NamedSharding(mesh, P("data")))
  r = ooo.explain(loss, state.params, batch, mesh=mesh, has_aux=True, mode="data_parallel")
  assert r.axis_name == "data" and "FSDP leaves held at 1/4" in repr(r)
  shard = ooo.explain(
    loss,
    state.params,
    tokens[:2],
    axis_name="data",
    axis_size=N,
    has_aux=True,
    mode="data_parallel",
  )
  assert shard.plan.n_devices == N
