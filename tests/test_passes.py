"""Each pass on its own: split classification, cost, simulate, schedule IR."""

import jax
import jax.numpy as jnp
import pytest

import ooojax.passes.split as split
from ooojax.passes import cost, ir, simulate
from ooojax.passes.ir import Action, Kind, Unit, UnitKind
from ooojax.passes.schedule import in_order, replace_streams, schedule


def _two_layer():
  def f(ct, w0, w1, w2, x):
    def loss(w0, w1, w2):
      return jnp.sum(jnp.tanh(jnp.tanh(x @ w0) @ w1) @ w2)

    y, vjp = jax.vjp(loss, w0, w1, w2)
    return (y, *vjp(ct))

  s = jax.ShapeDtypeStruct
  avals = [
    s((), jnp.float32),
    s((4, 8), jnp.float32),
    s((8, 8), jnp.float32),
    s((8, 2), jnp.float32),
    s((3, 4), jnp.float32),
  ]
  return split.split(f, avals, n_grads=3, param_names=["w0", "w1", "w2"])


def test_split_classifies_dx_and_dw():
  sp = _two_layer()
  eqns = sp.jaxpr.jaxpr.eqns
  assert [c.param for c in sp.clusters] == ["w2", "w1", "w0"]  # backward order
  # every DW equation of w2 feeds only w2's gradient; the matmuls are there
  w2 = [eqns[k].primitive.name for k in sp.clusters[0].eqns]
  assert "dot_general" in w2
  dx = [eqns[k].primitive.name for k, kd in enumerate(sp.kinds) if kd is Kind.DX]
  assert "dot_general" in dx  # dh2 = dy @ w2.T is the critical path
  # dh1 = dh2 @ w1.T feeds only w0's gradient: nothing waits on it, so it is dW
  assert "dot_general" in [eqns[k].primitive.name for k in sp.clusters[2].eqns]
  # the forward never depends on the cotangent
  ct = sp.jaxpr.jaxpr.invars[0]
  for k, kd in enumerate(sp.kinds):
    if kd is Kind.FORWARD:
      assert ct not in eqns[k].invars


def test_split_drops_unneeded_input_cotangent():
  def f(ct, w, x):
    y, vjp = jax.vjp(lambda w, x: jnp.sum(jnp.sin(x @ w)), w, x)
    return (y, vjp(ct)[0])  # x's cotangent computed, not returned

  s = jax.ShapeDtypeStruct
  sp = split.split(
    f,
    [s((), jnp.float32), s((3, 3), jnp.float32), s((2, 3), jnp.float32)],
    n_grads=1,
    param_names=["w"],
  )
  assert sp.count(Kind.DEAD) >= 1


def test_split_keeps_scan_whole_and_counts_it():
  def f(ct, w, x):
    def loss(w):
      h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)
      return jnp.sum(h)

    y, vjp = jax.vjp(loss, w)
    return (y, *vjp(ct))

  s = jax.ShapeDtypeStruct
  sp = split.split(
    f,
    [s((), jnp.float32), s((3, 3), jnp.float32), s((2, 3), jnp.float32)],
    n_grads=1,
    param_names=["w"],
  )
  assert "scan" in sp.opaque


def test_cost_model_dot_flops_and_specs():
  sp = _two_layer()
  dots = [e for e in sp.jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  fwd = cost.estimate(dots[0])  # x @ w1: 3x4 @ 4x8
  assert fwd.flops == 2 * 3 * 8 * 4 and fwd.kernel
  for name in ("V100", "A100", "H100"):
    assert cost.get_spec(name).name == name
  with pytest.raises(ValueError, match="unknown device spec"):
    cost.get_spec("nope")
  cm = cost.CostModel("V100", measured={"w1": 0.5})
  assert cm.unit_cost(dots, label="w1").seconds == 0.5
  slow = cost.CostModel("V100").unit_cost(dots).seconds
  fast = cost.CostModel("H100").unit_cost(dots).seconds
  assert slow > fast > 0


def _u(kind, i, deps=(), cost_=1.0, util=1.0):
  return Unit(kind, i, (), tuple(deps), cost_, util)


def test_simulate_two_independent_kernels_on_two_streams():
  a, b = _u(UnitKind.DX, 0, util=0.5), _u(UnitKind.DW, 0, util=0.5)
  t = simulate.simulate([[Action("X", 0, 0)], [Action("W", 0, 1)]], [a, b])
  assert t.makespan == pytest.approx(1.0)  # fit side by side
  a, b = _u(UnitKind.DX, 0, util=1.0), _u(UnitKind.DW, 0, util=1.0)
  t = simulate.simulate([[Action("X", 0, 0)], [Action("W", 0, 1)]], [a, b])
  assert t.makespan == pytest.approx(2.0)  # saturating kernels share the device


def test_simulate_chain_and_sync():
  units = [_u(UnitKind.DX, 0), _u(UnitKind.DX, 1, ["X0"]), _u(UnitKind.DW, 0, ["X0"], util=0.1)]
  t = simulate.simulate(
    [[Action("X", 0, 0), Action("X", 1, 0)], [Action("W", 0, 1)]], units, sync=0.25
  )
  spans = {s.unit: s for s in t.spans}
  assert spans["X1"].start == pytest.approx(1.0)
  assert spans["W0"].start == pytest.approx(1.25)
  # X1 (util 1.0) and W0 (util 0.1) overlap from 1.25 at load 1.1, both slowed:
  # X1 ends at 1.25 + 0.75 * 1.1; W0 has 0.25 left then, alone.
  assert spans["X1"].end == pytest.approx(2.075)
  assert t.makespan == pytest.approx(2.325)


def test_simulate_detects_deadlock():
  units = [_u(UnitKind.DX, 0, ["W0"]), _u(UnitKind.DW, 0, ["X0"])]
  with pytest.raises(simulate.DeadlockError, match="deadlocks"):
    simulate.simulate([[Action("X", 0, 0)], [Action("W", 0, 1)]], units)


def test_action_text_round_trips():
  for text in ["W3@1", "X0@0", "F0@0"]:
    assert str(Action.parse(text)) == text
  with pytest.raises(ValueError, match="cannot parse"):
    Action.parse("W3")
  streams = ir.Schedule.parse_streams("F0@0 X0@0\nW0@1")
  assert streams[1] == (Action("W", 0, 1),)


def test_schedule_is_valid_and_round_trips():
  sp = _two_layer()
  sched = schedule(sp, cost.CostModel("H100"), streams=2)
  names = sorted(a.unit for s in sched.streams for a in s)
  assert names == sorted(u.name for u in sched.units)  # each unit exactly once
  assert sched.makespan <= sched.in_order_makespan
  again = replace_streams(sched, ir.Schedule.parse_streams(sched.to_text()))
  assert again.streams == sched.streams
  with pytest.raises(ValueError, match="exactly once"):
    replace_streams(sched, [[Action("F", 0, 0)]])
  one = schedule(sp, cost.CostModel("H100"), streams=1)
  assert one.streams == in_order(one.units)


def test_simulate_send_on_a_slow_link():
  link = simulate.LINKS["10GbE"]
  t_send = link.seconds(100e6)  # 100 MB at 10 Gb/s: 80 ms + latency
  assert t_send == pytest.approx(0.08 + 20e-6)
  units = [
    _u(UnitKind.DX, 0, cost_=0.05),
    _u(UnitKind.DX, 1, ["X0"], cost_=0.05),
    Unit(UnitKind.SEND, 0, (), ("X0",), t_send, 1.0),
    _u(UnitKind.DW, 0, ["S0"], cost_=0.01),
  ]
  streams = [[Action("X", 0, 0), Action("X", 1, 0), Action("W", 0, 0)], [Action("S", 0, 1)]]
  t = simulate.simulate(streams, units, links={1})
  spans = {s.unit: s for s in t.spans}
  # the transfer overlaps X1 without slowing it (links do not load the device)
  assert spans["X1"].end == pytest.approx(0.1)
  assert spans["S0"].end == pytest.approx(0.05 + t_send)
  assert spans["W0"].start == pytest.approx(0.05 + t_send)  # waits on the slow link
  assert t.makespan == pytest.approx(0.05 + t_send + 0.01)
  assert str(Action.parse("S0@1")) == "S0@1"


def test_plan_calls_groups_by_issue_point_and_anchors_after_the_call():
  from ooojax.passes.schedule import plan_calls

  units = [
    _u(UnitKind.FORWARD, 0),
    _u(UnitKind.DX, 0, ["F0"]),
    _u(UnitKind.DX, 1, ["X0"]),
    _u(UnitKind.DX, 2, ["X1"]),
    _u(UnitKind.DW, 0, ["X0"], util=0.2),
    _u(UnitKind.DW, 1, ["X0"], util=0.2),
    _u(UnitKind.DW, 2, ["X1"], util=0.2),
  ]
  streams = [
    [Action("F", 0, 0), Action("X", 0, 0), Action("X", 1, 0), Action("X", 2, 0)],
    [Action("W", 0, 1), Action("W", 1, 1), Action("W", 2, 1)],
  ]
  tl = simulate.simulate(streams, units)
  # heavy eqns: X1 holds eqn 10 (ends half way) and X2 eqns 20 and 21
  heavy = {"X1": [(0.5, 10)], "X2": [(0.25, 20), (1.0, 21)]}
  calls = plan_calls(streams, units, tl, heavy)
  assert [c.units for c in calls] == [("W0", "W1"), ("W2",)]
  assert [c.after for c in calls] == ["X0", "X1"]
  spans = {s.unit: s for s in tl.spans}
  # W0+W1 end after X1's heavy eqn: the first heavy eqn ending after them
  ends = {10: spans["X1"].start + 0.5, 20: spans["X2"].start + 0.25, 21: spans["X2"].end}
  assert ends[calls[0].anchor] >= spans["W1"].end or calls[0].anchor == 21
  assert calls[1].anchor in (20, 21)  # never X1's own eqn: it ends before W2 starts
  # no timeline: grouped, unanchored
  assert all(c.anchor == -1 for c in plan_calls(streams, units))
