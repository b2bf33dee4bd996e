"""`ooo.pipeline.tune` / `PipelineTrainStep.tune`: the measured pick of a table.

The candidates are tables the other pipeline tests check against jax.grad; here:
the tuned step still follows the synchronous loop, timing leaves the state as it
was, the slowest candidate loses, and two processes pick the same table."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ooojax as ooo
from tests.conftest import assert_trees_close, run_workers
from tests.test_pipeline_auto import _gpt
from tests.test_pipeline_train_step import _batches, _follow, _make, _mesh, _reference


def test_tuned_train_step_follows_the_synchronous_loop():
  loss, params, (tokens,) = _gpt(scan=False)
  batches = _batches(tokens)
  opt = optax.sgd(0.1, momentum=0.9)
  step = _make(loss, opt, _mesh(), schedule="ooo")
  state = step.init(params, *batches[0])
  before = jax.tree.map(np.asarray, state)
  tuned = step.tune(state, *batches[0], rounds=2)
  # timing ran real steps, but on copies: the state passed in is unchanged
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)
  t = tuned.tuning
  assert list(t.times) == ["ooo", "1f1b", "gpipe"] and t.label in t.times
  assert all(len(v) == 2 and min(v) > 0 for v in t.times.values())
  assert t.peaks == {"ooo": 2, "1f1b": 2, "gpipe": 2}  # 2 microbatches: all fit
  assert tuned.sched == t.schedule and step.sched.name == "ooo"  # the original stays
  assert tuned.balance == step.balance
  assert t.label in str(t) and "score" in t.summary()
  _follow(tuned, state, batches, _reference(loss, opt, params, batches, 2))


def test_the_slowest_candidate_loses_and_the_tie_keeps_the_preferred():
  def build(t):  # 1f1b's table "runs" 20 ms slower than ooo's
    return lambda *_: time.sleep(0.02 if t.name == "1f1b" else 0.001)

  _, t = ooo.pipeline.tune(
    build, (), stages=2, microbatches=4, candidates=["1f1b", "ooo"], rounds=3
  )
  assert t.label == "ooo" and t.schedule.name == "ooo"
  # tie=0.5: the first candidate wins unless another is over 1.5x faster
  _, t = ooo.pipeline.tune(
    lambda t: lambda *_: time.sleep(0.004 if t.name == "gpipe" else 0.005),
    (),
    stages=2,
    microbatches=4,
    candidates=["ooo", "gpipe"],
    rounds=3,
    tie=0.5,
  )
  assert t.label == "ooo" and t.peaks == {"ooo": 2, "gpipe": 4}


def _scan_loss(w, x, t):
  h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]
  return jnp.mean((h - t) ** 2)


def test_a_tiled_step_tunes_too():
  step = _make(_scan_loss, optax.sgd(0.1), _mesh(), schedule="ooo", steps=2)
  x = jax.random.normal(jax.random.key(0), (2, 8, 8))
  t = jnp.zeros_like(x)
  state = step.init(jnp.full((4, 8, 8), 0.1), x, t)
  tuned = step.tune(state, x, t, candidates=["gpipe", "1f1b"], rounds=1)
  assert type(tuned) is type(step) and tuned.tuning.label in ("gpipe", "1f1b")
  (s1, l1), (s2, l2) = tuned(state, x, t), step(state, x, t)
  assert_trees_close(l1, l2)
  assert_trees_close(s1.params, s2.params)


def test_a_candidate_that_fails_is_left_out_in_one_process():
  def build(t):
    if t.name != "gpipe":
      return lambda *_: time.sleep(0.001)

    def oom(*_):
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 64 GiB\nmore detail")

    return oom

  names = ["ooo", "1f1b", "gpipe"]
  _, t = ooo.pipeline.tune(build, (), stages=2, microbatches=4, candidates=names, rounds=1)
  assert list(t.times) == ["ooo", "1f1b"] and t.label in ("ooo", "1f1b")
  assert t.failed == {"gpipe": "RuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating 64 GiB"}
  assert "gpipe" in t.summary() and "left out" in t.summary()
  # every candidate failing: the step itself is broken, and its first error is raised
  with pytest.raises(ZeroDivisionError):
    ooo.pipeline.tune(lambda t: lambda *_: 1 / 0, (), stages=2, microbatches=4)


def test_lags_tried_in_turn_and_a_lag_one_step_keeps_its_lag():
  build = lambda t: lambda *_: time.sleep(0.001)  # noqa: E731
  _, t = ooo.pipeline.tune(build, (), stages=2, microbatches=4, rounds=1, lag=(0, 1))
  assert list(t.times) == ["ooo", "1f1b", "gpipe", "ooo, lag 1", "1f1b, lag 1", "gpipe, lag 1"]
  _, t = ooo.pipeline.tune(build, (), stages=2, microbatches=4, candidates=["1f1b"], lag=1)
  assert list(t.times) == ["1f1b"] and t.schedule.lag == 1
  for bad in (2, (), True, (0, 2), None):
    with pytest.raises(ValueError, match="lag must be 0, 1"):
      ooo.pipeline.tune(build, (), stages=2, microbatches=4, lag=bad)
  # a step built on a lag-1 table tunes among lag-1 tables unless told otherwise
  sched = ooo.pipeline.schedule("ooo", stages=2, microbatches=2, lag=1)
  step = _make(_scan_loss, optax.sgd(0.1), _mesh(), schedule=sched)
  x = jax.random.normal(jax.random.key(0), (2, 8, 8))
  state = step.init(jnp.full((4, 8, 8), 0.1), x, jnp.zeros_like(x))
  tuned = step.tune(state, x, jnp.zeros_like(x), candidates=["gpipe", "1f1b"], rounds=1)
  assert tuned.sched.lag == 1 and tuned.tuning.schedule.lag == 1
  (s1, l1), (s2, l2) = tuned(state, x, jnp.zeros_like(x)), step(state, x, jnp.zeros_like(x))
  assert_trees_close(l1, l2)
  assert_trees_close(s1.params, s2.params)


def test_tunes_under_an_explicit_set_mesh_with_data_replicas():
  # today's JAX: the mesh set with Explicit axes, the batch sharded over "data";
  # every candidate runs the same data x stage step
  from jax.sharding import NamedSharding, PartitionSpec as P

  explicit = (jax.sharding.AxisType.Explicit,) * 2
  mesh = jax.make_mesh((2, 2), ("data", "stage"), devices=jax.devices()[:4], axis_types=explicit)
  with jax.set_mesh(mesh):
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 8)), NamedSharding(mesh, P("data")))
    t = jnp.zeros_like(x)
    step = ooo.pipeline.make_train_step(
      _scan_loss, optax.sgd(0.1), mesh=mesh, axis_name="stage", data_axis="data", microbatches=2
    )
    state = step.init(jnp.full((4, 8, 8), 0.1), x, t)
    tuned = step.tune(state, x, t, candidates=["1f1b", "gpipe"], rounds=1)
    (s1, l1), (s2, l2) = tuned(state, x, t), step(state, x, t)
  assert tuned.tuning.label in ("1f1b", "gpipe")
  assert_trees_close(l1, l2)
  assert_trees_close(s1.params, s2.params)


def test_tune_errors():
  with pytest.raises(ValueError, match="tie must be"):
    ooo.pipeline.tune(lambda t: None, (), stages=2, microbatches=4, tie=1.5)
  with pytest.raises(ValueError, match="rounds must be"):
    ooo.pipeline.tune(lambda t: None, (), stages=2, microbatches=4, rounds=0)
  with pytest.raises(ValueError, match="no candidate fits budget=1"):
    ooo.pipeline.tune(lambda t: None, (), stages=2, microbatches=4, candidates=["1f1b"], budget=1)
  with pytest.raises(ValueError, match="a table of 4 stages"):
    ooo.pipeline.tune(
      lambda t: None,
      (),
      stages=2,
      microbatches=4,
      candidates=[("x", ooo.pipeline.schedule("1f1b", 4, 4))],
    )
  with pytest.raises(TypeError, match="sequence of names"):
    ooo.pipeline.tune(lambda t: None, (), stages=2, microbatches=4, candidates="gpipe")
  loss, params, (tokens,) = _gpt(scan=False)
  step = _make(loss, optax.sgd(0.1), _mesh(), schedule="ooo")
  with pytest.raises(ValueError, match="call step.init"):
    step.tune(None, tokens)
  state = step.init(params, tokens)
  with pytest.raises(ValueError, match="lays the weights out differently"):
    step.tune(state, tokens, candidates=["ooo", "interleaved"])  # chunks: another layout


def test_two_processes_pick_the_same_table(tmp_path):
  """2 processes (jax.distributed + gloo, 1 CPU device each): process 0's times decide."""
  import json

  run_workers("_tune_worker.py", [tmp_path / f"{i}.json" for i in range(2)])
  got = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
  assert got[0] == got[1]  # the same label, and process 0's times on both
  assert got[0]["label"] in got[0]["times"] and len(got[0]["times"]) == 3
  assert np.isfinite(got[0]["loss"])
