"""Pipeline tables tiled over several training steps (pure Python, no devices)."""

import dataclasses

import pytest

from ooojax.passes.pipeline.generate import SCHEDULES, generate, unfuse
from ooojax.passes.pipeline.schedule import Action, PipelineSchedule, ScheduleError
from ooojax.passes.pipeline.steps import steady_state, tile

SIZES = [(1, 3), (2, 2), (2, 5), (3, 4), (4, 4), (4, 8), (8, 16)]


def _move(s, action, tick):
  """`s` with compute or update `action` moved from its cell to `tick` (same stage)."""
  a = Action.parse(action)
  grid = [[list(c) for c in row] for row in s.grid]
  for cell in grid[a.stage]:
    if a in cell:
      cell.remove(a)
  grid[a.stage][tick].append(a)
  return dataclasses.replace(s, grid=tuple(tuple(tuple(c) for c in r) for r in grid))


def _tick(s, text):
  a = Action.parse(text)
  return next(t for t, cell in enumerate(s.grid[a.stage]) if a in cell)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("stages,microbatches", SIZES)
@pytest.mark.parametrize("lag", [0, 1])
def test_tiled_tables_validate_and_round_trip(name, stages, microbatches, lag):
  one = generate(name, stages, microbatches, lag=lag)
  three = tile(one, 3)
  assert three.validate() is three and three.steps == 3
  assert PipelineSchedule.parse(three.to_text()) == three
  assert all(Action.parse(str(a)) == a for row in three.grid for c in row for a in c)
  # One update per (stage, chunk) and step, in the cell of that chunk's last W.
  ups = [a for row in three.grid for c in row for a in c if a.kind == "U"]
  assert len(ups) == 3 * stages * one.chunks
  # Each stage waits only for its own update: never more activations than one step.
  assert three.peak_activations() == one.peak_activations()
  # Steps overlap (or at worst sit back to back): never longer than 3 separate steps.
  assert three.ticks <= 3 * one.ticks
  assert unfuse(three).validate().steps == 3


@pytest.mark.parametrize("name", SCHEDULES)
def test_one_step_is_unchanged(name):
  one = generate(name, 4, 8)
  assert tile(one, 1) is one and one.steps == 1
  assert "steps=" not in one.to_text() and "@" not in one.to_text()
  assert not any(a.kind == "U" for row in one.grid for c in row for a in c)


def test_action_text():
  assert str(Action(1, "W", 7, 0, 2)) == "1W7@2"
  assert str(Action(0, "U", 0, 1, 1)) == "0U.1@1"
  assert Action.parse("0F3.1@2") == Action(0, "F", 3, 1, 2)
  assert Action.parse("2U") == Action(2, "U", 0)
  with pytest.raises(ValueError, match="cannot parse"):
    Action.parse("0U3")  # an update has no microbatch
  with pytest.raises(ValueError, match="cannot parse"):
    Action.parse("0F@1")


def test_step_overlap_is_per_stage():
  two = tile(generate("zb-h2", 4, 8), 2)
  # Stage 0 starts step 1 right after its own update, while stage 3 still drains step 0.
  assert _tick(two, "0F0@1") == _tick(two, "0U") + 1
  assert _tick(two, "0F0@1") < _tick(two, "3U")
  # 1F1B: stage 0 is busy until the end of its step, so step 1 follows step 0.
  f = tile(generate("1f1b", 4, 8), 2)
  assert _tick(f, "0F0@1") == _tick(f, "0U") + 1 > max(_tick(f, f"{s}U") for s in range(1, 4))


def test_rejects_forward_before_its_stages_update():
  two = tile(generate("zb-h2", 4, 8), 2)
  t = _tick(two, "0U")
  # Stage 1's update of step 0 a tick after its first forward of step 1.
  bad = _move(two, "1U", _tick(two, "1F0@1") + 1)
  with pytest.raises(
    ScheduleError,
    match=r"1F0@1 at tick \d+ needs 1U \(tick \d+\) first; "
    r"step t \+ 1's forwards read the weights",
  ) as e:
    bad.validate()
  assert ">1F0@1<" in str(e.value)
  same = _move(two, "0U", _tick(two, "0F0@1"))  # a forward and the update it reads: one tick
  with pytest.raises(ScheduleError, match=r"0F0@1 at tick \d+ needs 0U"):
    same.validate()
  # An update before its step's last W.
  early = _move(two, "0U", t - 2)
  with pytest.raises(
    ScheduleError,
    match=r"0U at tick \d+ needs 0W7 \(tick \d+\) first; "
    "a stage's update waits for every W",
  ):
    early.validate()


def test_rejects_missing_update_and_memory_over_bound():
  two = tile(generate("1f1b", 2, 4), 2)
  t = _tick(two, "1U@1")
  grid = [list(r) for r in two.grid]
  grid[1][t] = tuple(a for a in grid[1][t] if a.kind != "U")
  gone = dataclasses.replace(two, grid=tuple(tuple(r) for r in grid))
  with pytest.raises(ScheduleError, match=r"1U@1 is missing"):
    gone.validate()
  plain = generate("1f1b", 2, 4)
  with pytest.raises(ScheduleError, match="needs each stage's update U"):
    dataclasses.replace(plain, steps=2).validate()
  with pytest.raises(ScheduleError, match="over its bound"):
    dataclasses.replace(two, bound=(1, 1)).validate()


def test_bad_arguments():
  one = generate("zb-h1", 2, 4)
  with pytest.raises(ValueError, match="steps must be an int >= 1"):
    tile(one, 0)
  with pytest.raises(ValueError, match="tile a one-step table"):
    tile(tile(one, 2), 2)
  with pytest.raises(ValueError, match="steps >= 2"):
    steady_state(one, 1)


@pytest.mark.parametrize("m", [8, 16])
def test_zb_h2_steady_bubble_vanishes(m):
  p = 4
  zb2 = steady_state(generate("zb-h2", p, m), steps=4)
  assert zb2.one_step_bubble == pytest.approx((p - 1) / (3 * m + p - 1))  # 0.111 at m = 8
  assert zb2.steady_bubble < 0.01 and zb2.step_times[1:] == (3.0 * m,) * 3
  assert zb2.bubble < zb2.one_step_bubble / 3  # over 4 steps, the warm-up once
  # The others' stage 0 idles inside its own step: tiling gains (almost) nothing.
  for name in ("gpipe", "1f1b", "zb-h1"):
    st = steady_state(generate(name, p, m), steps=4)
    assert st.steady_bubble == pytest.approx(st.one_step_bubble, abs=0.01)
    assert st.steady_bubble > 0.05
  assert generate("zb-h2", p, m).steady_bubble() == pytest.approx(zb2.steady_bubble)


def test_update_cost_and_plot():
  import matplotlib

  matplotlib.use("Agg")
  st = steady_state(generate("zb-h2", 4, 8), steps=3, costs={"U": 2.0})
  assert st.step_times[1] == pytest.approx(24.0 + 2.0)  # stage 0's update is on its path
  ax = tile(generate("zb-h2", 4, 8), 2).plot(costs={"U": 0.5})
  assert "2 steps" in ax.get_title()


def test_public_api_and_executor_refuses_tiled_tables():
  import jax
  import jax.numpy as jnp

  import ooojax as ooo

  two = ooo.pipeline.schedule("zb-h2", stages=2, microbatches=4, steps=2)
  assert two == ooo.pipeline.tile(ooo.pipeline.schedule("zb-h2", 2, 4), 2)
  mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
  with pytest.raises(ValueError, match="value_and_grad runs one step.s table"):
    ooo.pipeline.value_and_grad(
      lambda w, x: jnp.tanh(x @ w),
      lambda y, t: jnp.mean(y - t),
      mesh=mesh,
      axis_name="stage",
      schedule=two,
    )
