"""The schedule is visible in what XLA gets: stream annotations and control edges."""

import re

import jax
import jax.numpy as jnp
import pytest

import ooojax as ooo
from ooojax import _api
from tests.conftest import cpu_backend_only

pytestmark = cpu_backend_only


# 5 layers: jax >= 0.11's backward has no transposes around the dX matmuls,
# so with 4 the cost model finds w2's dW (3.9 us, H100 spec) no longer half
# hidden behind the one dX matmul left (3.8 us) and keeps it on stream 0.
LAYERS = 5


def _wide_mlp():
  k = jax.random.split(jax.random.PRNGKey(0), LAYERS)
  p = {f"w{i}": jax.random.normal(k[i], (512, 512)) * 0.05 for i in range(LAYERS)}
  x = jax.random.normal(jax.random.PRNGKey(9), (256, 512))

  def loss(p, x):
    for i in range(LAYERS):
      x = jnp.tanh(x @ p[f"w{i}"])
    return jnp.mean(x**2)

  return loss, p, x


def _ctrl_edges(hlo: str) -> int:
  return sum(len(m.split(",")) for m in re.findall(r"control-predecessors=\{([^}]*)\}", hlo))


def test_single_gpu_annotates_dw_and_pins_order():
  loss, p, x = _wide_mlp()
  f = jax.jit(ooo.grad(loss, mode="single_gpu", device="H100", ordering="control_deps"))
  lowered = f.lower(p, x)
  stablehlo = lowered.as_text()
  n = len(ooo.explain(loss, p, x, mode="single_gpu", device="H100").schedule.calls)
  assert n >= 2
  # one annotated call per side-stream call of the schedule
  assert len(re.findall(r'call @\S+\(.*_xla_stream_annotation = "1"', stablehlo)) == n
  compiled = lowered.compile().as_text()
  calls = re.findall(r"call\(.*_xla_stream_annotation=\"1\"", compiled)
  assert len(calls) == n
  # n - 1 edges chain the stream-1 calls in schedule order
  assert _ctrl_edges(compiled) == n - 1

  base = jax.jit(jax.grad(loss)).lower(p, x)
  assert "_xla_stream_annotation" not in base.as_text()
  assert _ctrl_edges(base.compile().as_text()) == 0


def test_pinned_order_is_the_schedule_order():
  loss, p, x = _wide_mlp()
  g = ooo.grad(loss, mode="single_gpu", device="H100", ordering="control_deps")
  report = ooo.explain(loss, p, x, mode="single_gpu", device="H100")
  side = [report.schedule.unit(u).label for u in report.on_stream(1)]
  # backward visits the last layer first; w1 and w0 become ready after the
  # last matmul of the dX chain (x's cotangent is dead): nothing left to
  # hide them behind, so they stay on stream 0
  assert side == ["['w4']", "['w3']"]
  tail = [report.schedule.unit(u).label for u in report.on_stream(0)[-2:]]
  assert tail == ["['w1']", "['w0']"]
  compiled = jax.jit(g).lower(p, x).compile().as_text()
  entry = compiled[compiled.index("ENTRY") :]
  names = re.findall(r"%(\S+) = \S+ call\(", entry)
  preds = dict(re.findall(r"%(\S+) = \S+ call\(.*?control-predecessors=\{%([^},]+)\}", entry))
  # every pinned call waits on the call before it: a chain covering both
  assert len(names) == 2 and len(preds) == 1
  assert set(preds.values()) <= set(names)


@pytest.mark.parametrize("ordering,edges", [("none", 0), ("scheduling_group", 0), ("barriers", 0)])
def test_other_orderings_compile(ordering, edges):
  loss, p, x = _wide_mlp()
  f = jax.jit(ooo.grad(loss, mode="single_gpu", device="H100", ordering=ordering))
  lowered = f.lower(p, x)
  compiled = lowered.compile().as_text()
  assert _ctrl_edges(compiled) == edges
  if ordering == "scheduling_group":
    assert "_scheduling_group_id" in lowered.as_text()
  want = jax.grad(loss)(p, x)
  got = f(p, x)
  for k in want:
    assert jnp.allclose(got[k], want[k], atol=1e-6)


def test_in_order_mode_has_no_annotations():
  loss, p, x = _wide_mlp()
  f = jax.jit(ooo.grad(loss, mode="in_order", device="H100"))
  assert "_xla_stream_annotation" not in f.lower(p, x).as_text()


def test_cpu_spec_keeps_small_work_on_one_stream():
  loss, p, x = _wide_mlp()
  r = ooo.explain(loss, p, x, streams=1, device="H100")
  assert r.on_stream(1) == [] and len(r.schedule.streams) == 1


def test_auto_mode_picks_the_mode_measured_fastest():
  # CPU has no streams: auto re-emits in order with no annotations. On a GPU the
  # calibrated cost model decides (tests/test_stream_cost.py).
  assert ooo.Options().resolved_mode() == "in_order"
  assert _api.AUTO_MODE == {"cpu": "in_order", "gpu": "single_gpu"}
  loss, p, x = _wide_mlp()
  text = jax.jit(ooo.grad(loss, device="H100")).lower(p, x).as_text()
  assert "_xla_stream_annotation" not in text
  forced = jax.jit(ooo.grad(loss, device="H100", mode="single_gpu")).lower(p, x).as_text()
  assert "_xla_stream_annotation" in forced


def test_ordering_is_chosen_per_lowering_platform():
  # One trace: control edges when lowering for CPU (XLA:CPU rewrites the
  # control_dep custom call), none when lowering for CUDA (XLA:GPU has no
  # rewriter and would fail on the custom call), whatever the default backend.
  loss, p, x = _wide_mlp()
  f = jax.jit(ooo.grad(loss, mode="single_gpu", device="H100"))
  traced = f.trace(p, x)
  cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "control_dep" in cpu and "control_dep" not in cuda
  assert cuda.count('_xla_stream_annotation = "1"') >= 2
  assert _ctrl_edges(f.lower(p, x).compile().as_text()) >= 1
  assert ooo.Options().resolved_ordering() == "auto"
  with pytest.raises(ValueError, match="unknown ordering"):
    ooo.grad(loss, ordering="pinned")


@pytest.mark.parametrize("ordering", ["auto", "control_deps", "barriers"])
def test_pinned_steps_keep_jits_fast_dispatch(ordering):
  # Any jaxpr effect turns off jit's C++ dispatch: each call of the step then
  # went through Python (0.6-6 ms a step on the H200, benchmarks.gpu_gaps), the
  # whole single-GPU loss measured there. The control edges carry none, and
  # still reach XLA:CPU.
  loss, p, x = _wide_mlp()

  @jax.jit
  def step(p, x):
    g = ooo.grad(loss, mode="single_gpu", device="H100", ordering=ordering)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

  assert jax.make_jaxpr(step)(p, x).effects == set()
  if ordering != "barriers":
    assert _ctrl_edges(step.lower(p, x).compile().as_text()) >= 1
