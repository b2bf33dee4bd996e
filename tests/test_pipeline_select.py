"""The `select` tick loop (a GPU's lowering, `passes.pipeline.ticks.tick_lowering`):
every tick runs every action and keeps its row's, so the loop body holds no
`conditional`, which XLA:GPU would run by copying its branch index to the host.

On CPU it is forced with `OOOJAX_TICKS=select` and gives the microbatch loop's
gradients (and the synchronous loop's trajectory, tiled); compiled for a
compile-only H100 (where it is the default) no schedule's step, one-step or
tiled, holds a conditional.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import ooojax as ooo
from ooojax import gpu_hlo
from ooojax.passes.hlo import schedule as hlo_schedule
from ooojax.passes.pipeline.lowering import TICKS, select_pays, tick_lowering
from tests.test_pipeline import _mesh, _mlp, check_mlp_schedule
from tests.test_pipeline_train import check_tiled_train

NAMES = ["gpipe", "1f1b", "ooo", "zb-h1", "zb-h2", "interleaved", "zb-v"]


@pytest.mark.parametrize("name,lag", [(n, 0) for n in NAMES] + [("zb-h1", 1), ("interleaved", 1)])
def test_select_ticks_match_jax_grad(name, lag, monkeypatch):
  monkeypatch.setenv(TICKS, "select")
  check_mlp_schedule(name, lag=lag)


@pytest.mark.parametrize("name", ["zb-h2", "interleaved", "zb-v"])
def test_select_ticks_tiled_match_synchronous_loop(name, monkeypatch):
  monkeypatch.setenv(TICKS, "select")  # the updates run under `where` on every tick
  steps, opt = 2, optax.adam(1e-2)
  sched = ooo.pipeline.schedule(name, stages=2, microbatches=4, steps=steps)
  check_tiled_train(sched, opt, steps)


def test_tick_lowering_default_and_bad_value(monkeypatch):
  monkeypatch.delenv(TICKS, raising=False)
  assert tick_lowering(_mesh(2)) == "switch"  # a CPU conditional is a branch
  # On a GPU `select` where its masked work costs less than a host round trip
  # per tick (small ticks), else `switch`.
  sched = ooo.pipeline.schedule("1f1b", stages=4, microbatches=8)
  assert select_pays(sched, {"F": 1e-6, "B": 1e-6, "W": 1e-6})
  assert not select_pays(sched, {"F": 1e-3, "B": 2e-3, "W": 1e-3})
  monkeypatch.setenv(TICKS, "fused")
  with pytest.raises(ValueError, match="use auto"):
    tick_lowering(_mesh(2))


def _tiny(S, sched):
  d = 32
  sd = jax.ShapeDtypeStruct
  params = {"w": sd((sched.virtual_stages, d, d), jnp.float32)}
  x = sd((16, d), jnp.float32)
  stage_fn = lambda p, h: h + jnp.tanh(h @ p["w"])  # noqa: E731
  loss_fn = lambda y, t: jnp.mean((y - t) ** 2)  # noqa: E731
  return stage_fn, loss_fn, params, x


def _loop_conditionals(text):
  """The `conditional`s in the compiled step's while-loop bodies (and anything they call)."""
  s = hlo_schedule.parse(text)
  return [i.name for c in s.loop_bodies() for i in s.computations[c] if i.op == "conditional"]


@pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only GPU: {gpu_hlo.unavailable_reason()}",
)
@pytest.mark.parametrize(
  "name,tiled",
  [(n, False) for n in NAMES] + [(n, True) for n in ("1f1b", "zb-h2", "interleaved", "zb-v")],
)
def test_h100_tick_loop_has_no_conditional(name, tiled, monkeypatch):
  monkeypatch.setenv(TICKS, "select")  # (`auto` picks it for ticks this small, too)
  S = 2
  mesh = gpu_hlo.mesh("H100", S, ("stage",))
  sched = ooo.pipeline.schedule(name, stages=S, microbatches=4, steps=2 if tiled else 1)
  stage_fn, loss_fn, params, x = _tiny(S, sched)
  if tiled:
    opt = optax.sgd(0.1, momentum=0.9)
    run = ooo.pipeline.train(stage_fn, loss_fn, opt, mesh=mesh, axis_name="stage", schedule=sched)
    state = jax.eval_shape(jax.vmap(opt.init), params)
    xs = jax.ShapeDtypeStruct((2, *x.shape), x.dtype)
    args = (params, state, (xs, xs))
  else:
    run = ooo.pipeline.value_and_grad(
      stage_fn, loss_fn, mesh=mesh, axis_name="stage", schedule=sched
    )
    args = (params, (x, x))
  text = gpu_hlo.compile_text(jax.jit(run), *args, mesh=mesh)
  s = hlo_schedule.parse(text)
  assert s.loop_bodies()  # the tick loop is there
  assert _loop_conditionals(text) == []
  assert " conditional(" not in text


def test_explain_says_which_tick_loop_runs_and_what_select_wastes():
  stage_fn, loss_fn, params, x, t = _mlp(4)
  r = ooo.pipeline.explain(stage_fn, loss_fn, "1f1b", params, (x, t), device="H100")
  c = r.select_cost()
  assert len(c.actions) == 9 and 0.85 < c.wasted_fraction < 1  # F, B, W x first/middle/last
  assert c.makespan > r.step_seconds  # every action on every tick
  assert r.lowering == "select"  # ticks this small: cheaper than a host round trip each
  (line,) = [l for l in r.summary().splitlines() if "tick loop on H100" in l]
  assert "select" in line and "masked" in line and "ms a tick" in line and "issue 48" in line
  cpu = ooo.pipeline.explain(stage_fn, loss_fn, "1f1b", params, (x, t), device="CPU")
  assert cpu.lowering == "switch" and "tick loop on CPU: switch" in cpu.summary()
