"""Every ooo.grad mode inside a sharded jit: explicit sharding (`jax.typeof`,
`reshard`), GSPMD (Auto axes, `with_sharding_constraint`), sharded parameters,
and the constructs ooojax emits (stream calls, barriers, control edges) under
SPMD partitioning, on 4 CPU devices and on compile-only H100 x8.

Each case equals `jax.value_and_grad` under the same sharded jit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import ooojax as ooo
from ooojax import gpu_hlo
from tests.conftest import cpu_backend_only

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
ORDERINGS = ("auto", "barriers", "none")


def _mesh(types, shape=(2, 2), names=("batch", "model")):
  return jax.make_mesh(
    shape, names, axis_types=(types,) * len(names), devices=jax.devices()[: int(np.prod(shape))]
  )


def _mlp(at):
  """A 4-layer tanh MLP whose loss reads its input's sharding (explicit) or
  pins its activations (auto), as flax's nnx examples do."""

  def loss(ws, x):
    for w in ws:
      y = jnp.tanh(x @ w)
      if at is EXPLICIT:
        x = jax.sharding.reshard(y, jax.typeof(x).sharding)
      else:
        x = jax.lax.with_sharding_constraint(y, P("batch", None))
    return jnp.mean(x**2)

  return loss


def _args(mesh, param_spec=P()):
  ws = [
    jax.device_put(
      jax.random.normal(jax.random.key(i), (16, 16)) * 0.3, NamedSharding(mesh, param_spec)
    )
    for i in range(4)
  ]
  x = jax.device_put(
    jax.random.normal(jax.random.key(9), (8, 16)), NamedSharding(mesh, P("batch", None))
  )
  return ws, x


def _same(got, want, close):
  close(got, want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)


# --- explicit sharding: typeof / reshard ---------------------------------------------
@pytest.mark.parametrize(
  "mode,ordering", [("in_order", "auto"), ("single_gpu", "auto"), ("single_gpu", "barriers")]
)
def test_explicit_typeof_reshard_jit(mode, ordering, close):
  mesh = _mesh(EXPLICIT)
  loss = _mlp(EXPLICIT)
  with jax.set_mesh(mesh):
    args = _args(mesh)
    want = jax.jit(jax.value_and_grad(loss))(*args)
    got = jax.jit(ooo.value_and_grad(loss, mode=mode, ordering=ordering))(*args)
  _same(got, want, close)


def test_explicit_typeof_reshard_eager(close):
  """Outside jit: the committed arrays' types carry the explicit sharding."""
  mesh = _mesh(EXPLICIT)
  loss = _mlp(EXPLICIT)
  with jax.set_mesh(mesh):
    args = _args(mesh)
    want = jax.value_and_grad(loss)(*args)
    got = ooo.value_and_grad(loss, mode="single_gpu")(*args)
  close(got, want)


@pytest.mark.parametrize("at", [EXPLICIT, AUTO])
def test_data_parallel_in_shard_map_over_part_of_the_mesh(at, close):
  """shard_map manual over the data axis only; the model axis stays explicit /
  auto inside, and the loss reshards to its input's type there."""
  mesh = _mesh(at)
  loss = _mlp(EXPLICIT) if at is EXPLICIT else _mlp_model_axis()

  def step(g):
    def f(ws, x):
      l, gr = g(ws, x)
      return jax.lax.pmean(l, "batch"), gr

    return jax.jit(
      jax.shard_map(f, in_specs=(P(), P("batch")), out_specs=(P(), P()), axis_names={"batch"})
    )

  with jax.set_mesh(mesh):
    ws, x = _args(mesh)
    want = jax.jit(jax.value_and_grad(loss))(ws, x)
    got = step(ooo.value_and_grad(loss, mode="data_parallel", axis_name="batch"))(ws, x)
  close(got, want)


def _mlp_model_axis():
  # inside shard_map over "batch" only "model" may be constrained
  def loss(ws, x):
    for w in ws:
      x = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), P(None, "model"))
    return jnp.mean(x**2)

  return loss


# --- GSPMD: auto axes, sharded parameters ----------------------------------------------
@pytest.mark.parametrize(
  "mode,ordering",
  [("in_order", "auto"), *[("single_gpu", o) for o in (*ORDERINGS, "control_deps")]],
)
def test_gspmd_sharded_params(mode, ordering, close):
  """Parameters sharded on the model axis, batch on the data axis (Auto):
  ooojax's stream calls, barriers and control edges go through the SPMD
  partitioner, and the gradients keep the reference's shardings."""
  mesh = _mesh(AUTO)
  loss = _mlp(AUTO)
  with jax.set_mesh(mesh):
    args = _args(mesh, P(None, "model"))
    want = jax.jit(jax.value_and_grad(loss))(*args)
    got = jax.jit(ooo.value_and_grad(loss, mode=mode, ordering=ordering))(*args)
  _same(got, want, close)


def _deep(n=6, d=256, batch=64):
  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.mean(x**2)

  ws = [jax.random.normal(jax.random.key(i), (d, d)) * 0.1 for i in range(n)]
  return loss, ws, jnp.ones((batch, d))


@cpu_backend_only
def test_control_edges_only_where_they_partition():
  """Several stream calls: the default ordering adds control edges on one
  device, leaves them out under a multi-device GSPMD jit (XLA's partitioner
  refuses side-effect ops without a sharding), keeps barriers and stream
  annotations in both, and runs."""
  loss, ws, x = _deep()
  f = jax.jit(ooo.value_and_grad(loss, mode="single_gpu"))
  one = f.lower(ws, x).as_text()
  assert one.count("control_dep") >= 2 and "optimization_barrier" in one
  mesh = _mesh(AUTO, (4,), ("batch",))
  xs = jax.device_put(x, NamedSharding(mesh, P("batch")))
  lowered = f.lower(ws, xs)
  text = lowered.as_text()
  assert "control_dep" not in text
  # GSPMD puts collectives inside dW calls; XLA:GPU cannot run those on a side
  # stream, so partitioned modules get the calls inline, the barriers kept
  assert "optimization_barrier" in text and "_xla_stream_annotation" not in text
  hlo = lowered.compile().as_text()
  assert "all-reduce" in hlo  # partitioned: the replicated weights' gradients are reduced
  np.testing.assert_allclose(f(ws, xs)[0], jax.value_and_grad(loss)(ws, x)[0], rtol=1e-6)


GPU = gpu_hlo.unavailable_reason()


@pytest.mark.skipif(GPU is not None, reason=f"compile-only GPU: {GPU}")
@pytest.mark.parametrize(
  "mode,ordering",
  [
    ("in_order", "auto"),
    ("single_gpu", "auto"),
    ("single_gpu", "control_deps"),
    ("single_gpu", "none"),
  ],
)
def test_h100x8_gspmd_partitions(mode, ordering):
  """Compile-only H100 x8, (4 data) x (2 model): every ordering partitions and
  each device holds its weight shard. The dW calls, which hold the
  partitioner's all-reduces, are inline (jax 0.12's XLA:GPU fails on a
  collective inside a side-stream call: "No ExecutionStreamId found")."""
  m = gpu_hlo.mesh("H100", (4, 2), ("batch", "model"))
  loss, ws, x = _deep(4, 256)
  ws = [
    jax.ShapeDtypeStruct(
      w.shape,
      w.dtype,
      sharding=NamedSharding(m, P(None, "model") if i % 2 == 0 else P("model", None)),
    )
    for i, w in enumerate(ws)
  ]
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(m, P("batch")))
  hlo = gpu_hlo.compile_text(ooo.value_and_grad(loss, mode=mode, ordering=ordering), ws, x, mesh=m)
  assert "f32[256,128]" in hlo and "f32[128,256]" in hlo  # the per-device weight shards
  assert "all-reduce" in hlo and "_xla_stream_annotation" not in hlo


@pytest.mark.skipif(GPU is not None, reason=f"compile-only GPU: {GPU}")
def test_h100x8_manual_shard_map_keeps_stream_calls():
  """Inside a fully manual shard_map the body is per device: the dW calls stay
  on the side stream (async call-start / call-done pairs)."""
  m = gpu_hlo.mesh("H100", 8, ("batch",))
  loss, ws, x = _deep(4, 256)
  f = jax.shard_map(
    ooo.value_and_grad(loss, mode="single_gpu"),
    mesh=m,
    in_specs=(P(), P("batch")),
    out_specs=P(),
    check_vma=False,
  )
  x = jax.ShapeDtypeStruct((8 * 64, 256), jnp.float32, sharding=NamedSharding(m, P("batch")))
  hlo = gpu_hlo.compile_text(f, ws, x, mesh=m)
  assert hlo.count("call-start") >= 2 and "_xla_stream_annotation" in hlo


# --- explain takes what users hold -----------------------------------------------------
def test_grad_of_an_nnx_module_says_what_to_do():
  from flax import nnx

  model = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
  model.w = nnx.Param(jnp.ones(3))
  with pytest.raises(TypeError, match="uint32|key") as e:
    ooo.grad(lambda m, x: jnp.sum(m(x * m.w)))(model, jnp.ones(3))
  assert "nnx.split" in "".join(getattr(e.value, "__notes__", []))


def test_explain_resnet_sync_bn_names_its_mesh_axis():
  from ooojax.models import features

  c = features.resnet18_sync_bn(batch=4, hw=8, width=4)
  # as the user holds it, outside pmap: the axis is bound (size 1) and the report says so
  a = ooo.explain(c.loss, *c.args, has_aux=True)
  assert a.counts["DW"] > 0 and len(a.notes) == 1
  assert "'batch'" in a.notes[0] and "size-1" in a.notes[0] and "mesh=" in a.notes[0]
  assert "note: the loss names mesh axis 'batch'" in repr(a)
  with pytest.raises(ValueError, match="axis_size"):  # data parallel: its size is the plan
    ooo.explain(c.loss, *c.args, has_aux=True, mode="data_parallel", axis_name="batch")
  r = ooo.explain(c.loss, *c.args, has_aux=True, mesh={"batch": 4}, axis_name="batch")
  assert r.counts["DW"] > 0
  with pytest.raises(ValueError, match="mesh="):
    ooo.explain(c.loss, *c.args, has_aux=True, axis_name="batch")
  d = ooo.explain(
    c.loss, *c.args, has_aux=True, mode="data_parallel", axis_name="batch", axis_size=4, first_k=4
  )
  text = repr(d)
  assert "a bucket is a group of gradient leaves" in text
  # first-k is named by its conv layers; BatchNorm goes along, not as a "first layer"
  assert d.first_k_main_layers and all("Conv" in l for l in d.first_k_main_layers)
  assert "['BatchNorm_0']" in d.first_k_layers
  shown = text.split("reverse first-k: k=4")[1].split("(with")[0]
  assert "BatchNorm" not in shown and "['Conv_0']" in shown


# --- flax's own examples --------------------------------------------------------------
def _minigpt(mesh, vocab=64, seq=8, d=32, heads=2, blocks=2):
  from flax import nnx

  def part(init, *spec):
    return nnx.with_partitioning(init, spec)

  class Block(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.xavier_uniform()
      self.attn = nnx.MultiHeadAttention(
        num_heads=heads,
        in_features=d,
        decode=False,
        kernel_init=part(init, None, "model"),
        bias_init=part(nnx.initializers.zeros_init(), "model"),
        rngs=rngs,
      )
      self.ln1 = nnx.LayerNorm(d, rngs=rngs)
      self.ln2 = nnx.LayerNorm(d, rngs=rngs)
      self.ff1 = nnx.Linear(d, 2 * d, kernel_init=part(init, None, "model"), rngs=rngs)
      self.ff2 = nnx.Linear(2 * d, d, kernel_init=part(init, "model", None), rngs=rngs)
      self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, training):
      mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
      a = self.attn(x, mask=mask, out_sharding=P("batch", None, None))
      x = self.ln1(x + self.drop(a, deterministic=not training))
      h = nnx.relu(self.ff1(x))
      h = self.ff2(h, out_sharding=P("batch", None, None))
      h = jax.sharding.reshard(h, jax.typeof(x).sharding)  # as flax's MiniGPT does
      return self.ln2(x + self.drop(h, deterministic=not training))

  class MiniGPT(nnx.Module):
    def __init__(self, rngs):
      self.tok = nnx.Embed(vocab, d, rngs=rngs)
      self.pos = nnx.Embed(seq, d, rngs=rngs)
      self.blocks = nnx.List([Block(rngs) for _ in range(blocks)])
      self.head = nnx.Linear(
        d, vocab, kernel_init=part(nnx.initializers.xavier_uniform(), None, "model"), rngs=rngs
      )

    def __call__(self, tokens, training=False):
      x = (
        self.tok(tokens, out_sharding=P("batch", None, None))
        + self.pos(jnp.arange(tokens.shape[1]))[None]
      )
      for b in self.blocks:
        x = b(x, training)
      return self.head(x, out_sharding=P("batch", None, None))

  model = MiniGPT(nnx.Rngs(params=0, dropout=1))
  tokens = jax.random.randint(jax.random.key(3), (8, seq + 1), 0, vocab)
  tokens = jax.device_put(tokens, NamedSharding(mesh, P("batch", None)))
  return model, tokens


def _nnx_loop(vg, model, tokens, steps=5):
  """The authors' functional loop: split, value_and_grad over the params with
  the RNG state as aux, optax adam, `steps` jitted steps."""
  from flax import nnx

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = optax.adam(1e-2)
  opt_state = opt.init(params)

  def loss_fn(params, rest, tokens):
    m = nnx.merge(graphdef, params, rest, copy=True)  # Variables of this trace
    logits = m(tokens[:, :-1], training=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss, nnx.state(m, nnx.Not(nnx.Param))

  @jax.jit
  def step(params, rest, opt_state, tokens):
    (loss, rest), g = vg(loss_fn, has_aux=True)(params, rest, tokens)
    upd, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, upd), rest, opt_state, loss

  losses = []
  for _ in range(steps):
    params, rest, opt_state, loss = step(params, rest, opt_state, tokens)
    losses.append(loss)
  return params, jnp.stack(losses)


@pytest.fixture(scope="module")
def minigpt_reference():
  mesh = _mesh(EXPLICIT)
  with jax.set_mesh(mesh):
    model, tokens = _minigpt(mesh)
    return mesh, _nnx_loop(jax.value_and_grad, model, tokens)


@pytest.mark.parametrize(
  "mode,kw",
  [
    ("in_order", {}),
    ("single_gpu", {}),
    ("data_parallel", {}),
    ("data_parallel", {"axis_name": "batch"}),
  ],
  ids=["in_order", "single_gpu", "data_parallel", "data_parallel-axis_name"],
)
def test_nnx_minigpt_explicit_sharding_five_adam_steps(mode, kw, minigpt_reference):
  """flax's MiniGPT as its notebook writes it: explicit sharding under
  `jax.set_mesh`, `reshard`, dropout from `nnx.Rngs`. data_parallel finds the
  data axis from the tokens' sharding (or takes `axis_name=`) inside the same
  sharded jit."""
  mesh, (want_params, want_losses) = minigpt_reference
  with jax.set_mesh(mesh):
    model, tokens = _minigpt(mesh)
    vg = lambda f, has_aux: ooo.value_and_grad(f, has_aux=has_aux, mode=mode, **kw)  # noqa: E731
    params, losses = _nnx_loop(vg, model, tokens)
  np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
  assert losses[-1] < losses[0]
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want_params)
  ):
    assert g.sharding.is_equivalent_to(w.sharding, g.ndim)
    if mode == "data_parallel" and "'key']['bias'" in jax.tree_util.keystr(path):
      # its gradient is 0 up to rounding (softmax is shift invariant); adam scales
      # the rounding, which depends on the order of the sums, to lr-sized steps
      assert np.max(np.abs(g)) < 5 * 1e-2
      continue
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


# A MiniGPT wide enough that single_gpu plans stream calls (light ones folded
# into heavy ones); its activations are sharded over both mesh axes, which a
# flat-buffer reshape cannot merge under Explicit axes (issue 52).
_PLANNED = {"d": 128, "seq": 16, "blocks": 1}


@pytest.fixture(scope="module")
def minigpt_planned_reference():
  mesh = _mesh(EXPLICIT)
  with jax.set_mesh(mesh):
    model, tokens = _minigpt(mesh, **_PLANNED)
    return mesh, _nnx_loop(jax.value_and_grad, model, tokens)


# Under partitioning "barriers" and "control_deps" lower as "auto" does (no
# control edges, calls inline): the three distinct emissions.
@pytest.mark.parametrize("ordering", ["auto", "scheduling_group", "none"])
def test_nnx_minigpt_single_gpu_every_ordering(ordering, minigpt_planned_reference, close):
  mesh, (want_params, want_losses) = minigpt_planned_reference
  with jax.set_mesh(mesh):
    model, tokens = _minigpt(mesh, **_PLANNED)
    vg = lambda f, has_aux: ooo.value_and_grad(  # noqa: E731
      f, has_aux=has_aux, mode="single_gpu", ordering=ordering
    )
    params, losses = _nnx_loop(vg, model, tokens)
  np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
  for g, w in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
    assert g.sharding.is_equivalent_to(w.sharding, g.ndim)
  close(params, want_params)


def test_nnx_minigpt_single_gpu_plans_folded_calls_and_compiles_for_h100x4():
  """The plan the test above runs has stream calls, some holding several dW
  clusters (light ones folded in); the same step compiles for 4 compile-only
  H100s under Explicit axes, each device holding its shard."""
  from flax import nnx

  mesh = _mesh(EXPLICIT)
  with jax.set_mesh(mesh):
    model, tokens = _minigpt(mesh, **_PLANNED)

    def loss(m, tokens):
      logits = m(tokens[:, :-1], training=True)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    calls = ooo.explain(loss, model, tokens, mode="single_gpu").schedule.calls
  assert calls and any(len(c.units) > 1 for c in calls)
  if GPU is not None:
    pytest.skip(f"compile-only GPU: {GPU}")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  h = gpu_hlo.mesh("H100", (2, 2), ("batch", "model"))
  h = jax.sharding.Mesh(h.devices, h.axis_names, axis_types=(EXPLICIT, EXPLICIT))

  def spec(x):
    s = getattr(x, "sharding", None)
    sh = NamedSharding(h, s.spec) if isinstance(s, NamedSharding) else NamedSharding(h, P())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

  def step(params, rest, tokens):
    def f(params, rest, tokens):
      m = nnx.merge(graphdef, params, rest, copy=True)
      logits = m(tokens[:, :-1], training=True)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return ooo.value_and_grad(f, mode="single_gpu", device="H100")(params, rest, tokens)

  with jax.set_mesh(h):
    args = jax.tree.map(spec, (params, rest, tokens))
    hlo = gpu_hlo.compile_text(step, *args, mesh=h)
  assert "f32[128,128]" in hlo and "f32[128,256]" not in hlo  # ff1, ff2: kernel shards


def test_single_gpu_next_step_dw_under_explicit_axes(close):
  """The deferred dW (`single_gpu.make_train_step`) reads 3-d activations and
  cotangents sharded over both mesh axes; its stream call takes them as they are."""
  from ooojax import single_gpu

  mesh = _mesh(EXPLICIT)
  with jax.set_mesh(mesh):
    k = jax.random.split(jax.random.key(0), 4)
    specs = [P(None, "model"), P("model", None)] * 2
    params = {
      f"l{i}": {
        "w": jax.device_put(jax.random.normal(k[i], (16, 16)) * 0.3, NamedSharding(mesh, sp)),
        "b": jax.device_put(jnp.zeros(16), NamedSharding(mesh, P(sp[1]))),
      }
      for i, sp in enumerate(specs)
    }

    def loss(p, x):
      for i, sp in enumerate(specs):
        out = P("batch", None, sp[1])
        x = jnp.tanh(
          jnp.einsum("btd,de->bte", x, p[f"l{i}"]["w"], out_sharding=out) + p[f"l{i}"]["b"]
        )
      return jnp.mean(x**2)

    xs = [
      jax.device_put(
        jax.random.normal(jax.random.key(10 + t), (8, 4, 16)), NamedSharding(mesh, P("batch"))
      )
      for t in range(3)
    ]
    tx = optax.adam(1e-2)

    @jax.jit
    def plain(p, o, x):
      l, g = jax.value_and_grad(loss)(p, x)
      u, o = tx.update(g, o, p)
      return l, optax.apply_updates(p, u), o

    ref, o, want = params, tx.init(params), []
    for x in xs:
      l, ref, o = plain(ref, o, x)
      want.append(float(l))
    step = single_gpu.make_train_step(
      loss, tx, defer=("l2", "l3"), mode="single_gpu", device="H100"
    )
    state, got = step.init(params, xs[0]), []
    for x in xs:
      state, l = step(state, x)
      got.append(float(l))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    close(step.flush(state).params, ref)


def test_explain_nnx_module_and_graphdef_state():
  from flax import nnx

  mesh = _mesh(EXPLICIT)
  with jax.set_mesh(mesh):
    model, tokens = _minigpt(mesh, blocks=1)

    def loss(m, tokens):
      logits = m(tokens[:, :-1], training=True)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    r = ooo.explain(loss, model, tokens)
    assert any(".blocks[0].ff1.kernel" in p for p in r.clusters)
    assert not any("rngs" in p for p in r.clusters)  # the RNG state is not differentiated
    graphdef, state = nnx.split(model)

    def loss_gs(gs, tokens):
      return loss(nnx.merge(*gs), tokens)

    r2 = ooo.explain(loss_gs, (graphdef, state), tokens)
  assert any("['ff1']['kernel']" in p for p in r2.clusters)
  assert not any("rngs" in p for p in r2.clusters)
  # a data-parallel report groups nnx leaves by their module
  from ooojax.passes.collectives.plan import layer_of

  assert layer_of(".blocks[0].ff1.kernel.value") == ".blocks[0].ff1"
  assert layer_of("[1]['blocks'][0]['ff1']['kernel'].value") == "[1]['blocks'][0]['ff1']"


def _small_resnet():
  """flax's ImageNet ResNet with two one-block stages (ResNet-18 has 2-2-2-2):
  conv, synchronised BatchNorm over the pmap axis, basic blocks, dense head."""
  import flax.linen as nn

  from ooojax.models import features

  class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Conv(4, (3, 3), use_bias=False)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=features.AXIS)(x))
      x = features._BasicBlock(4)(x)
      x = features._BasicBlock(8, 2)(x)
      return nn.Dense(10)(jnp.mean(x, (1, 2)))

  model = ResNet()
  x = jax.random.normal(jax.random.key(0), (8, 8, 8, 3))
  y = jax.random.randint(jax.random.key(1), (8,), 0, 10)
  v = jax.vmap(lambda x: model.init(jax.random.key(2), x[None]), axis_name=features.AXIS)(x[:1])
  params, stats = jax.tree.map(lambda a: a[0], (v["params"], v["batch_stats"]))

  def loss(params, stats, x, y):
    logits, upd = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return ce, {"batch_stats": upd["batch_stats"]}

  return features.Case("resnet", "", loss, params, (stats, x, y), (False, True, True))


def test_resnet_sync_bn_under_pmap_five_steps(close):
  """flax's ImageNet-style train step: synchronised BatchNorm under pmap,
  gradients pmean-ed, 5 SGD-momentum steps, batch_stats carried."""
  from ooojax.models import features

  c = _small_resnet()
  n = 4
  stats, x, y = c.batch
  xs, ys = x.reshape(n, -1, *x.shape[1:]), y.reshape(n, -1)
  opt = optax.sgd(0.05, momentum=0.9)

  def train(grad_fn, reduce):
    def step(params, stats, opt_state, x, y):
      (loss, aux), g = grad_fn(params, stats, x, y)
      if reduce:
        g = jax.lax.pmean(g, features.AXIS)
      upd, opt_state = opt.update(g, opt_state, params)
      return optax.apply_updates(params, upd), aux["batch_stats"], opt_state, loss

    p_step = jax.pmap(
      step,
      axis_name=features.AXIS,
      in_axes=(None, None, None, 0, 0),
      out_axes=(None, None, None, 0),
      devices=jax.devices()[:n],
    )
    params, st, opt_state = c.params, stats, opt.init(c.params)
    losses = []
    for _ in range(5):
      params, st, opt_state, loss = p_step(params, st, opt_state, xs, ys)
      losses.append(loss)
    return params, st, jnp.stack(losses)

  want = train(jax.value_and_grad(c.loss, has_aux=True), True)
  for mode in ("single_gpu", "data_parallel"):
    kw = {"axis_name": features.AXIS} if mode == "data_parallel" else {}
    got = train(ooo.value_and_grad(c.loss, has_aux=True, mode=mode, **kw), mode != "data_parallel")
    close(got, want, rtol=1e-4, atol_scale=1e-4)


def test_pipeline_explain_binds_the_loss_axis():
  from ooojax.models import features

  c = features.resnet18_sync_bn(batch=4, hw=8, width=4)
  r = ooo.pipeline.explain(
    c.loss, c.args[0], *c.args[1:], stages=2, has_aux=True, microbatches=2, state_argnums=(1,)
  )
  assert len(r.notes) == 1 and "'batch'" in r.notes[0] and "data_axis='batch'" in r.notes[0]
  assert "note: the loss names mesh axis" in repr(r)
