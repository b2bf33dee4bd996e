"""`ooo.explain(mode="data_parallel")`, `ooo.pipeline.explain` and their `hlo` CLI modes."""

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

matplotlib.use("Agg")

import ooojax as ooo  # noqa: E402
from ooojax import gpu_hlo  # noqa: E402
from ooojax.models import mlp_stack  # noqa: E402
from ooojax.passes.collectives import plan as collectives  # noqa: E402

needs_gpu_hlo = pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only GPU: {gpu_hlo.unavailable_reason()}",
)

L, D = 4, 128
PARAMS = {
  f"l{i}": {
    "w": jax.ShapeDtypeStruct((D, D), jnp.float32),
    "b": jax.ShapeDtypeStruct((D,), jnp.float32),
  }
  for i in range(L)
}
SHARD = jax.ShapeDtypeStruct((64, D), jnp.float32)  # one device's rows
DP = dict(mode="data_parallel", axis_name="batch", device="H100", link="10GbE")


def mlp_loss(p, x):
  for i in range(L):
    x = jnp.tanh(x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
  return jnp.mean(x**2)


# --- data parallel ---------------------------------------------------------------
def test_data_parallel_report_is_the_plan_ooo_grad_emits(tmp_path):
  r = ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=8, bucket_bytes=1, first_k=1, **DP)
  assert r.mode == "data_parallel" and r.first_k == 1 and r.first_k_layers == ("['l0']",)
  rows = r.buckets
  assert len(rows) == 2 * L  # bucket_bytes=1: one leaf per bucket
  assert sorted(p for b in rows for p in b.paths) == sorted(r.param_names)
  assert len(r.param_names) == 2 * L and "['l3']['w']" in r.param_names
  assert sum(b.nbytes for b in rows) == L * (D * D + D) * 4
  assert {p for b in rows if b.deferred for p in b.paths} == {"['l0']['w']", "['l0']['b']"}
  assert all(b.end > b.start for b in rows) and rows[-1].deferred  # layer 0 last
  assert r.plan.makespan >= r.compute_seconds and 0.0 <= r.overlap <= 1.0
  assert r.exposed_seconds == pytest.approx(r.plan.makespan - r.compute_seconds)
  # the same plan `ooo.grad(mode="data_parallel")` makes inside shard_map
  vg = ooo.value_and_grad(mlp_loss, bucket_bytes=1, first_k=1, **DP)
  box = {}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("batch",))

  def per_device(p, x):
    box["plan"], _ = vg.plan((p, x), {})
    return jnp.zeros(())

  full = jax.ShapeDtypeStruct((8 * SHARD.shape[0], D), jnp.float32)
  jax.eval_shape(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P(), check_vma=False
    ),
    PARAMS,
    full,
  )
  emitted = box["plan"].collectives
  assert [b.grads for b in emitted.buckets] == [b.grads for b in r.plan.buckets]
  assert emitted.link_actions == r.plan.link_actions
  text = repr(r)
  for s in (
    "reverse first-k: k=1",
    "['l0'] run their dW after the dX chain",
    "S7:",
    "(first-k)",
    "link:",
    "cost + link model, not measured",
    "hidden",
    "one all-reduce after the backward",
  ):
    assert s in text, s
  assert "<pre>" in r._repr_html_()
  ax = r.plot()
  ax.figure.savefig(tmp_path / "dp.png")
  assert (tmp_path / "dp.png").stat().st_size > 1000


def test_data_parallel_report_chooses_k_and_buckets():
  r = ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=16, cross_step=True, **DP)
  assert set(r.chosen) == {"bucket_bytes", "first_k"} and "chosen by the cost model" in repr(r)
  assert r.plan.bucket_bytes in collectives.BUCKET_CANDIDATES
  assert r.plan.cross_step <= r.plan.makespan + 1e-12
  one = ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=1, **DP)
  assert one.comm_seconds == 0.0 and one.overlap == 1.0  # nothing to reduce on one device


def test_data_parallel_report_says_what_is_carried_to_the_next_step():
  r = ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=8, bucket_bytes=1, first_k=2, **DP)
  assert r.carried_paths == ("['l0']['b']", "['l0']['w']", "['l1']['b']", "['l1']['w']")
  assert r.carried_bytes == 2 * (D * D + D) * 4
  assert r.hidden_seconds == pytest.approx(r.plan.makespan - r.plan.cross_step)
  # 10GbE: the forward needs l0 as it starts and l1 a quarter in, so the next step waits
  # for their carried all-reduces as long as this one would (`carried_seconds`): no gain
  assert r.hidden_seconds == 0.0 and r.plan.cross_step >= r.plan.makespan - 1e-12
  text = repr(r)
  assert (
    f"carried to the next step (dp.make_train_step, cross_step=True): the all-reduce "
    f"and optimizer update of layers ['l0'], ['l1'] (4 leaves, {r.carried_bytes} B "
    "per device in Pending"
  ) in text
  assert f"({r.hidden_seconds * 1e3:.3f} ms hidden)" in text
  none = ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=8, first_k=0, **DP)
  assert none.carried_paths == () and none.hidden_seconds == 0.0
  assert "carried to the next step (dp.make_train_step, cross_step=True): nothing" in repr(none)


def test_link_bound_report_prices_carrying_into_the_next_forward():
  """A link-bound step (100GbE, 8 layers of 1024): explain also plans the cross-step
  step, which carries the last layer the forward reads under the next forward."""
  from tests.models import tanh_mlp_structs

  params, loss = tanh_mlp_structs(8, 1024)
  x = jax.ShapeDtypeStruct((16384, 1024), jnp.float32)
  r = ooo.explain(loss, params, x, **{**DP, "link": "100GbE"}, axis_size=8)
  c = r.carried
  assert c.carried == {14, 15} and c.cross_step < r.plan.makespan
  assert f"the step simulates at {c.cross_step * 1e3:.3f} ms" in repr(r)
  assert "pgle_options" in repr(r)
  nvlink = ooo.explain(loss, params, x, **{**DP, "link": "nvlink"}, axis_size=8)
  assert nvlink.carried is None and "link-bound" not in repr(nvlink)


def test_data_parallel_report_reads_the_axis_size_inside_shard_map():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("batch",))
  box = {}

  def per_device(p, x):
    box["r"] = ooo.explain(mlp_loss, p, x, bucket_bytes=1, **DP)
    return jnp.zeros(())

  full = jax.ShapeDtypeStruct((4 * SHARD.shape[0], D), jnp.float32)
  jax.eval_shape(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P(), check_vma=False
    ),
    PARAMS,
    full,
  )
  assert isinstance(box["r"], ooo.DataParallelReport) and box["r"].plan.n_devices == 4


def test_data_parallel_report_errors():
  with pytest.raises(ValueError, match="axis_size=N"):
    ooo.explain(mlp_loss, PARAMS, SHARD, **DP)
  with pytest.raises(ValueError, match="axis_size must be a positive int"):
    ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=0, **DP)
  with pytest.raises(ValueError, match="mode='data_parallel' only"):
    ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=8, mode="in_order")
  with pytest.raises(ValueError, match="needs axis_name"):
    ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=8, mode="data_parallel")
  with pytest.raises(TypeError, match="unexpected keyword"):
    ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=8, bucket_mb=1, **DP)
  with pytest.raises(ValueError, match="unknown link"):
    ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=8, **{**DP, "link": "carrier pigeon"})
  with pytest.raises(ValueError, match="first_k=9 is larger"):
    ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=8, first_k=9, **DP)


@needs_gpu_hlo
def test_data_parallel_compiled_all_reduce_windows():
  r = ooo.explain(mlp_loss, PARAMS, SHARD, axis_size=8, bucket_bytes=1, first_k=1, **DP)
  c = r.compiled("H100")
  # One all-reduce per bucket, kept apart by the emitter's data edges; the
  # backward's GEMMs run inside most windows (the last buckets have none left).
  assert len(c.windows) == c.predicted == len(r.buckets)
  assert sum(w.overlapped for w in c.windows) >= len(c.windows) - 2
  assert all(not w.in_loop for w in c.windows)
  assert "all-reduces: 8" in c.summary() and "<pre>" in c._repr_html_()


# --- pipeline -----------------------------------------------------------------------
def _stack(vstages=2):
  return mlp_stack.make(vstages, layers=2 * vstages, dim=32, hidden=64, batch=16)


def test_pipeline_report_contents(tmp_path):
  stage_fn, loss_fn, params, batch = _stack(4)
  sched = ooo.pipeline.schedule("zb-h1", stages=4, microbatches=8)
  r = ooo.pipeline.explain(stage_fn, loss_fn, sched, params, batch, link="25GbE")
  assert r.schedule == sched and r.windows is None
  assert r.peak_activations == sched.peak_activations()
  # `memory` counts the records this host's programs keep; explained for an H100,
  # a GPU's (which saves some small reductions a CPU recomputes)
  cpu = ooo.pipeline.explain(stage_fn, loss_fn, sched, params, batch, device="CPU")
  assert r.memory.fres >= cpu.memory.fres
  assert cpu.memory == ooo.pipeline.memory(stage_fn, loss_fn, sched, params, batch)
  assert [s.peak for s in r.stages] == list(sched.peak_activations())
  m = r.memory
  assert r.stages[0].bound == m.weights + m.grads + sched.peak_activations()[0] * (m.fres + m.bres)
  assert set(r.costs) == {"F", "B", "W"} and all(v > 0 for v in r.costs.values())
  assert r.comm > 0 and r.link == "25GbE"
  assert r.unit_bubble_fraction == pytest.approx(sched.bubble_fraction())
  assert r.bubble_fraction == pytest.approx(sched.bubble_fraction(r.costs, r.comm))
  assert ooo.pipeline.PipelineSchedule.parse(r.to_text()) == sched
  text = repr(r)
  for s in (
    "bubble (simulated)",
    "cost model, H100, not measured",
    "stage 3: peak activations",
    "25GbE",
    "s0 ",
  ):
    assert s in text, s
  assert "<pre>" in r._repr_html_()
  ax = r.plot()
  assert "simulated" in ax.get_xlabel()
  ax.figure.savefig(tmp_path / "pipe.png")
  assert (tmp_path / "pipe.png").stat().st_size > 1000
  # by name: stages from the stacked parameters, 2 x stages microbatches
  by_name = ooo.pipeline.explain(stage_fn, loss_fn, "zb-h1", params, batch)
  assert by_name.schedule == sched and by_name.comm == 0.0


def test_pipeline_report_names_weights_sliced_from_a_stack():
  """mlp_stack's stage indexes each layer's weights out of its stack (`p["w1"][j]`):
  the report counts the GEMM operands that read such a row and says how to hold
  the layers instead; with each layer's weights an array of its own, no hint."""
  stage_fn, loss_fn, params, batch = _stack(2)  # 2 layers per stage, 2 weights each
  r = ooo.pipeline.explain(stage_fn, loss_fn, "1f1b", params, batch, microbatches=4)
  assert r.sliced_weights == 8  # 4 in F, 4 in B (the last stage: every dX is needed)
  assert "weights sliced from a stack: 8 GEMM operands" in repr(r)

  def rows_apart(p, x):
    for w1, w2 in zip(p["w1"], p["w2"]):
      x = x + jax.nn.gelu(mlp_stack.layer_norm(x) @ w1) @ w2
    return x

  apart = {
    k: [jax.ShapeDtypeStruct((a.shape[0], *a.shape[2:]), a.dtype)] * a.shape[1]
    for k, a in params.items()
  }
  r = ooo.pipeline.explain(rows_apart, loss_fn, "1f1b", apart, batch, microbatches=4)
  assert r.sliced_weights == 0 and "sliced from a stack" not in repr(r)


def test_pipeline_report_over_several_steps():
  import dataclasses

  stage_fn, loss_fn, params, batch = _stack(4)
  r = ooo.pipeline.explain(stage_fn, loss_fn, "zb-h2", params, batch, microbatches=8, steps=3)
  st = r.steady_state()
  assert st.steps == 3 and len(st.step_bubbles) == 3
  assert st.one_step_bubble == pytest.approx(r.bubble_fraction)
  assert st == ooo.pipeline.steady_state(r.schedule, 3, r.costs, r.comm)
  assert len(r.carried_actions) == 4
  text = repr(r)
  assert "over 3 steps (tiled, per-stage updates, simulated)" in text
  assert f"{st.one_step_bubble:.1%} for one synchronous step" in text
  assert "carried into the next step's warm-up" in text
  # F = B = W: step t's drain runs beside step t + 1's warm-up, no bubble left
  unit = dataclasses.replace(r, costs={"F": 1.0, "B": 1.0, "W": 1.0})
  assert unit.carried_actions == (
    (),
    ("1W7", "1U"),
    ("2W6", "2W7", "2U"),
    ("3W5", "3W6", "3W7", "3U"),
  )
  assert unit.steady_state().steady_bubble == pytest.approx(0.0)
  assert "stage 3: 3W5 3W6 3W7 3U" in repr(unit)
  one = ooo.pipeline.explain(stage_fn, loss_fn, "zb-h2", params, batch, microbatches=8)
  assert one.steady_state() is None and one.carried_actions == ()
  assert "steps (tiled, per-stage updates" not in repr(one)
  with pytest.raises(ValueError, match="steps must be an int >= 1"):
    ooo.pipeline.explain(stage_fn, loss_fn, "zb-h2", params, batch, steps=0)
  tiled = ooo.pipeline.schedule("zb-h2", stages=4, microbatches=8, steps=2)
  with pytest.raises(ValueError, match="explain a one-step table and pass steps=2"):
    ooo.pipeline.explain(stage_fn, loss_fn, tiled, params, batch)


def test_pipeline_report_interleaved_by_name():
  stage_fn, loss_fn, params, batch = _stack(4)  # 4 virtual stages = 2 devices x 2 chunks
  r = ooo.pipeline.explain(stage_fn, loss_fn, "interleaved", params, batch, microbatches=4)
  assert (r.schedule.stages, r.schedule.chunks, len(r.stages)) == (2, 2, 2)


def test_pipeline_report_errors():
  stage_fn, loss_fn, params, batch = _stack(2)
  ex = ooo.pipeline.explain
  with pytest.raises(ValueError, match="unknown schedule"):
    ex(stage_fn, loss_fn, "zigzag", params, batch)
  with pytest.raises(TypeError, match="schedule must be a name"):
    ex(stage_fn, loss_fn, 3, params, batch)
  sched = ooo.pipeline.schedule("1f1b", stages=2, microbatches=4)
  with pytest.raises(ValueError, match="disagrees"):
    ex(stage_fn, loss_fn, sched, params, batch, microbatches=8)
  with pytest.raises(ValueError, match="stacked on a leading axis of 4"):
    ex(stage_fn, loss_fn, ooo.pipeline.schedule("1f1b", stages=4, microbatches=4), params, batch)
  with pytest.raises(ValueError, match="divisible by microbatches=3"):
    ex(stage_fn, loss_fn, "1f1b", params, batch, microbatches=3)
  with pytest.raises(ValueError, match="unknown device spec"):
    ex(stage_fn, loss_fn, sched, params, batch, device="Z80")
  with pytest.raises(ValueError, match="unknown link"):
    ex(stage_fn, loss_fn, sched, params, batch, link="smoke signals")


@needs_gpu_hlo
@pytest.mark.parametrize("lag", [0, 1])
def test_pipeline_compiled_ppermute_windows(lag):
  stage_fn, loss_fn, params, batch = _stack(2)
  sched = ooo.pipeline.schedule("ooo", stages=2, microbatches=4, lag=lag)
  r = ooo.pipeline.explain(stage_fn, loss_fn, sched, params, batch, gpu="H100")
  assert r.gpu == "H100" and r.windows and all(w.in_loop for w in r.windows)
  assert all(w.kind == "collective-permute" for w in r.windows)
  busy = [w for w in r.windows if w.overlapped]
  if lag:
    # issued before the action: the tick's action switch (its GEMMs) runs inside
    assert len(busy) == 1 and busy[0].compute[0].startswith("conditional")
  else:
    assert not busy  # lag 0: a tick's transfer waits for its action
  assert "collective-permutes" in repr(r) and "tick loop" in repr(r)


@needs_gpu_hlo
def test_pipeline_compiled_both_rings_beside_the_action():
  # 4 stages at lag 1: a ring each way. `compiled` uses the table's
  # compiler_options (two collectives in flight): both windows hold the action;
  # XLA's default (one in flight) leaves one ring after it. (2 KiB per
  # transfer: at a few hundred bytes XLA finds nothing worth hiding.)
  stage_fn, loss_fn, params, batch = mlp_stack.make(4, layers=4, dim=128, hidden=256, batch=32)
  sched = ooo.pipeline.schedule("zb-h1", stages=4, microbatches=8, lag=1)
  r = ooo.pipeline.explain(stage_fn, loss_fn, sched, params, batch)
  both, default = (
    r.compiled("H100", compiler_options=o)
    for o in ({}, {"xla_gpu_experimental_parallel_collective_overlap_limit": 1})
  )
  assert [w.overlapped for w in both.windows] == [True, True]
  assert sorted(w.overlapped for w in default.windows) == [False, True]


# --- the hlo CLI --------------------------------------------------------------------
def test_cli_data_parallel(capsys):
  from ooojax.__main__ import main

  assert main(["hlo", "--mode", "data_parallel", "--tiny", "--devices", "2"]) == 0
  out = capsys.readouterr().out
  assert "mode=data_parallel over 2 devices" in out and "reverse first-k" in out
  assert ("all-reduces:" in out) == (gpu_hlo.unavailable_reason() is None)
  assert ("compiled: skipped" in out) == (gpu_hlo.unavailable_reason() is not None)


def test_cli_pipeline(capsys):
  from ooojax.__main__ import main

  assert (
    main(
      [
        "hlo",
        "--mode",
        "pipeline",
        "--tiny",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--schedule",
        "1f1b",
        "--size",
        "dim=32",
        "--size",
        "hidden=32",
      ]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert "ooojax pipeline plan: 1f1b, 2 stages" in out and "bubble (simulated)" in out
  assert ("collective-permutes" in out) == (gpu_hlo.unavailable_reason() is None)
  with pytest.raises(ValueError, match="needs a stack model"):
    main(["hlo", "--mode", "pipeline", "--model", "resnet50"])


def test_cli_pipeline_auto(capsys):
  # the zoo GPT's plain loss (dropout from its key) cut into stages by ooojax
  from ooojax.__main__ import main

  assert (
    main(
      [
        "hlo",
        "--mode",
        "pipeline",
        "--auto",
        "--tiny",
        "--batch",
        "4",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--schedule",
        "1f1b",
        "--size",
        "layers=2",
        "--size",
        "dim=16",
        "--size",
        "heads=2",
        "--size",
        "vocab=32",
      ]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert "mode=pipeline --auto" in out and "cut (automatic): 2 layers" in out
  assert ("collective-permutes" in out) == (gpu_hlo.unavailable_reason() is None)


# --- the automatic form: explain(loss_fn, params, *batch, stages=...) -----------------
def test_auto_explain_equals_the_explicit_explain_on_the_cut():
  from ooojax.pipeline import _auto_parts, _table
  from tests.test_pipeline_auto import _gpt

  loss, params, batch = _gpt(scan=True)
  auto = ooo.pipeline.explain(
    loss, params, *batch, stages=2, schedule="1f1b", microbatches=4, link="25GbE"
  )
  # the explicit form on the same cut (what value_and_grad(loss_fn) runs)
  leaves, tree = jax.tree.flatten(params)
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  parts = _auto_parts(loss, False, _table("1f1b", 2, 4, None), 1, avals, tree, batch)
  c, counts = parts.cut, parts.balance.counts
  sfn, lfn, ifn = parts.fns
  ex = ooo.pipeline.explain(
    sfn,
    lfn,
    "1f1b",
    c.stage_params(leaves, counts),
    parts.rowed(jax.tree.leaves(batch)),
    tuple(leaves[i] for i in c.shared),
    ifn,
    microbatches=4,
    link="25GbE",
  )
  assert auto.to_text() == ex.to_text()
  assert auto.bubble_fraction == pytest.approx(ex.bubble_fraction)
  assert auto.memory == ex.memory and auto.costs == pytest.approx(ex.costs)
  assert auto.cut.layers == 4 and auto.cut.scanned
  assert auto.cut.tied and "embedding" in " ".join(auto.cut.tied)  # emb.attend: tied
  assert auto.balance.counts == counts and sum(counts) == 4
  text = auto.summary()
  assert "cut (automatic): 4 layers, one scan" in text and "balance: layers per" in text
  assert "balance: layers per" in auto._repr_html_()
  # the same through a mesh and with a Python loop of blocks
  mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
  loop, lp, lb = _gpt(scan=False)
  r = ooo.pipeline.explain(loop, lp, *lb, mesh=mesh, axis_name="stage", microbatches=4)
  assert r.schedule.name == "ooo" and not r.cut.scanned and "a loop of" in r.summary()
  assert auto.sliced_weights == 0 and r.sliced_weights == 0  # the cut's layouts: no rows


def test_auto_explain_heavy_head_and_shapes_only():
  from tests.test_pipeline_balance import _lm

  loss, params, batch = _lm(8)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
  r = ooo.pipeline.explain(loss, shapes[0], *shapes[1], stages=4, schedule="1f1b", microbatches=4)
  b = r.balance
  assert b.counts[-1] < max(b.counts) and b.step_seconds < b.even_step_seconds, b
  assert r.cut.last == ("['head']",) and r.cut.first == ("['embed']",)
  assert f"vs {b.even_step_seconds * 1e3:.3f} ms even" in r.summary()
  even = ooo.pipeline.explain(
    loss, params, *batch, stages=4, schedule="1f1b", microbatches=4, layers="even"
  )
  assert even.balance.counts == (2, 2, 2, 2)


def test_auto_explain_errors():
  from tests.test_pipeline_auto import _mlp

  loss, params, batch = _mlp(widths=[16, 24, 12, 20])  # layers of different shapes
  with pytest.raises(ValueError, match="found no repeated stack"):
    ooo.pipeline.explain(loss, params, *batch, stages=2, microbatches=2)
  loss, params, batch = _mlp()
  with pytest.raises(TypeError, match="one of stages=N or mesh"):
    ooo.pipeline.explain(loss, params, *batch, microbatches=2)
  with pytest.raises(TypeError, match="belong to the explicit form"):
    ooo.pipeline.explain(loss, params, *batch, stages=2, input_fn=lambda x: x)
  stage_fn, loss_fn, sp, b = mlp_stack.make(2, layers=2, dim=8, hidden=8)
  with pytest.raises(TypeError, match="stages belong to the automatic form"):
    ooo.pipeline.explain(stage_fn, loss_fn, "1f1b", sp, b, stages=2)


def test_auto_explain_side_inputs():
  from tests.test_pipeline_side import _lm

  loss, params, batch = _lm(scan=True, segments=True)  # a padding mask and segment ids
  r = ooo.pipeline.explain(loss, params, *batch, stages=2, schedule="1f1b", microbatches=4)
  assert r.cut.side == ("batch[0]", "batch[1]")
  assert "side inputs (every stage reads): batch[0], batch[1]" in r.summary()


def test_data_parallel_report_says_when_to_step_aside():
  """Where no bucketing beats one all-reduce after the backward (a small model: every
  all-reduce's fixed cost outweighs what it hides), explain says plain GSPMD is as good;
  where early buckets win, it does not."""
  from tests.models import tanh_mlp_structs

  def report(layers, dim):
    params, loss = tanh_mlp_structs(layers, dim)
    x = jax.ShapeDtypeStruct((128, dim), jnp.float32)
    return ooo.explain(
      loss, params, x, mode="data_parallel", axis_name="b", axis_size=8, device="H100"
    )

  small, big = report(3, 256), report(8, 1024)
  assert "nothing to gain" in small.summary() and len(small.plan.buckets) == 1
  assert "nothing to gain" not in big.summary() and len(big.plan.buckets) > 1
  assert big.plan.makespan < 0.98 * big.baseline
