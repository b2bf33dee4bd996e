"""The tick loop on a GPU, read from the compile-only H100's optimized HLO and XLA's log.

On one H200 (benchmarks/RESULTS.md, "The second GPU run") the executor's ticks
cost 88 us each beyond their work with a switch and two record `cond`s a tick,
54 us with the records written on every tick (now the GPU default): XLA:GPU
runs a conditional on the host, and the record conds' branches read their
record as 30 slice copies per W tick. Under `lowering.GRAPHS` the whole loop is
one CUDA graph (device-side while and conditionals), which XLA can only build
when nothing in the loop is a slice at the loop counter (a DynamicSliceFusion):
the tick reads its row of the table as a masked sum.
"""

import os
import re
import subprocess
import sys

import jax
import pytest

import ooojax as ooo
from ooojax import gpu_hlo
from ooojax.passes.hlo.schedule import parse
from tests.test_pipeline_memory import _args, _step

needs_gpu_hlo = pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only GPU: {gpu_hlo.unavailable_reason()}",
)


def _gpu_lowering(monkeypatch):
  """A GPU's `switch` tick loop, on CPU: records on every tick, rows masked."""
  from ooojax.passes.pipeline.lowering import TICKS
  from ooojax.passes.pipeline.tick_options import RECORD_WRITES, TICK_ROWS

  monkeypatch.setenv(TICKS, "switch")
  monkeypatch.setenv(RECORD_WRITES, "always")
  monkeypatch.setenv(TICK_ROWS, "masked")


@pytest.mark.parametrize("name", ["1f1b", "zb-h2", "interleaved", "zb-v"])
def test_gpu_tick_loop_on_cpu_matches_jax_grad(name, monkeypatch):
  from tests.test_pipeline import check_mlp_schedule

  _gpu_lowering(monkeypatch)
  check_mlp_schedule(name)


def test_gpu_tick_loop_on_cpu_tiled_matches_synchronous_loop(monkeypatch):
  import optax

  from tests.test_pipeline_train import check_tiled_train

  _gpu_lowering(monkeypatch)
  steps = 2
  sched = ooo.pipeline.schedule("interleaved", stages=2, microbatches=4, steps=steps)
  check_tiled_train(sched, optax.adam(1e-2), steps)


def test_tick_rows_bad_value(monkeypatch):
  from ooojax.passes.pipeline.tick_options import TICK_ROWS, masked_rows
  from tests.test_pipeline import _mesh

  assert not masked_rows(_mesh(2))  # CPU: the scan slices the rows
  monkeypatch.setenv(TICK_ROWS, "sometimes")
  with pytest.raises(ValueError, match="use auto"):
    masked_rows(_mesh(2))


def _loop_ops(text):
  s = parse(text)
  return [i for c in s.loop_bodies() for i in s.computations[c]]


@needs_gpu_hlo
def test_h100_default_tick_has_one_conditional_no_counter_slice_no_record_slices(monkeypatch):
  from ooojax.passes.pipeline.tick_options import RECORD_WRITES

  monkeypatch.setenv("OOOJAX_TICKS", "switch")  # (`auto` might pick select for ticks this small)
  mesh = gpu_hlo.mesh("H100", 1, ("stage",))
  sched = ooo.pipeline.schedule("1f1b", stages=1, microbatches=8)
  params, batch = _args(sched.virtual_stages)
  ops = {}
  for mode in ("cond", "auto"):  # auto: always, on a GPU
    monkeypatch.setenv(RECORD_WRITES, mode)
    ops[mode] = _loop_ops(gpu_hlo.compile_text(_step(mesh, sched), params, batch, mesh=mesh))
  conds = {m: sum(i.op == "conditional" for i in o) for m, o in ops.items()}
  assert conds == {"cond": 3, "auto": 1}  # the action's switch alone
  # no async dynamic slice of the table at the loop counter (a DynamicSliceFusion)
  assert not [i.name for i in ops["auto"] if i.op.endswith("-start")]
  # W reads its records from a two-row stack (slot, trash) in its fusions; from a
  # one-row stack under `cond` jax 0.11.2's XLA copies out each record value first
  # (jax 0.12's reads both in place)
  slices = {m: sum("wrapped_slice" in i.name for i in o) for m, o in ops.items()}
  assert slices["auto"] <= slices["cond"], slices
  if jax.__version__.startswith("0.11."):
    assert slices["auto"] < slices["cond"], slices


_SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, optax
import ooojax as ooo
from ooojax import gpu_hlo
from ooojax.passes.pipeline.lowering import GRAPHS
gpu = gpu_hlo.target_config("H100", driver="13.0.0")
stage = lambda p, h: h + jnp.tanh(h @ p["w"])
loss = lambda y, t: jnp.mean((y - t) ** 2)
sd = jax.ShapeDtypeStruct
names = ("gpipe", "1f1b", "ooo", "zb-h1", "zb-h2", "interleaved", "zb-v")
for name, S, tiled in [(n, 2, False) for n in names] + [("interleaved", 2, True)]:
  mesh = gpu_hlo.mesh(gpu, S, ("stage",))
  sched = ooo.pipeline.schedule(name, stages=S, microbatches=4, steps=2 if tiled else 1)
  params = {"w": sd((sched.virtual_stages, 16, 16), jnp.float32)}
  x = sd((16, 16), jnp.float32)
  if tiled:
    opt = optax.sgd(0.1)
    run = ooo.pipeline.train(stage, loss, opt, mesh=mesh, axis_name="stage", schedule=sched)
    xs = sd((2, 16, 16), jnp.float32)
    args = (params, jax.eval_shape(jax.vmap(opt.init), params), (xs, xs))
  else:
    run = ooo.pipeline.value_and_grad(stage, loss, mesh=mesh, axis_name="stage", schedule=sched)
    args = (params, (x, x))
  print("COMPILE", name, flush=True, file=sys.stderr)
  t = gpu_hlo.compile_text(jax.jit(run), *args, mesh=mesh, gpu=gpu, compiler_options=GRAPHS)
  print("CONDITIONALS", t.count(" conditional("), flush=True, file=sys.stderr)
for name in ("1f1b", "zb-h1"):  # with a data axis: (2 data x 2 stage)
  mesh = gpu_hlo.mesh(gpu, (2, 2), ("data", "stage"))
  sched = ooo.pipeline.schedule(name, stages=2, microbatches=4)
  run = ooo.pipeline.value_and_grad(
    stage, loss, mesh=mesh, axis_name="stage", data_axis="data", schedule=sched
  )
  params = {"w": sd((sched.virtual_stages, 16, 16), jnp.float32)}
  print("COMPILE", name, "data", flush=True, file=sys.stderr)
  t = gpu_hlo.compile_text(jax.jit(run), params, (x, x), mesh=mesh, gpu=gpu, compiler_options=GRAPHS)
  print("CONDITIONALS", t.count(" conditional("), flush=True, file=sys.stderr)
# the tiled train step with a data axis (make_train_step(steps=2), 2 data x 2 stage)
from jax.sharding import NamedSharding, PartitionSpec as P
def mlp(p, x, y):
  for w in p["ws"]:
    x = jnp.tanh(x @ w)
  return jnp.mean((x - y) ** 2)
mesh = gpu_hlo.mesh(gpu, (2, 2), ("data", "stage"))
put = lambda shape, spec: sd(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
p = {"ws": [put((16, 16), P())] * 4}
xs = put((2, 16, 16), P(None, "data"))
step = ooo.pipeline.make_train_step(
  mlp, optax.sgd(0.1), mesh=mesh, axis_name="stage", data_axis="data", microbatches=4,
  schedule="zb-h2", steps=2,
)
print("COMPILE zb-h2 tiled data", flush=True, file=sys.stderr)
t = step.lower(step.abstract_state(p, xs, xs), xs, xs).compile(compiler_options=GRAPHS).as_text()
print("CONDITIONALS", t.count(" conditional("), flush=True, file=sys.stderr)
"""


@needs_gpu_hlo
def test_h100_tick_loop_is_one_cuda_graph_under_graphs():
  """XLA's command-buffer pass (its log: `TF_CPP_VMODULE`, read at start, so a
  subprocess) puts each step's tick loop, conditionals, collectives and all,
  into one command buffer: no tick returns to the host. The `switch` loop (with
  its conditionals) of every schedule on two stages, one tiled over two steps,
  two with a data axis, and the tiled train step with a data axis."""
  env = dict(
    os.environ,
    OOOJAX_TICKS="switch",  # the loop with conditionals (`auto` picks select for ticks this small)
    JAX_PLATFORMS="cpu",
    TF_CPP_MIN_LOG_LEVEL="0",
    TF_CPP_VMODULE="command_buffer_conversion_pass=2",
  )
  env.pop("XLA_FLAGS", None)
  r = subprocess.run(
    [sys.executable, "-c", _SCRIPT],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  assert r.returncode == 0, r.stderr[-3000:]
  log = r.stderr
  assert "not convertible" not in log, re.findall(r".*not convertible.*", log)
  parts = log.split("COMPILE ")[1:]
  assert len(parts) == 11, log[-3000:]
  for part in parts:
    assert int(re.search(r"CONDITIONALS (\d+)", part).group(1)) > 0, part.splitlines()[0]
    made = re.findall(r"Creating command buffer thunk\b.*? with the following thunks: (.*)", part)
    loops = [m for m in made if re.search(r"(^|, )while(\.\d+)?(,|$)", m)]
    assert loops, (part.splitlines()[0], made)


def test_graph_options_are_known_to_this_jax():
  """`GRAPHS` compiles on CPU too (other backends ignore GPU options)."""
  from ooojax.passes.pipeline.lowering import GRAPHS

  f = jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=GRAPHS)
  assert float(f(1.0)) == 2.0
