"""The 4-stage pipeline program compiled for a compile-only H100 (no GPU needed).

What XLA:GPU makes of it (jaxlib 0.11.2): the table's scan becomes a while loop
whose body holds the per-tick action switch (a conditional with a branch per
action) and two async collective-permutes (one ring each way). With `lag=0`
the transfers wait for the tick's action; only the slot writes (small
fusions, the record-write conditionals) sit inside a window. With `lag=1`
(receives one tick after the send) one of the two permutes has the action
switch (the tick's F/B/W GEMMs) between its start and done; XLA's GPU
scheduler runs the other after it (one collective-permute in flight at a
time). tests/test_pipeline_memory.py checks that no slot is copied.
"""
import jax
import jax.numpy as jnp
import pytest

import ooojax as ooo
from ooojax import gpu_hlo

pytestmark = pytest.mark.skipif(gpu_hlo.unavailable_reason() is not None,
                                reason=f"compile-only GPU: {gpu_hlo.unavailable_reason()}")


@pytest.mark.parametrize("lag", [0, 1])
def test_four_stage_program_has_collective_permutes_in_the_tick_loop(lag):
  mesh = gpu_hlo.mesh("H100", 4, ("stage",))
  d = 128

  def stage_fn(p, x):
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]

  params = {k: jax.ShapeDtypeStruct((4, d, d), jnp.float32) for k in ("w1", "w2")}
  x = jax.ShapeDtypeStruct((32, d), jnp.float32)
  sched = ooo.pipeline.schedule("ooo", stages=4, microbatches=8, lag=lag)
  step = ooo.pipeline.value_and_grad(stage_fn, lambda y, t: jnp.mean((y - t) ** 2),
                                     mesh=mesh, axis_name="stage", schedule=sched)
  s = gpu_hlo.schedule(jax.jit(step), params, (x, x), mesh=mesh)
  permutes = s.pairs_of("collective-permute")
  print(s.summary())
  assert len(permutes) == 2                       # one ring each way per tick
  body = permutes[0].computation
  assert body != s.entry_name and permutes[1].computation == body  # inside the tick loop
  # The action switch: a conditional with one branch per action (the record
  # writes are two-branch conditionals).
  switch = [i for i in s.computations[body] if i.op == "conditional" and len(i.calls) > 2]
  assert len(switch) == 1
  gemms = [i for c in s.computations.values() for i in c if i.kind == "gemm"]
  assert gemms                                     # F, B and W kernels are cuBLAS GEMMs
  overlapping = [p for p in permutes if switch[0] in p.between]
  assert (len(overlapping) >= 1) if lag else not overlapping
