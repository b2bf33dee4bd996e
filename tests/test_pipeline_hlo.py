"""The 4-stage pipeline program compiled for a compile-only H100 (no GPU needed).

What XLA:GPU makes of it (jaxlib 0.11.2): the table's scan becomes a while loop
whose body holds the per-tick action switch (a conditional with a branch per
action) and its transfers. With `lag=0` a tick's transfers wait for its
action, and only the (sender, receiver) pairs that carry a value send: each
transfer pattern of the table is one collective-permute in a branch of a
small conditional, so no filler crosses the link. With `lag=1` (receives one
tick after the send) the two rings (one each way) send on every pair the
table uses (not the last stage -> first stage hop of a 1-chunk table), issued
before the action. By default one of the two permutes has the action switch
(the tick's F/B/W GEMMs) between its start and done and XLA's GPU scheduler
runs the other after it (one collective in flight at a time); compiled with
`ooo.pipeline.compiler_options(sched)` (two in flight) both have it.
tests/test_pipeline_memory.py checks that no slot is copied.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import ooojax as ooo
from ooojax import gpu_hlo
from ooojax.passes.hlo import schedule as hlo_schedule

pytestmark = pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only GPU: {gpu_hlo.unavailable_reason()}",
)


def _action_switch(s):
  """(loop body, instruction) of the action switch: the conditional whose
  branches run GEMMs (the record writes and lag-0 transfers are conditionals too)."""
  (switch,) = [
    (c, i)
    for c, instrs in s.computations.items()
    for i in instrs
    if i.op == "conditional"
    and any(x.kind == "gemm" for b in s.reachable(i.calls) for x in s.computations[b])
  ]
  return switch


@pytest.mark.parametrize("lag", [0, 1])
def test_four_stage_program_has_collective_permutes_in_the_tick_loop(lag, monkeypatch):
  # The switch lowering (a GPU runs `select` by default: tests/test_pipeline_ticks_gpu.py).
  monkeypatch.setenv("OOOJAX_TICKS", "switch")
  mesh = gpu_hlo.mesh("H100", 4, ("stage",))
  d = 128

  def stage_fn(p, x):
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]

  params = {k: jax.ShapeDtypeStruct((4, d, d), jnp.float32) for k in ("w1", "w2")}
  x = jax.ShapeDtypeStruct((32, d), jnp.float32)
  sched = ooo.pipeline.schedule("ooo", stages=4, microbatches=8, lag=lag)
  step = ooo.pipeline.value_and_grad(
    stage_fn, lambda y, t: jnp.mean((y - t) ** 2), mesh=mesh, axis_name="stage", schedule=sched
  )
  text = gpu_hlo.compile_text(jax.jit(step), params, (x, x), mesh=mesh)
  s = hlo_schedule.parse(text)
  permutes = s.pairs_of("collective-permute")
  print(s.summary())
  body, switch = _action_switch(s)
  assert body != s.entry_name and body in s.loop_bodies()  # inside the tick loop
  gemms = [i for c in s.computations.values() for i in c if i.kind == "gemm"]
  assert gemms  # F, B and W kernels are cuBLAS GEMMs
  loop = set(s.loop_bodies())
  assert permutes and all(p.computation in loop for p in permutes)
  if lag:
    # One ring each way, issued before the action. XLA's default keeps one
    # collective in flight: one window holds the action, the other ring waits
    # after it.
    assert len(permutes) == 2 and all(p.computation == body for p in permutes)
    assert [switch in p.between for p in permutes].count(True) == 1
    # With the table's options (two in flight) both rings run beside it.
    opts = ooo.pipeline.compiler_options(sched)
    assert opts
    both = hlo_schedule.parse(
      gpu_hlo.compile_text(jax.jit(step), params, (x, x), mesh=mesh, compiler_options=opts)
    )
    _, switch2 = _action_switch(both)
    permutes2 = both.pairs_of("collective-permute")
    assert len(permutes2) == 2 and all(switch2 in p.between for p in permutes2)
    # Each ring sends on the pairs the 1-chunk table uses: no wrap-around hop.
    rings = sorted(
      re.findall(r"collective-permute-start\(.*?source_target_pairs=(\{[{}0-9,]*\})", text)
    )
    assert rings == ["{{0,1},{1,2},{2,3}}", "{{1,0},{2,1},{3,2}}"]
  else:
    # Only the pairs that carry a value send: one permute per pattern of the
    # table, each in its own branch; nothing to overlap (the tick waits).
    assert len(permutes) > 2 and all(p.computation != body for p in permutes)
