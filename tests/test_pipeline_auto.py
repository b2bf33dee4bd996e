"""Automatic stage cutting: `ooo.pipeline.value_and_grad(loss_fn, ...)` of a plain loss
equals `jax.value_and_grad` of the same loss averaged over microbatches."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import ooojax as ooo
from ooojax.models import features
from tests.conftest import assert_trees_close


def _jit(f):
  # Correctness tests compile at XLA O0: a third less compile time on 2 shared cores.
  return jax.jit(f, compiler_options={"xla_backend_optimization_level": 0})


def _mesh(n):
  return jax.make_mesh((n,), ("stage",), devices=jax.devices()[:n])


_REFERENCE = {}  # ref_key -> jax.value_and_grad of the microbatch mean, shared by cells


def _check(
  loss, params, batch, stages, schedule, microbatches=4, has_aux=False, ref_key=None, **kw
):
  step = ooo.pipeline.value_and_grad(
    loss,
    mesh=_mesh(stages),
    axis_name="stage",
    schedule=schedule,
    microbatches=microbatches,
    has_aux=has_aux,
    **kw,
  )
  got_loss, got = _jit(step)(params, *batch)
  if has_aux:  # the aux is checked in tests/test_pipeline_real_losses.py
    got_loss, aux = got_loss
    assert aux is not None
    plain = lambda p, *b: loss(p, *b)[0]  # noqa: E731
  else:
    plain = loss

  def mean_over_microbatches(p):
    parts = [
      jax.tree.map(lambda a, i=i: a.reshape(microbatches, -1, *a.shape[1:])[i], batch)
      for i in range(microbatches)
    ]
    return sum(plain(p, *b) for b in parts) / microbatches

  # one reference per model for every schedule and stage count (ref_key names the model)
  key = (ref_key, microbatches, has_aux)
  ref = _REFERENCE.get(key) if ref_key is not None else None
  if ref is None:
    ref = _jit(jax.value_and_grad(mean_over_microbatches))(params)
    if ref_key is not None:
      _REFERENCE[key] = ref
  want_loss, want = ref
  assert_trees_close(got_loss, want_loss)
  assert_trees_close(got, want)  # same tree as the user's params


# --- the model matrix's scanned stacks ------------------------------------------------
@pytest.mark.parametrize(
  "name,stages,schedule", [("linen_scan", 2, "1f1b"), ("nnx_scan", 2, "zb-h1")]
)
def test_matrix_scan_cases(name, stages, schedule):
  case = features.make(name)
  _check(case.loss, case.params, case.batch, stages, schedule, has_aux=True)


def test_matrix_bf16_master_weights():
  # f32 master weights cast to bf16 at the top (recomputed per stage), a loop of
  # four bf16 blocks, and a scalar loss scale passed whole to every microbatch
  case = features.make("bf16_loss_scaling")
  step = ooo.pipeline.value_and_grad(
    case.loss, mesh=_mesh(2), axis_name="stage", schedule="1f1b", microbatches=2, has_aux=True
  )
  (loss, _), grads = _jit(step)(case.params, *case.batch)
  x, y, scale = case.batch

  def mean_over_microbatches(p):
    h = x.shape[0] // 2
    return sum(case.loss(p, x[i : i + h], y[i : i + h], scale)[0] for i in (0, h)) / 2

  want_loss, want = _jit(jax.value_and_grad(mean_over_microbatches))(case.params)
  assert_trees_close(loss, want_loss, rtol=case.rtol)
  assert_trees_close(grads, want, rtol=case.rtol, atol_scale=case.rtol)


def test_matrix_remat_loop():
  # four nn.remat blocks in a Python loop (one remat equation each), no prologue
  case = features.make("remat_dots_saveable")
  _check(case.loss, case.params, case.batch, 2, "interleaved", has_aux=True)


# --- a GPT-style LM: nn.scan layers, tied embeddings ------------------------------------
class _GPTBlock(nn.Module):
  dim: int
  heads: int

  @nn.compact
  def __call__(self, x, _):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(self.heads, qkv_features=self.dim)(h, mask=mask)
    h = nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(nn.LayerNorm()(x))))
    return x + h, None


class _GPT(nn.Module):
  vocab: int = 13
  dim: int = 8
  heads: int = 2
  layers: int = 4
  scan: bool = True

  @nn.compact
  def __call__(self, tokens):
    emb = nn.Embed(self.vocab, self.dim)
    pos = self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.dim))
    x = emb(tokens) + pos
    if self.scan:
      x, _ = nn.scan(
        _GPTBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers
      )(self.dim, self.heads)(x, None)
    else:
      for _ in range(self.layers):
        x, _ = _GPTBlock(self.dim, self.heads)(x, None)
    return emb.attend(nn.LayerNorm()(x))  # tied output projection


@functools.cache  # the same model object for every cell: one init, one reference
def _gpt(scan=True, layers=4):
  model = _GPT(scan=scan, layers=layers)
  tokens = jax.random.randint(jax.random.key(0), (8, 7), 0, model.vocab)
  params = model.init(jax.random.key(1), tokens[:1, :-1])["params"]

  def loss(params, tokens):
    inputs, labels = tokens[:, :-1], tokens[:, 1:]  # labels live across the layers
    logits = model.apply({"params": params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return loss, params, (tokens,)


@pytest.mark.parametrize(
  "scan,stages,schedule", [(True, 2, "interleaved"), (True, 4, "zb-h1"), (False, 2, "1f1b")]
)
def test_gpt_tied_embeddings(scan, stages, schedule):
  # nn.scan layers, or the same blocks in a Python loop
  loss, params, batch = _gpt(scan)
  _check(loss, params, batch, stages, schedule)


# --- an nnx transformer LM: nnx.scan over nnx.vmap-created blocks, tied embeddings ------
class _NnxBlock(nnx.Module):
  def __init__(self, dim, heads, rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
    self.up, self.down = nnx.Linear(dim, 2 * dim, rngs=rngs), nnx.Linear(2 * dim, dim, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class _NnxLM(nnx.Module):
  def __init__(self, vocab, dim, heads, layers, rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return _NnxBlock(dim, heads, rngs)

    self.blocks = blocks(rngs)
    self.ln = nnx.LayerNorm(dim, rngs=rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(h, block):
      return block(h)

    return self.embed.attend(self.ln(run(self.embed(tokens), self.blocks)))


@functools.cache
def _nnx_lm(layers=4):
  graph, params = nnx.split(_NnxLM(13, 8, 2, layers, nnx.Rngs(0)), nnx.Param)
  tokens = jax.random.randint(jax.random.key(0), (8, 7), 0, 13)

  def loss(params, tokens):
    logits = nnx.merge(graph, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return loss, params, (tokens,)


@pytest.mark.parametrize("stages,schedule", [(2, "interleaved"), (4, "zb-h1")])
def test_nnx_transformer(stages, schedule):
  _check(*_nnx_lm(), stages, schedule)


# Every schedule on 2 and 4 devices for both LMs (8 layers: 4 stages x 2 chunks);
# the pairs above are left out.
_EVERY = [
  (m, n, s)
  for m in ("linen", "nnx")
  for n in (2, 4)
  for s in ooo.pipeline.SCHEDULES
  if (m, n, s)
  not in {
    ("linen", 2, "interleaved"),
    ("linen", 4, "zb-h1"),
    ("nnx", 2, "interleaved"),
    ("nnx", 4, "zb-h1"),
  }
]


# One cell per (model, schedule) runs by default, linen on 2 devices and nnx on 4
# where the pair is here; the rest of the sweep is `slow` (`-m "not slow"` leaves
# it out; CI runs it).
_PICK = {
  (m, s): max(
    (n for mm, n, ss in _EVERY if (mm, ss) == (m, s)),
    key=lambda n, m=m: n == (2 if m == "linen" else 4),
  )
  for m, _, s in _EVERY
}
_EVERY = [
  pytest.param(m, n, s, marks=() if _PICK[m, s] == n else pytest.mark.slow) for m, n, s in _EVERY
]


@pytest.mark.parametrize("model,stages,schedule", _EVERY)
def test_lm_every_schedule(model, stages, schedule):
  make = _gpt if model == "linen" else (lambda layers: _nnx_lm(layers))
  _check(*make(layers=8), stages, schedule, ref_key=(model, 8))


# --- an unrolled Python loop of identical blocks ---------------------------------------
def _mlp(layers=4, widths=None):
  keys = iter(jax.random.split(jax.random.key(0), 16))
  dims = widths or [16] * (layers + 1)
  params = {
    "embed": jax.random.normal(next(keys), (6, dims[0])) * 0.4,
    "layers": [
      {"w": jax.random.normal(next(keys), (a, b)) / a**0.5, "b": jnp.full((b,), 0.1)}
      for a, b in zip(dims, dims[1:])
    ],
    "head": jax.random.normal(next(keys), (dims[-1], 5)) * 0.3,
  }

  def loss(params, x, y):
    h = jnp.tanh(x @ params["embed"])
    for p in params["layers"]:
      z = jax.nn.gelu(h @ p["w"] + p["b"])
      h = h + z if z.shape == h.shape else z
    logits = h @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  x = jax.random.normal(next(keys), (8, 6))
  y = jax.random.randint(next(keys), (8,), 0, 5)
  return loss, params, (x, y)


@pytest.mark.parametrize(
  "stages,schedule", [(4, "1f1b")] + [(2, s) for s in ooo.pipeline.SCHEDULES]
)
def test_unrolled_mlp(stages, schedule):
  loss, params, batch = _mlp()
  _check(loss, params, batch, stages, schedule)


def test_reverse_lax_scan_with_constants():
  # a plain lax.scan run backwards over the layers, its body closing over a
  # value computed from constants (recomputed on every stage)
  def loss(params, x, y):
    scale = jnp.tril(jnp.ones((3, 3)))
    h = jax.lax.scan(
      lambda h, w: (jnp.tanh(h @ (w * scale)) + h, None),
      x @ params["in"],
      params["w"],
      reverse=True,
    )[0]
    return jnp.mean((h @ params["in"].T - y) ** 2)

  ks = jax.random.split(jax.random.key(0), 4)
  params = {
    "in": jax.random.normal(ks[0], (5, 3)),
    "w": jax.random.normal(ks[1], (4, 3, 3)) * jnp.arange(1.0, 5.0)[:, None, None],
  }
  batch = (jax.random.normal(ks[2], (8, 5)), jax.random.normal(ks[3], (8, 5)))
  _check(loss, params, batch, 2, "1f1b")


# --- what it cannot cut ---------------------------------------------------------------
def _raises(loss, params, batch, match, stages=2):
  step = ooo.pipeline.value_and_grad(
    loss, mesh=_mesh(stages), axis_name="stage", schedule="1f1b", microbatches=2
  )
  with pytest.raises(ValueError, match=match) as info:
    jax.eval_shape(step, params, *batch)
  assert "stage_fn" in str(info.value)  # points at the explicit API


def test_uncuttable_models():
  loss, params, batch = _mlp(widths=[16, 24, 12, 20])  # layers of different shapes
  _raises(loss, params, batch, "found no repeated stack")
  loss, params, batch = _mlp(layers=3)  # 3 layers, 4 stages
  _raises(loss, params, batch, "3 layers, fewer than the 4 virtual stages", stages=4)

  def sown(params, x, y):  # the loss reads every layer's output, not just the last
    h, hs = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), h), x, params)
    return jnp.mean((h - y) ** 2) + jnp.mean(hs**2)

  _raises(
    sown,
    jnp.ones((4, 3, 3)),
    (jnp.ones((4, 3)), jnp.ones((4, 3))),
    "reads a value from inside the stack",
  )


def test_explicit_form_arguments():
  loss, params, batch = _mlp()
  with pytest.raises(TypeError, match="input_fn belongs to the explicit form"):
    ooo.pipeline.value_and_grad(loss, mesh=_mesh(2), axis_name="stage", input_fn=lambda x: x)
  with pytest.raises(TypeError, match="has_aux belongs to the automatic form"):
    ooo.pipeline.value_and_grad(loss, loss, mesh=_mesh(2), axis_name="stage", has_aux=True)


# --- data x stage ----------------------------------------------------------------------
def test_data_by_stage_mesh():
  # 2 data replicas x 2 stages: each microbatch's rows split over "data"; the
  # loss and gradients are the mean over replicas. A loss that scales with the
  # rows it sees tells a split batch from a replicated one.
  mean, params, batch = _gpt()
  loss = lambda p, tok: mean(p, tok) * tok.shape[0]  # noqa: E731
  mesh = jax.make_mesh((2, 2), ("data", "stage"), devices=jax.devices()[:4])
  step = ooo.pipeline.value_and_grad(
    loss, mesh=mesh, axis_name="stage", data_axis="data", schedule="zb-h1", microbatches=2
  )
  got = _jit(step)(params, *batch)

  def mean_of_pieces(p):  # microbatch m, replica d: rows [m, d] of a (2, 2, 2, ...) split
    tok = batch[0].reshape(2, 2, -1, *batch[0].shape[1:])
    return sum(loss(p, tok[m, d]) for m in range(2) for d in range(2)) / 4

  assert_trees_close(got, _jit(jax.value_and_grad(mean_of_pieces))(params))


def test_data_by_stage_explicit_form():
  # the explicit (stage_fn, loss_fn) form takes the same data_axis
  w = jax.random.normal(jax.random.key(0), (2, 4, 4)) * 0.5
  x, t = jax.random.normal(jax.random.key(1), (8, 4)), jnp.zeros((8, 4))
  stage_fn = lambda w, h: jnp.tanh(h @ w)  # noqa: E731
  loss_fn = lambda y, t: jnp.sum((y - t) ** 2)  # noqa: E731 - a sum: rows seen matter
  mesh = jax.make_mesh((2, 2), ("data", "stage"), devices=jax.devices()[:4])
  step = ooo.pipeline.value_and_grad(
    stage_fn,
    loss_fn,
    mesh=mesh,
    axis_name="stage",
    data_axis="data",
    schedule="1f1b",
    microbatches=2,
  )

  def mean_of_pieces(w):
    xs, ts = x.reshape(4, 2, 4), t.reshape(4, 2, 4)
    return sum(loss_fn(stage_fn(w[1], stage_fn(w[0], a)), b) for a, b in zip(xs, ts)) / 4

  assert_trees_close(_jit(step)(w, (x, t)), _jit(jax.value_and_grad(mean_of_pieces))(w))
  with pytest.raises(ValueError, match="must be a mesh axis other than the stage axis"):
    ooo.pipeline.value_and_grad(stage_fn, loss_fn, mesh=mesh, axis_name="stage", data_axis="stage")(
      w, (x, t)
    )


def test_under_set_mesh():
  # the way flax nnx / MaxText set the mesh: the step traced under jax.set_mesh,
  # Auto or Explicit axes, the batch sharded on the data axis, equals
  # jax.value_and_grad; a train step there equals optax's
  import optax

  mean, params, batch = _gpt()
  want = _jit(jax.value_and_grad(mean))(params, *batch)
  opt = optax.sgd(0.1)
  g = want[1]
  want_p = optax.apply_updates(params, opt.update(g, opt.init(params), params)[0])
  auto, explicit = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit
  for types in ((auto, auto), (explicit, explicit)):
    mesh = jax.make_mesh((2, 2), ("data", "stage"), devices=jax.devices()[:4], axis_types=types)
    kw = dict(mesh=mesh, axis_name="stage", data_axis="data", schedule="1f1b", microbatches=2)
    step = ooo.pipeline.value_and_grad(mean, **kw)
    tok = jax.device_put(batch[0], jax.NamedSharding(mesh, jax.P("data")))
    with jax.set_mesh(mesh):
      assert_trees_close(_jit(step)(params, tok), want)
      if types[0] == explicit:
        train = ooo.pipeline.make_train_step(mean, opt, **kw)
        state, loss = train(train.init(params, tok), tok)
        assert_trees_close(loss, want[0])
        assert_trees_close(train.params(state.params), want_p)


def test_explicit_set_mesh_loss_that_reads_its_sharding():
  # a loss written for Explicit axes (jax.typeof(x).sharding, reshard, out_sharding=)
  # runs pipelined: traced as each device runs it, inside the shard_map (manual);
  # one that names a mesh axis gets a note that says why it cannot
  from jax.sharding import NamedSharding, PartitionSpec as P

  def loss(p, x, y):
    for w in p["ws"]:
      s = jax.typeof(x).sharding
      x = jax.sharding.reshard(jnp.tanh(jnp.einsum("bd,de->be", x, w, out_sharding=s)), s)
    return jnp.mean((x - y) ** 2)

  def named(p, x, y):
    for w in p["ws"]:
      x = jax.sharding.reshard(jnp.tanh(x @ w), P("data", None))
    return jnp.mean((x - y) ** 2)

  ks = jax.random.split(jax.random.key(0), 6)
  params = {"ws": [jax.random.normal(k, (16, 16)) / 4 for k in ks[:4]]}
  explicit = (jax.sharding.AxisType.Explicit,) * 2
  mesh = jax.make_mesh((2, 2), ("data", "stage"), devices=jax.devices()[:4], axis_types=explicit)
  kw = dict(mesh=mesh, axis_name="stage", data_axis="data", microbatches=2)
  with jax.set_mesh(mesh):
    x, y = (
      jax.device_put(jax.random.normal(k, (8, 16)), NamedSharding(mesh, P("data"))) for k in ks[4:]
    )
    want = _jit(jax.value_and_grad(loss))(params, x, y)
    for sched in ("1f1b", "interleaved"):
      step = ooo.pipeline.value_and_grad(loss, schedule=sched, **kw)
      assert_trees_close(_jit(step)(params, x, y), want)
    with pytest.raises(ValueError) as e:
      _jit(ooo.pipeline.value_and_grad(named, schedule="1f1b", **kw))(params, x, y)
    assert any("every mesh axis is manual" in n for n in e.value.__notes__)
