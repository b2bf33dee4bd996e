"""Pipeline schedule tables: generators, validator, metrics, text form."""

import dataclasses

import pytest

from ooojax.passes.pipeline.generate import SCHEDULES, generate
from ooojax.passes.pipeline.schedule import Action, PipelineSchedule, ScheduleError

SIZES = [(1, 3), (2, 2), (2, 5), (3, 4), (4, 4), (4, 8), (4, 3), (8, 16), (16, 8)]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("stages,microbatches", SIZES)
def test_every_schedule_is_valid_and_round_trips(name, stages, microbatches):
  s = generate(name, stages, microbatches)
  assert s.validate() is s
  assert PipelineSchedule.parse(s.to_text()) == s
  assert all(Action.parse(str(a)) == a for row in s.grid for c in row for a in c)
  assert max(s.peak_activations()) <= max(s.bound)
  assert 0.0 <= s.bubble_fraction() < 1.0
  assert str(s).count("\n") >= stages


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 16), (8, 32), (16, 64)])
def test_known_bubbles(p, m):
  one_f_one_b = (p - 1) / (m + p - 1)
  assert generate("1f1b", p, m).bubble_fraction() == pytest.approx(one_f_one_b)
  assert generate("gpipe", p, m).bubble_fraction() == pytest.approx(one_f_one_b)
  # ZB-H1: (p - 1)(F + B - 2W) idle with F = B = W: a third of 1F1B's (3m units of work).
  zb1 = generate("zb-h1", p, m)
  assert zb1.bubble_fraction() == pytest.approx((p - 1) / (3 * m + p - 1))
  assert max(zb1.peak_activations()) == p == max(generate("1f1b", p, m).peak_activations())
  # ZB-H2: no idle tick inside any stage's span (the staggered ends overlap the step).
  zb2 = generate("zb-h2", p, m)
  assert zb2.simulate().inner_bubble_fraction == pytest.approx(0.0)
  assert max(zb2.peak_activations()) <= 2 * p
  # Gradient fast-forwarding beats 1F1B at 1F1B's memory on every stage but the last.
  ooo = generate("ooo", p, m)
  assert ooo.bubble_fraction() < one_f_one_b
  assert ooo.peak_activations()[:-1] == tuple(p - s for s in range(p - 1))
  assert generate("interleaved", p, m).bubble_fraction() < one_f_one_b


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16), (8, 32)])
def test_zb_v(p, m):
  v = generate("zb-v", p, m)
  assert v.placement == "v" and v.place(2 * p - 1) == (0, 1)  # the V: back to device 0
  assert max(v.peak_activations()) <= 2 * p  # chunk activations: 1F1B's peak of whole stages
  assert v.bubble_fraction() < generate("zb-h1", p, m).bubble_fraction()


@pytest.mark.parametrize("name", SCHEDULES)
def test_generated_for_costs(name):
  costs = {"F": 1.0, "B": 1.4, "W": 0.25}
  s = generate(name, 4, 8, costs=costs)  # planned with these durations, still a valid table
  assert s.validate() is s and s.bubble_fraction(costs) < 0.5


def test_costs_change_the_bubble():
  s = generate("zb-h1", 4, 8)
  assert s.bubble_fraction({"F": 1, "B": 2, "W": 1}) != s.bubble_fraction()
  assert s.simulate(comm=0.5).makespan > s.simulate().makespan


def test_interleaved_modulo_allocation():
  s = generate("interleaved", 4, 8, chunks=3)
  assert s.virtual_stages == 12
  assert {(a.stage, a.chunk) for a in s.compute_actions()} == {s.place(vs) for vs in range(12)}
  assert s.place(5) == (1, 1)  # layer block 5 on device 5 mod 4


def _replace(s, stage, tick, cell):
  grid = [list(r) for r in s.grid]
  grid[stage][tick] = cell
  return dataclasses.replace(s, grid=tuple(tuple(r) for r in grid))


def _find(s, text):
  a = Action.parse(text)
  for t, cell in enumerate(s.grid[a.stage]):
    if a in cell:
      return t
  raise AssertionError(text)


def test_rejects_w_before_b():
  s = generate("zb-h1", 2, 2)
  tb, tw = _find(s, "1B0"), _find(s, "1W0")
  grid = [list(r) for r in s.grid]
  grid[1][tb], grid[1][tw] = (
    tuple(a if a.kind != "B" else Action(1, "W", 0) for a in grid[1][tb]),
    tuple(a if a.kind != "W" else Action(1, "B", 0) for a in grid[1][tw]),
  )
  bad = dataclasses.replace(s, grid=tuple(tuple(r) for r in grid))
  with pytest.raises(ScheduleError, match=r"1W0 at tick \d+ needs 1B0") as e:
    bad.validate()
  assert ">1W0<" in str(e.value)  # the grid is printed with the bad action marked


def test_rejects_missing_f():
  s = generate("1f1b", 2, 3)
  t = _find(s, "0F2")
  bad = _replace(s, 0, t, tuple(a for a in s.grid[0][t] if str(a) != "0F2"))
  with pytest.raises(ValueError, match="0F2 is missing"):
    bad.validate()


def test_rejects_send_without_receive():
  s = generate("gpipe", 2, 2)
  t = _find(s, "0F0")
  bad = _replace(s, 1, t, tuple(a for a in s.grid[1][t] if a.kind != "RF"))
  with pytest.raises(ScheduleError, match="missing receive|no matching receive"):
    bad.validate()
  extra = _replace(s, 0, t + 3, s.grid[0][t + 3] + (Action(0, "SF", 1),))
  with pytest.raises(ScheduleError, match="SF1"):
    extra.validate()


def test_rejects_over_memory_bound_and_duplicates():
  s = generate("1f1b", 4, 8)
  with pytest.raises(ScheduleError, match="over its bound"):
    dataclasses.replace(s, bound=(2, 2, 2, 1)).validate()
  gp = generate("gpipe", 2, 2)
  t = _find(gp, "1F1")
  with pytest.raises(ScheduleError, match="runs twice|compute actions"):
    _replace(gp, 1, t, gp.grid[1][t] + (Action(1, "F", 0),)).validate()


def test_bad_arguments():
  with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
    generate("zb", 4, 8)
  with pytest.raises(ValueError, match="stages must be"):
    generate("1f1b", 0, 8)
  with pytest.raises(ValueError, match="chunks=2 is for name='interleaved'"):
    generate("1f1b", 2, 2, chunks=2)
  with pytest.raises(ValueError, match="cannot parse pipeline action"):
    Action.parse("F3")


def test_plot():
  import matplotlib

  matplotlib.use("Agg")
  ax = generate("ooo", 4, 8).plot()
  assert "ooo" in ax.get_title()


@pytest.mark.parametrize(
  "name", ["ooojax.passes.pipeline.generate", "ooojax.passes.pipeline.simulate", "ooojax.pipeline"]
)
def test_docstring_examples(name):
  import doctest
  import importlib

  result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("name", SCHEDULES)
def test_lag_one_tables(name):
  s = generate(name, 4, 8, lag=1)
  assert s.lag == 1 and PipelineSchedule.parse(s.to_text()) == s
  assert s.ticks >= generate(name, 4, 8).ticks
  sends = {
    (a.kind[1], a.microbatch, a.chunk, a.stage): t
    for r in s.grid
    for t, c in enumerate(r)
    for a in c
    if a.kind in ("SF", "SB")
  }
  assert sends  # every receive is one tick after its send
  with pytest.raises(ScheduleError, match="no matching receive|missing receive"):
    dataclasses.replace(s, lag=0).validate()
