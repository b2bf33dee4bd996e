"""The compiled pipeline program: no slot copies per tick, memory set by the schedule.

The model stacks two residual MLP blocks per stage and slices them in the
stage (`p["w1"][i]`), the way a user writes a stage: a weight slice is a
forward value, and an executor that stored it per microbatch would hold a
stage's weights in every slot.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ooojax as ooo
from ooojax import gpu_hlo
from ooojax.passes.hlo.schedule import parse, shape_bytes
from ooojax.passes.pipeline.program import memory

D, H, BLOCKS = 64, 256, 2


def _stage(p, x):
  for i in range(p["w1"].shape[0]):
    x = x + jax.nn.gelu(x @ p["w1"][i]) @ p["w2"][i]
  return x


def _loss(y, t):
  return jnp.mean((y - t) ** 2)


def _args(virtual, batch=64):
  sd = jax.ShapeDtypeStruct
  params = {
    "w1": sd((virtual, BLOCKS, D, H), jnp.float32),
    "w2": sd((virtual, BLOCKS, H, D), jnp.float32),
  }
  x = sd((batch, D), jnp.float32)
  return params, (x, x)


def _step(mesh, sched):
  return jax.jit(
    ooo.pipeline.value_and_grad(_stage, _loss, mesh=mesh, axis_name="stage", schedule=sched)
  )


def _loop_copies(text, limit):
  """(copies in the tick loop larger than `limit` bytes, all copies in it)."""
  s = parse(text)
  copies = [(i.name, i.shape) for i in s.copies(s.loop_bodies())]
  return [c for c in copies if shape_bytes(c[1]) > limit], copies


@pytest.mark.parametrize(
  "name,ticks",
  [("1f1b", "switch"), ("zb-h1", "switch"), ("interleaved", "switch"), ("zb-v", "switch")]
  + [("1f1b", "select"), ("interleaved", "select")],
)
def test_cpu_loop_body_copies_no_slot_and_memory_is_the_schedules(name, ticks, monkeypatch):
  monkeypatch.setenv("OOOJAX_TICKS", ticks)  # `select`: the GPU's lowering, forced on CPU
  mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
  sched = ooo.pipeline.schedule(name, stages=4, microbatches=8)
  params, batch = _args(sched.virtual_stages)
  compiled = _step(mesh, sched).lower(params, batch).compile()
  m = memory(_stage, _loss, sched, params, batch)
  # Nothing larger than one record is copied per tick: no slot stack, no
  # weights. (A record stack of one slot is written by a copy: its one write.)
  big, copies = _loop_copies(compiled.as_text(), max(m.fres, m.bres))
  assert not big, copies
  # Records hold activations, never weights: one block's weights are larger
  # than a whole microbatch's record here.
  assert m.fres + m.bres < m.weights / (BLOCKS * sched.chunks)
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp <= 1.25 * m.bound, (temp, m)


@pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only GPU: {gpu_hlo.unavailable_reason()}",
)
@pytest.mark.parametrize("lag", [0, 1])
def test_h100_loop_body_copies_no_slot(lag):
  mesh = gpu_hlo.mesh("H100", 4, ("stage",))
  sched = ooo.pipeline.schedule("zb-h1", stages=4, microbatches=8, lag=lag)
  params, batch = _args(sched.virtual_stages)
  text = gpu_hlo.compile_text(_step(mesh, sched), params, batch, mesh=mesh)
  act = batch[0].shape[0] // sched.microbatches * D * 4
  big, copies = _loop_copies(text, act)
  # With lag 1 the value in flight is kept while the tick computes the next
  # one: one activation-sized copy; never a slot stack, a record or weights.
  assert not big and len([c for c in copies if shape_bytes(c[1]) > 8]) <= lag, copies


@pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only GPU: {gpu_hlo.unavailable_reason()}",
)
def test_h100_ticks_that_write_every_record_leave_out_their_conds(monkeypatch):
  """`OOOJAX_RECORD_WRITES=always`: the two record writes per tick run on every
  tick (a trash slot), so the tick loop holds two conditionals fewer, each a
  branch index XLA:GPU would read back on the host; no slot stack is copied."""
  import re

  from ooojax.passes.pipeline.lowering import TICKS
  from ooojax.passes.pipeline.tick_options import RECORD_WRITES

  monkeypatch.setenv(TICKS, "switch")  # the lowering that has conds (not a GPU's default)
  mesh = gpu_hlo.mesh("H100", 1, ("stage",))
  sched = ooo.pipeline.schedule("1f1b", stages=1, microbatches=8)
  params, batch = _args(sched.virtual_stages)
  conds = {}
  for mode in ("cond", "always"):
    monkeypatch.setenv(RECORD_WRITES, mode)
    text = gpu_hlo.compile_text(_step(mesh, sched), params, batch, mesh=mesh)
    conds[mode] = len(re.findall(r" conditional\(", text))
    if mode == "always":
      big, copies = _loop_copies(text, batch[0].shape[0] // sched.microbatches * D * 4)
      assert not big, copies
  assert conds == {"cond": 3, "always": 1}  # the action's switch alone is left


def test_ticks_that_write_every_record_give_the_same_gradients(monkeypatch):
  from ooojax.passes.pipeline.tick_options import RECORD_WRITES

  mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
  sched = ooo.pipeline.schedule("zb-v", stages=2, microbatches=4)
  ks = jax.random.split(jax.random.key(0), 3)
  params = {
    "w1": jax.random.normal(ks[0], (sched.virtual_stages, BLOCKS, D, H)) / 8,
    "w2": jax.random.normal(ks[1], (sched.virtual_stages, BLOCKS, H, D)) / 16,
  }
  x = jax.random.normal(ks[2], (16, D))
  out = {}
  for mode in ("cond", "always"):
    monkeypatch.setenv(RECORD_WRITES, mode)
    out[mode] = _step(mesh, sched)(params, (x, jnp.zeros_like(x)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), *out.values())
  monkeypatch.setenv(RECORD_WRITES, "sometimes")
  with pytest.raises(ValueError, match="use auto"):
    _step(mesh, sched)(params, (x, x))
