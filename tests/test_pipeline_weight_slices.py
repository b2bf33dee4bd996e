"""How the ticks read a stacked weight's layers (`passes.pipeline.weight_slices`).

A stage that slices its layers out of a stacked parameter (`p["w1"][j]`) gets
each slice recomputed in every phase that reads it. On XLA:GPU each static
slice is a copy kernel before a Triton GEMM: 31 per microbatch of one stage's
F, B and W on the H200 (benchmarks/RESULTS.md, issue 48). `dynamic` (a GPU's
default) reads them as dynamic slices, which XLA copies in one kernel per
stacked weight and phase; `hoist` slices them once before the ticks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ooojax as ooo
from ooojax import gpu_hlo
from ooojax.models.mlp_stack import stage_fn as ln_stage  # LayerNorm, GELU blocks
from ooojax.passes.hlo.schedule import parse
from ooojax.passes.pipeline.program import memory, program
from ooojax.passes.pipeline.tick_options import WEIGHT_SLICES, weight_slices
from ooojax.passes.pipeline.weight_slices import invariant, root_slices
from tests.conftest import assert_trees_close
from tests.test_pipeline import _jit, _mesh, _reference
from tests.test_pipeline_memory import _args, _loss, _stage, _step


def _gpu_ticks(monkeypatch, mode):
  """A GPU's tick loop, on CPU: rows masked, records every tick, slices `mode`,
  and what B and W recompute of F's values (`passes.pipeline.recompute`)."""
  from ooojax.passes.pipeline.lowering import TICKS
  from ooojax.passes.pipeline.tick_options import RECOMPUTE, RECORD_WRITES, TICK_ROWS

  monkeypatch.setenv(TICKS, "switch")
  monkeypatch.setenv(RECORD_WRITES, "always")
  monkeypatch.setenv(TICK_ROWS, "masked")
  monkeypatch.setenv(WEIGHT_SLICES, mode)
  monkeypatch.setenv(RECOMPUTE, "fused")


def _arrays(sched, steps=None):
  shapes, (x, _) = _args(sched.virtual_stages, batch=16)
  rng = np.random.default_rng(0)
  params = {
    k: jnp.asarray(rng.standard_normal(v.shape) * 0.1, jnp.float32) for k, v in shapes.items()
  }
  lead = (steps,) if steps else ()
  x = jnp.asarray(rng.standard_normal((*lead, *x.shape)), jnp.float32)
  t = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  return params, x, t


def test_the_slices_found_are_the_layers():
  sched = ooo.pipeline.schedule("1f1b", stages=2, microbatches=4)
  params, batch = _args(sched.virtual_stages, batch=16)
  prog = program(_stage, _loss, sched, params, batch)
  for fl in prog.flavors:
    n = len(fl.consts) + len(jax.tree.leaves(params))
    ids = invariant(fl, n)
    assert {fl.jaxpr.eqns[k].primitive.name for k in ids} == {"slice", "squeeze"}
    assert len(ids) == 2 * 2 * 2  # w1 and w2 of 2 blocks, a slice and a squeeze each
    assert sorted(root_slices(fl, n)) == [
      k for k in ids if fl.jaxpr.eqns[k].primitive.name == "slice"
    ]


@pytest.mark.parametrize(
  "name,mode",
  [("1f1b", "dynamic"), ("zb-h2", "hoist"), ("interleaved", "dynamic"), ("zb-v", "hoist")],
)
def test_weight_slices_give_jax_grads(name, mode, monkeypatch):
  """And B and W recompute the LayerNorm statistics and GELU's factors."""
  _gpu_ticks(monkeypatch, mode)
  sched = ooo.pipeline.schedule(name, stages=2, microbatches=4)
  params, x, t = _arrays(sched)
  step = ooo.pipeline.value_and_grad(
    ln_stage, _loss, mesh=_mesh(2), axis_name="stage", schedule=sched
  )
  loss, grads = _jit(step)(params, (x, t))
  ref_loss, ref_grads = _reference(ln_stage, _loss, params, x, t)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)


def test_dynamic_weight_slices_tiled_match_the_synchronous_loop(monkeypatch):
  """Tiled, the weights change at the ticks' updates: `dynamic` reads them there
  (`hoist` keeps static slices: its weights are not loop constants)."""
  _gpu_ticks(monkeypatch, "dynamic")
  steps, opt = 2, optax.sgd(0.1)
  sched = ooo.pipeline.schedule("zb-h1", stages=2, microbatches=4, steps=steps)
  params, xs, ts = _arrays(sched, steps)
  run = ooo.pipeline.train(ln_stage, _loss, opt, mesh=_mesh(2), axis_name="stage", schedule=sched)
  p, _, losses = _jit(run)(params, jax.vmap(opt.init)(params), (xs, ts))
  q, ref = params, []
  for s in range(steps):
    loss, g = _reference(ln_stage, _loss, q, xs[s], ts[s])
    q = jax.tree.map(lambda a, b: a - 0.1 * b, q, g)
    ref.append(loss)
  assert_trees_close(losses, jnp.stack(ref))
  assert_trees_close(p, q)


def test_weight_slices_default_and_bad_value(monkeypatch):
  monkeypatch.delenv(WEIGHT_SLICES, raising=False)
  assert weight_slices(_mesh(2)) == "static"  # CPU: the loop as it was
  monkeypatch.setenv(WEIGHT_SLICES, "maybe")
  with pytest.raises(ValueError, match="use auto"):
    weight_slices(_mesh(2))


@pytest.mark.parametrize("name,mode", [("1f1b", "hoist"), ("interleaved", "dynamic")])
def test_weight_slices_keep_temp_memory_within_the_bound_on_cpu(name, mode, monkeypatch):
  """`hoist`'s slices are one copy of the weights, live through the loop."""
  _gpu_ticks(monkeypatch, mode)
  mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
  sched = ooo.pipeline.schedule(name, stages=4, microbatches=8)
  params, batch = _args(sched.virtual_stages)
  compiled = _step(mesh, sched).lower(params, batch).compile()
  m = memory(_stage, _loss, sched, params, batch)
  assert compiled.memory_analysis().temp_size_in_bytes <= 1.25 * m.bound


@pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only GPU: {gpu_hlo.unavailable_reason()}",
)
def test_h100_tick_loop_launches_fewer_slice_kernels(monkeypatch):
  """One stage, 1F1B, the stacked benchmark model (4 layers): per loop iteration
  (the tick body, one F, one B and one W) `static` launches 4L - 1 weight-slice
  copies, `dynamic` one multi-output copy per stacked weight and phase (5) in
  about the same temporary memory (a stacked weight's slices at once), `hoist`
  none in the loop (they run once before it). All with F saving every value B
  and W read (`OOOJAX_RECOMPUTE=off`); then `dynamic` with the GPU's default,
  B and W recomputing the LayerNorm statistics and GELU's factors (fused into
  their kernels, as the accumulated scan's backward does): F no longer writes
  a block's statistics out (2 kernels a block past the first: 28 -> 22 on
  jax 0.11.2), B fuses more of its LayerNorm backward (21 -> 18; 15 on 0.12),
  and the records and the temporary memory shrink."""
  from benchmarks import _mlp_model as model, executor_cost
  from ooojax.passes.pipeline.tick_options import RECOMPUTE

  monkeypatch.setenv("OOOJAX_TICKS", "switch")
  L, D, H = 4, 64, 256
  mesh = gpu_hlo.mesh("H100", 1, ("stage",))
  params, batch = model.make_params(1, L, D, H), model.make_batch(32, D)
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  got = {}
  # auto: dynamic slices, on a GPU
  for mode, rc in (("static", "off"), ("auto", "off"), ("hoist", "off"), ("auto", "auto")):
    monkeypatch.setenv(WEIGHT_SLICES, mode)
    monkeypatch.setenv(RECOMPUTE, rc)
    f, args = executor_cost.steps(4, mesh, params, batch)["executor/4"]
    c = gpu_hlo.compiled(f, *jax.tree.map(sds, args), mesh=mesh)
    text = c.as_text()
    # no `copy` in the loop: a GPU's switch passes the loss through its branches
    # (a branch returning a constant 0 made XLA copy it, in idle, B and W)
    s = parse(text)
    assert not s.copies(s.loop_bodies()), (mode, s.copies(s.loop_bodies()))
    got[mode if rc == "off" else "recompute"] = (
      executor_cost.loop_kernels(text),
      executor_cost.loop_copies(text),
      executor_cost.weight_slice_copies(text, D, H),
      c.memory_analysis().temp_size_in_bytes,
    )
  (k_static, c_static, s_static, t_static) = got["static"]
  (k_dyn, c_dyn, s_dyn, t_dyn), (k_hoist, _, s_hoist, _) = got["auto"], got["hoist"]
  assert s_static == 4 * L - 1 and s_dyn == 5 and s_hoist == 2 * L, got
  assert k_dyn == k_static - (4 * L - 1) + 5, got
  assert k_hoist == k_static - (4 * L - 1), got
  assert c_dyn == c_static - (4 * L - 1) + 5, got
  # and beside them only the microbatch's input and the records' reads (3 on 0.11.2,
  # 4 on 0.12, which copied each value of a row read by index: + 4L - 1 per W)
  assert c_dyn <= 5 + 4, got
  # `dynamic` holds a phase's slices of one stacked weight at once (one copy kernel)
  assert t_dyn <= t_static + params["w1"].nbytes, got
  k_re, c_re, s_re, t_re = got["recompute"]
  assert (c_re, s_re) == (c_dyn, s_dyn), got
  assert k_re <= k_dyn - 3 * (L - 1), got
  assert t_re < t_dyn, got


@pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only GPU: {gpu_hlo.unavailable_reason()}",
)
def test_h100_small_layernorm_is_not_recomputed(monkeypatch):
  """D=16 (a microbatch's LayerNorm reads 8 x 16 elements): XLA:GPU does not fuse
  the statistics into B's LayerNorm backward at this size, so the GPU's default
  saves them (`recompute.SMALL_REDUCE`) and launches no more loop kernels than F
  saving everything (71 both on jax 0.11.2, 66 on 0.12; recomputing them was 76
  and 68), in less temporary memory (its tanh and centred inputs still recomputed)."""
  from benchmarks import _mlp_model as model, executor_cost
  from ooojax.passes.pipeline.tick_options import RECOMPUTE

  monkeypatch.setenv("OOOJAX_TICKS", "switch")
  L, D = 4, 16
  mesh = gpu_hlo.mesh("H100", 1, ("stage",))
  params, batch = model.make_params(1, L, D, 4 * D), model.make_batch(32, D)
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  got = {}
  for rc in ("off", "auto"):
    monkeypatch.setenv(RECOMPUTE, rc)
    f, args = executor_cost.steps(4, mesh, params, batch)["executor/4"]
    c = gpu_hlo.compiled(f, *jax.tree.map(sds, args), mesh=mesh)
    got[rc] = (executor_cost.loop_kernels(c.as_text()), c.memory_analysis().temp_size_in_bytes)
  assert got["auto"][0] <= got["off"][0] and got["auto"][1] < got["off"][1], got
