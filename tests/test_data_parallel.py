"""mode="data_parallel": mean gradients under pmap / shard_map, early bucketed all-reduces."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import ooojax as ooo
from ooojax.models._common import init_params
from ooojax.passes.collectives import plan as collectives
from ooojax.passes.cost import CostModel
from tests import models

N = 8
AX = "batch"


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:N]), (AX,))


def _shard_map(f, in_specs, out_specs=P(), check_vma=True):
  return jax.jit(
    jax.shard_map(f, mesh=_mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
  )


def _mean_of_shards(grad_fn, params, *batch):
  """Mean over the N equal shards of each shard's gradient (no collectives)."""
  shards = [b.reshape(N, b.shape[0] // N, *b.shape[1:]) for b in batch]
  g = jax.jit(jax.vmap(grad_fn, in_axes=(None,) + (0,) * len(batch)))(params, *shards)
  return jax.tree.map(lambda x: x.mean(0), g)


def _mlp():
  m = models.MLP()
  x = jax.random.normal(jax.random.PRNGKey(1), (2 * N, 16))
  y = jnp.arange(2 * N) % 10
  params = init_params(lambda: m.init(jax.random.PRNGKey(0), x))

  def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(m.apply(params, x), y).mean()

  return loss, params, x, y


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_mean_is_full_batch_gradient(check_vma, close):
  loss, params, x, y = _mlp()
  g = _shard_map(
    lambda p, x, y: ooo.grad(loss, mode="data_parallel", axis_name=AX)(p, x, y),
    (P(), P(AX), P(AX)),
    check_vma=check_vma,
  )(params, x, y)
  close(g, jax.grad(loss)(params, x, y))  # mean loss over equal shards


def test_pmean_of_jax_grad_double_reduces_under_check_vma(close):
  # The trap ooojax avoids: AD already psums replicated params' gradients.
  loss, params, x, y = _mlp()
  g = _shard_map(lambda p, x, y: jax.lax.pmean(jax.grad(loss)(p, x, y), AX), (P(), P(AX), P(AX)))(
    params, x, y
  )
  close(jax.tree.map(lambda a: a / N, g), jax.grad(loss)(params, x, y))


def test_pmap_mean_and_sum(close):
  loss, params, x, y = _mlp()
  xs, ys = x.reshape(N, 2, 16), y.reshape(N, 2)
  full = jax.grad(loss)(params, x, y)
  for reduce, scale in (("mean", 1.0), ("sum", N)):
    g = jax.pmap(
      lambda p, x, y: ooo.grad(loss, mode="data_parallel", axis_name=AX, reduce=reduce)(p, x, y),
      axis_name=AX,
      in_axes=(None, 0, 0),
    )(params, xs, ys)
    close(jax.tree.map(lambda a: a[0], g), jax.tree.map(lambda a: a * scale, full))


def test_cnn_batchnorm_value_and_grad(close):
  m = models.CNN()
  x = jax.random.normal(jax.random.PRNGKey(1), (N, 8, 8, 3))
  y = jnp.arange(N) % 10
  v = init_params(lambda: m.init(jax.random.PRNGKey(0), x))

  def loss(params, batch_stats, x, y):
    logits, upd = m.apply(
      {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd

  def step(p, bs, x, y):
    (l, upd), g = ooo.value_and_grad(
      loss, has_aux=True, mode="data_parallel", axis_name=AX, bucket_bytes=4096
    )(p, bs, x, y)
    return jax.lax.pmean(l, AX), g

  l, g = _shard_map(step, (P(), P(), P(AX), P(AX)), (P(), P()))(v["params"], v["batch_stats"], x, y)
  ref = _mean_of_shards(
    lambda p, x, y: jax.grad(loss, has_aux=True)(p, v["batch_stats"], x, y)[0], v["params"], x, y
  )
  close(g, ref)


def test_transformer_block_with_dropout(close):
  m = models.Block()
  x = jax.random.normal(jax.random.PRNGKey(1), (N, 6, 32))
  params = init_params(lambda: m.init(jax.random.PRNGKey(0), x, train=False))
  rng = jax.random.PRNGKey(7)

  def loss(params, x, rng):
    return jnp.mean(m.apply(params, x, train=True, rngs={"dropout": rng}) ** 2)

  g = _shard_map(
    lambda p, x, r: ooo.grad(loss, mode="data_parallel", axis_name=AX, first_k=2)(p, x, r),
    (P(), P(AX), P()),
    check_vma=False,
  )(params, x, rng)
  ref = _mean_of_shards(lambda p, x: jax.grad(loss)(p, x, rng), params, x)
  close(g, ref)


# --- bad input -----------------------------------------------------------------
def test_unbound_axis_without_a_mesh_names_axis_name():
  # no pmap / shard_map axis and no mesh: the data axis cannot be found
  loss, params, x, y = _mlp()
  with pytest.raises(ValueError, match="no mesh is known.*axis_name="):
    ooo.grad(loss, mode="data_parallel", axis_name=AX)(params, x, y)


def test_bad_options_are_value_errors():
  f = lambda w: jnp.sum(w)
  with pytest.raises(ValueError, match="applies to mode='data_parallel' only"):
    ooo.grad(f, axis_name=AX)
  for b in (0, -5, 1.5):
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
      ooo.grad(f, mode="data_parallel", axis_name=AX, bucket_bytes=b)
  with pytest.raises(ValueError, match="reduce must be one of"):
    ooo.grad(f, mode="data_parallel", axis_name=AX, reduce="max")
  with pytest.raises(ValueError, match="unknown link"):
    ooo.grad(f, mode="data_parallel", axis_name=AX, link="carrier-pigeon")


def test_first_k_larger_than_layers():
  loss, params, x, y = _mlp()  # 3 Dense layers
  f = jax.pmap(
    lambda p, x, y: ooo.grad(loss, mode="data_parallel", axis_name=AX, first_k=4)(p, x, y),
    axis_name=AX,
    in_axes=(None, 0, 0),
  )
  with pytest.raises(ValueError, match=r"first_k=4 is larger than the number of layers .*\(3\)"):
    f(params, x.reshape(N, 2, 16), y.reshape(N, 2))


# --- the plan ------------------------------------------------------------------
def _deep(L=6, D=128):
  k = jax.random.split(jax.random.PRNGKey(0), L)
  ws = {f"l{i}": {"w": jax.random.normal(k[i], (D, D)) * 0.1} for i in range(L)}

  def loss(w, x):
    for i in range(L):
      x = jnp.tanh(x @ w[f"l{i}"]["w"])
    return jnp.mean(x**2)

  return loss, ws, jax.random.normal(jax.random.PRNGKey(9), (8 * N, D))


def _plan(loss, *args, full=False, **opts):
  out = {}

  def f(*a):
    g = ooo.grad(loss, mode="data_parallel", axis_name=AX, **opts)
    out["plan"], _ = g._ooo.plan(a, {})
    return g(*a)

  jax.pmap(f, axis_name=AX, in_axes=(None, 0))(args[0], args[1].reshape(N, -1, args[1].shape[-1]))
  return out["plan"] if full else out["plan"].collectives


def test_reverse_first_k_and_buckets():
  loss, ws, x = _deep()
  p = _plan(loss, ws, x, bucket_bytes=1, first_k=3)
  labels = {u.name: u.label for u in p.units}
  w_order = [labels[a.unit] for a in p.schedule.streams[0] if a.kind == "W"]
  # layers 5, 4, 3 in backward order, then the first 3 in forward order
  assert w_order == [f"['l{i}']['w']" for i in (5, 4, 3, 0, 1, 2)]
  assert [b.grads for b in p.buckets] == [(i,) for i in (5, 4, 3, 0, 1, 2)]
  # one bucket of everything
  p = _plan(loss, ws, x, bucket_bytes=1 << 30, first_k=0)
  assert len(p.buckets) == 1 and len(p.buckets[0].grads) == 6


def test_cost_model_chooses_bucket_and_k():
  loss, ws, x = _deep()
  full = _plan(loss, ws, x, link="10GbE", full=True)
  p = full.collectives
  costs = collectives.BucketCosts.of(CostModel(None).spec)  # the device `plan` priced for
  assert p.bucket_bytes in collectives.BUCKET_CANDIDATES and 0 <= p.first_k <= 6
  assert sorted(i for b in p.buckets for i in b.grads) == list(range(6))  # each leaf once
  for b in collectives.BUCKET_CANDIDATES:  # no candidate simulates faster than the choice
    for k in range(7):
      other = collectives.build_plan(full.split, full.schedule, k, b, p.link, N, costs=costs)
      assert p.makespan <= other.makespan * (1 + 1e-9)


# --- compiled schedule ---------------------------------------------------------
def _entry_ops(hlo):
  entry = hlo[hlo.index("\nENTRY") :]
  ops = []
  for line in entry.splitlines():
    m = re.match(r"\s*(?:ROOT )?%(\S+) = .*? ([a-z][\w-]*)\(", line)
    if m:
      # XLA:CPU (jax >= 0.11) runs most matmuls as YNNPACK fusions
      ops.append("dot" if m.group(1).startswith("ynn_fusion") else m.group(2))
  return ops


def test_cpu_reductions_interleave_with_backward_dots():
  loss, ws, x = _deep()
  f = lambda w, x: ooo.grad(loss, mode="data_parallel", axis_name=AX, bucket_bytes=1, first_k=0)(
    w, x
  )
  hlo = _shard_map(f, (P(), P(AX)), check_vma=False).lower(ws, x).compile().as_text()
  ops = [o for o in _entry_ops(hlo) if o in ("all-reduce", "dot")]
  # one all-reduce per bucket (not combined), the first early in the backward
  assert ops.count("all-reduce") == 6
  first = ops.index("all-reduce")
  assert ops[first:].count("dot") >= 5
  # and the reductions spread through it: XLA:CPU orders the (chained) reductions
  # as it likes; 0.10 put backward matmuls after each of the first five, 0.11 after
  # the first three (the dW matmuls outrun the serial chain)
  tail = "".join("A" if o == "all-reduce" else "d" for o in ops[first:])
  assert len(re.findall(r"Ad", tail)) >= 3, tail
  # jax.grad + pmean: the CPU combiner merges everything into one all-reduce at the end
  base = (
    _shard_map(lambda w, x: jax.lax.pmean(jax.grad(loss)(w, x), AX), (P(), P(AX)), check_vma=False)
    .lower(ws, x)
    .compile()
    .as_text()
  )
  assert _entry_ops(base).count("all-reduce") == 1


def test_h100_bucketed_all_reduces_overlap_backward_gemms():
  from ooojax import gpu_hlo

  if gpu_hlo.unavailable_reason() is not None:
    pytest.skip(f"compile-only H100 unavailable: {gpu_hlo.unavailable_reason()}")
  from jax.sharding import NamedSharding

  mesh = gpu_hlo.mesh("H100", N, (AX,))
  L, D = 6, 1024
  ws = {f"l{i}": {"w": jax.ShapeDtypeStruct((D, D), jnp.float32)} for i in range(L)}
  x = jax.ShapeDtypeStruct((256 * N, D), jnp.float32, sharding=NamedSharding(mesh, P(AX)))
  loss, _, _ = _deep(L, D)

  def heavy_in_windows(fn, **opts):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(AX)), out_specs=P(), check_vma=False))
    s = gpu_hlo.schedule(f, ws, x, mesh=mesh, compiler_options=opts)
    return [len(p.overlapped_heavy) for p in s.pairs_of("all-reduce")]

  # ordering="none": control_dep custom calls do not compile for GPU
  ours = lambda w, x: ooo.grad(
    loss,
    mode="data_parallel",
    axis_name=AX,
    ordering="none",
    device="H100",
    bucket_bytes=1,
    first_k=0,
  )(w, x)
  base = lambda w, x: jax.lax.pmean(jax.grad(loss)(w, x), AX)
  # default compiler options: one all-reduce per bucket, GEMMs inside all but the
  # last (which XLA >= 0.11 makes synchronous: a pair with nothing inside)
  got = heavy_in_windows(ours)
  assert len(got) == L and sum(n > 0 for n in got) == L - 1, got
  assert len(heavy_in_windows(base)) < L  # jax.grad + pmean: combined
  # the GPU combiner needs a whole-program flag to keep jax.grad's apart
  assert len(heavy_in_windows(base, xla_gpu_all_reduce_combine_threshold_bytes=0)) == L


def test_linen_make_train_step_passes_the_mode_through(close):
  from ooojax import flax as oflax

  m = models.MLP()
  x = jax.random.normal(jax.random.PRNGKey(1), (2 * N, 16))
  y = jnp.arange(2 * N) % 10
  state = oflax.TrainState.create(
    apply_fn=m.apply,
    tx=optax.sgd(0.1),
    params=init_params(lambda: m.init(jax.random.PRNGKey(0), x))["params"],
  )

  def loss(params, batch, apply):
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, batch[0]), batch[1]).mean()

  dp_step = oflax.make_train_step(loss, jit=False, mode="data_parallel", axis_name=AX)
  new, _ = jax.pmap(dp_step, axis_name=AX, in_axes=(None, 0))(
    state, (x.reshape(N, 2, 16), y.reshape(N, 2))
  )
  ref, _ = oflax.make_train_step(loss, use_ooo=False)(state, (x, y))
  close(jax.tree.map(lambda a: a[0], new.params), ref.params)


def test_nnx_grad_in_shard_map(close):
  from flax import nnx

  from ooojax.flax import nnx_grad

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(8, 16, rngs=rngs)
      self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.l1(x)))

  m = Net(nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (2 * N, 8))
  y = jax.random.normal(jax.random.PRNGKey(2), (2 * N, 4))
  loss = lambda m, x, y: jnp.mean((m(x) - y) ** 2)
  graphdef, state = nnx.split(m)

  def step(state, x, y):
    return nnx_grad(loss, mode="data_parallel", axis_name=AX)(nnx.merge(graphdef, state), x, y)

  g = _shard_map(step, (P(), P(AX), P(AX)))(state, x, y)
  close(g, nnx.grad(loss)(m, x, y))
