"""mode="data_parallel" with `reduce_dtype` (opt-in lower-precision gradient reduction).

Every reduction path runs in the low dtype (the compiled collectives' operands say so),
the gradient comes back in its own dtype at that dtype's tolerance, the default stays
exact, the planner counts the bytes on the link, and bad values get clear errors.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ooojax as ooo
from ooojax import data_parallel as dp
from tests.models import MLP

N = 4
AX = "data"


def _problem():
  model = MLP()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 12)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, 8), jnp.int32)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), x[:1])["params"]

  def loss(p, x, y):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return loss, params, x, y


def _reference(loss, *args):
  return jax.jit(jax.value_and_grad(loss))(*args)  # one compile, not op by op


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:N]), (AX,))


def _bf16_close(got, ref):
  """Gradients in their own dtype, within bfloat16's rounding of a sum over N devices."""
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    scale = max(float(jnp.max(jnp.abs(b))), 1e-3)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-2 * scale)


def _reduce_types(text: str, op: str) -> list[str]:
  """Element types of the `op` collectives' operands in lowered StableHLO, scalars
  (the loss's reduction) left out."""
  found = re.findall(rf'"stablehlo\.{op}"\(.*?\}}\) : \(tensor<([0-9x]*)(\w+)>', text, re.S)
  return [t for shape, t in found if shape]


def _shard_map_step(loss, rd):
  def body(p, x, y):
    v, g = ooo.value_and_grad(
      loss, mode="data_parallel", axis_name=AX, bucket_bytes=1024, reduce_dtype=rd
    )(p, x, y)
    return jax.lax.pmean(v, AX), g

  return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P(), P(AX), P(AX)), out_specs=P()))


def test_shard_map_bf16_reduction_matches_value_and_grad(close):
  loss, params, x, y = _problem()
  ref = _reference(loss, params, x, y)
  f = _shard_map_step(loss, jnp.bfloat16)
  v, g = f(params, x, y)
  close(v, ref[0])  # the loss is not a gradient: reduced in f32
  _bf16_close(g, ref[1])
  text = f.lower(params, x, y).as_text()
  types = _reduce_types(text, "all_reduce")
  assert len(types) >= 2 and set(types) == {"bf16"}, types  # every gradient bucket


def test_gspmd_and_fsdp_bf16_reduction(close):
  loss, params, x, y = _problem()
  ref = _reference(loss, params, x, y)
  mesh = _mesh()
  data = NamedSharding(mesh, P(AX))
  # FSDP: each kernel sharded over the data axis on its input dimension, biases replicated
  fsdp = jax.tree.map(lambda a: NamedSharding(mesh, P(AX, None) if a.ndim == 2 else P()), params)

  def step(p, x, y, shard=None, rd=jnp.bfloat16):
    if shard is not None:
      p = jax.lax.with_sharding_constraint(p, shard)
    x, y = (jax.lax.with_sharding_constraint(v, data) for v in (x, y))
    return ooo.value_and_grad(loss, mode="data_parallel", reduce_dtype=rd)(p, x, y)

  close(
    jax.jit(lambda p, x, y: step(p, x, y, rd=None))(params, x, y), ref
  )  # the default: exact, in f32
  for shard, op in ((None, "all_reduce"), (fsdp, "reduce_scatter")):
    f = jax.jit(lambda p, x, y, s=shard: step(p, x, y, s))
    v, g = f(params, x, y)
    close(v, ref[0])
    _bf16_close(g, ref[1])
    types = _reduce_types(f.lower(params, x, y).as_text(), op)
    assert types and set(types) == {"bf16"}, (op, types)


def test_make_train_step_bf16_cross_step(close):
  loss, params, x, y = _problem()
  tx = optax.sgd(0.1)
  mesh = _mesh()
  batch = (x, y)
  lossb = lambda p, b: loss(p, *b)
  ref = optax.apply_updates(
    params, tx.update(jax.jit(jax.grad(lossb))(params, batch), tx.init(params))[0]
  )
  step = dp.make_train_step(
    lossb, tx, mesh, axis_name=AX, first_k=1, bucket_bytes=4096, reduce_dtype=jnp.bfloat16
  )
  state = step.init(params, batch)
  state, _ = step(state, batch)
  state = step.flush(state)  # the carried first-k reductions run too, in bf16
  _bf16_close(state.params, ref)
  text = step.lower(state, batch).as_text()
  assert "bf16" in "".join(_reduce_types(text, "all_reduce")), _reduce_types(text, "all_reduce")


def test_leaves_at_or_below_the_width_are_untouched():
  from ooojax.passes.collectives import wire

  assert wire.wire_dtype(jnp.float32, jnp.bfloat16) == jnp.bfloat16
  assert wire.wire_dtype(jnp.bfloat16, jnp.float16) == jnp.bfloat16  # same width: as it is
  assert wire.wire_dtype(jnp.float16, None) == jnp.float16
  assert wire.wire_dtype(jnp.int32, jnp.bfloat16) == jnp.int32
  sds = jax.ShapeDtypeStruct
  assert wire.link_bytes(sds((8, 4), jnp.float32), jnp.bfloat16) == 64
  assert wire.link_bytes(sds((8, 4), jnp.float32)) == 128
  assert wire.link_bytes(sds((8, 4), jnp.bfloat16), jnp.float32) == 64


def test_planner_bytes_halve():
  from ooojax.passes import schedule as sc, split as sp
  from ooojax.passes.collectives import plan as collectives
  from ooojax.passes.cost import CostModel

  def f(ct, w0, w1, x):
    y, vjp = jax.vjp(lambda w0, w1: jnp.sum(jnp.tanh(x @ w0) @ w1), w0, w1)
    return (y, *vjp(ct))

  avals = [
    jax.ShapeDtypeStruct(s, jnp.float32) for s in [(), (1024, 1024), (1024, 1024), (32, 1024)]
  ]
  s = sp.split(f, avals, n_grads=2, param_names=["['a']['w']", "['b']['w']"])
  cm = CostModel("H100")
  sched = sc.schedule(s, cm, streams=1)
  kw = dict(bucket_bytes=64 << 20, first_k=0, link="25GbE")
  full = collectives.plan(s, sched, cm, 8, **kw)
  half = collectives.plan(s, sched, cm, 8, reduce_dtype=jnp.bfloat16, **kw)
  total = lambda p: sum(b.nbytes for b in p.buckets)
  assert total(full) == 2 * 1024 * 1024 * 4 and total(half) == total(full) // 2
  comm = lambda p: sum(u.cost for u in p.units if u.name.startswith("S"))
  assert comm(half) < 0.6 * comm(full)  # ring time of half the bytes (+ fixed costs)
  # the closed-form pricer (bucket size chosen) sees the same bytes
  chosen = collectives.plan(s, sched, cm, 8, link="25GbE", reduce_dtype=jnp.bfloat16)
  assert total(chosen) == total(half) and chosen.reduce_dtype == jnp.bfloat16


def test_bad_reduce_dtype_errors():
  loss = lambda p, b: jnp.sum(p * b)  # noqa: E731
  with pytest.raises(TypeError, match="not a float dtype"):
    ooo.grad(loss, mode="data_parallel", axis_name=AX, reduce_dtype=jnp.int8)
  with pytest.raises(TypeError, match="not a dtype"):
    ooo.grad(loss, mode="data_parallel", axis_name=AX, reduce_dtype="bf17")
  with pytest.raises(ValueError, match="float64 is not supported"):
    ooo.grad(loss, mode="data_parallel", axis_name=AX, reduce_dtype=jnp.float64)
  with pytest.raises(ValueError, match="mode='data_parallel' only"):
    ooo.grad(loss, mode="single_gpu", reduce_dtype=jnp.bfloat16)
  with pytest.raises(TypeError, match="not a float dtype"):
    dp.make_train_step(loss, optax.sgd(0.1), _mesh(), axis_name=AX, reduce_dtype=jnp.int32)


def test_h100_compiled_reductions_are_bf16():
  """The compiled compile-only H100 x8 program (FSDP: kernels reduce-scattered,
  biases all-reduced) runs every gradient collective on bf16 operands."""
  from ooojax import gpu_hlo
  from ooojax.passes.hlo import schedule as hlo_schedule

  if gpu_hlo.unavailable_reason() is not None:
    pytest.skip(f"compile-only H100: {gpu_hlo.unavailable_reason()}")
  model = MLP()
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16))))["params"]
  mesh = gpu_hlo.mesh("H100", 8, (AX,))
  spec = lambda a: NamedSharding(mesh, P(AX, None) if a.ndim == 2 else P())
  sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
  shard = jax.tree.map(spec, params)
  params = jax.tree.map(sds, params, shard)
  data = NamedSharding(mesh, P(AX))
  x = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=data)
  y = jax.ShapeDtypeStruct((64,), jnp.int32, sharding=data)

  def loss(p, x, y):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def step(p, x, y):
    p = jax.lax.with_sharding_constraint(p, shard)
    x, y = (jax.lax.with_sharding_constraint(v, data) for v in (x, y))
    return ooo.value_and_grad(loss, mode="data_parallel", reduce_dtype=jnp.bfloat16)(p, x, y)

  s = hlo_schedule.parse(gpu_hlo.compiled(step, params, x, y, mesh=mesh).as_text())
  shapes = {
    kind: [p.start.shape for p in s.pairs_of(kind) if p.computation == s.entry_name]
    for kind in ("all-reduce", "reduce-scatter")
  }
  assert shapes["reduce-scatter"], shapes
  for kind, found in shapes.items():
    # a gradient's operands are bf16; the loss (f32[], a scalar) is not a gradient
    grads = [t for t in found if "f32[]" not in t]
    assert grads and all("bf16[" in t and "f32[" not in t for t in grads), (kind, found)


def test_explain_says_link_bound_and_predicts_bf16():
  d, layers = 512, 4
  params = {f"l{i}": {"w": jax.ShapeDtypeStruct((d, d), jnp.float32)} for i in range(layers)}
  x = jax.ShapeDtypeStruct((32, d), jnp.float32)

  def loss(p, x):
    for i in range(layers):
      x = jnp.tanh(x @ p[f"l{i}"]["w"])
    return jnp.mean(x**2)

  kw = dict(mode="data_parallel", axis_name="b", axis_size=8, device="H100", link="25GbE")
  r = ooo.explain(loss, params, x, **kw)
  assert r.link_bound and r.link_floor > 0.5 * r.exposed_seconds
  low = r.bf16_plan
  assert sum(b.nbytes for b in low.buckets) * 2 == sum(b.nbytes for b in r.plan.buckets)
  text = repr(r)
  assert "link-bound (simulated)" in text and "reduce_dtype=jnp.bfloat16" in text, text
  assert "changes the numbers" in text
  # the report asked for bf16 is that prediction, and suggests nothing more
  r16 = ooo.explain(loss, params, x, reduce_dtype=jnp.bfloat16, **kw)
  assert r16.bf16_plan is None and r16.plan.makespan == pytest.approx(low.makespan)
  assert r16.exposed_seconds < 0.6 * r.exposed_seconds
  assert "(reduced in bfloat16)" in repr(r16) and "reduce_dtype=jnp" not in repr(r16)
  # NVLink and 128x the rows: the backward covers the link, nothing said
  big = jax.ShapeDtypeStruct((4096, d), jnp.float32)
  assert "link-bound" not in repr(ooo.explain(loss, params, big, **{**kw, "link": "nvlink"}))


def test_scan_stack_reduced_per_layer_in_bf16():
  """The per-layer reductions inside a split backward scan (`collectives.loops`) too."""
  from tests.test_scan_dp import AX as SAX, _lax_mlp, _mesh as scan_mesh

  loss, (p, x), specs = _lax_mlp()
  ref = jax.jit(jax.grad(loss))(p, x)

  def body(p, x):
    opts = dict(bucket_bytes=1, first_k=0, reduce_dtype=jnp.bfloat16)
    return ooo.grad(loss, mode="data_parallel", axis_name=SAX, **opts)(p, x)

  f = jax.jit(jax.shard_map(body, mesh=scan_mesh(), in_specs=specs, out_specs=P()))
  _bf16_close(f(p, x), ref)
  text = f.lower(p, x).as_text()
  types = _reduce_types(text, "all_reduce")
  # inside the loop (one layer per trip), the epilogue's last layer, the head's bucket
  assert len(types) == 3 and set(types) == {"bf16"}, types
