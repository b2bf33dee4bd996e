"""The compiled pipeline program: no slot copies per tick, memory set by the schedule.

The model stacks two residual MLP blocks per stage and slices them in the
stage (`p["w1"][i]`), the way a user writes a stage: a weight slice is a
forward value, and an executor that stored it per microbatch would hold a
stage's weights in every slot.
"""

import jax
import jax.numpy as jnp
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


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved", "zb-v"])
def test_cpu_loop_body_copies_no_slot_and_memory_is_the_schedules(name):
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
