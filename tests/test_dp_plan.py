"""The data-parallel plan search prices each candidate in closed form (`collectives._Pricer`).

Its prices must equal `build_plan`'s simulation for every candidate, so the
search keeps exactly the plan the simulated search chose.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ooojax as ooo
from ooojax.passes.collectives import plan as collectives
from ooojax.passes.cost import CostModel
from tests import models


def _split_sched(loss, args):
  vg = ooo.value_and_grad(loss, mode="in_order", device="H100")
  box = {}

  def trace(*a):
    box["plan"], _ = vg.plan(a, {})
    return 0.0

  jax.eval_shape(trace, *args)
  return box["plan"].split, box["plan"].schedule


def _deep(L=14, D=64):
  ws = {f"l{i}": {"w": jnp.ones((D, D)), "b": jnp.zeros(D)} for i in range(L)}
  ws["unused"] = jnp.ones(3)  # a leaf no dW unit produces: the last bucket's

  def loss(w, x):
    for i in range(L):
      x = jnp.tanh(x @ w[f"l{i}"]["w"] + w[f"l{i}"]["b"])
    return jnp.mean(x**2)

  return loss, (ws, jnp.ones((32, D)))


def _scan_mlp(L=4, D=16):
  p = {"w": jnp.ones((L, D, D)), "b": jnp.ones((L, D)), "out": jnp.ones((D, 3))}

  def loss(p, x):
    h, _ = jax.lax.scan(
      lambda h, l: (jnp.tanh(h @ l["w"] + l["b"]), None), x, {"w": p["w"], "b": p["b"]}
    )
    return jnp.mean((h @ p["out"]) ** 2)

  return loss, (p, jnp.ones((8, D)))


def _lstm():
  loss, p, xs = models.lstm_case()
  return loss, (p, xs)


_CASES = {
  "deep": _deep,
  "scan": _scan_mlp,
  "lstm": _lstm,
  "block": models.block_case,
  "tied_lm": models.tied_lm_case,
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_prices_equal_simulation_and_the_choice_is_the_best(case):
  loss, args = _CASES[case]()
  split, sched = _split_sched(loss, args)
  n_layers = len(collectives.layers_forward(split))
  for link, n in (("nvlink", 8), ("10GbE", 64)):
    lk = collectives.get_link(link)
    in_loop = bool(collectives.scan_collectives.loop_reductions(split, sched))
    costs = collectives.BucketCosts.of(CostModel("H100").spec)  # as `plan` prices buckets
    pricer = collectives._Pricer(split, sched, lk, n, in_loop, costs, loss=True)
    # one collective in flight (XLA:GPU's rule), priced for k = 0
    pricer1 = collectives._Pricer(split, sched, lk, n, in_loop, costs, True, in_flight=1)
    sims = {}
    for b in collectives.BUCKET_CANDIDATES:
      for k in range(n_layers + 1):
        # the small last bucket apart / joined; the loss not reduced, reduced early / late
        choices = ((False, None), (True, None), (False, True), (True, False))
        for m, e in choices if k == 0 else choices[:1]:
          p = collectives.build_plan(
            split, sched, k, b, lk, n, in_loop, costs=costs, merge_tail=m, early=e
          )
          sims[k, b, m, e] = (p.makespan, p.cross_step)
          np.testing.assert_allclose(pricer.score(k, b, False, m, e), p.makespan, rtol=1e-12)
          np.testing.assert_allclose(pricer.score(k, b, True, m, e), p.cross_step, rtol=1e-12)
          if k == 0:
            p = collectives.build_plan(
              split, sched, k, b, lk, n, in_loop, costs=costs, merge_tail=m, early=e, in_flight=1
            )
            np.testing.assert_allclose(pricer1.score(k, b, False, m, e), p.makespan, rtol=1e-12)
            np.testing.assert_allclose(pricer1.score(k, b, True, m, e), p.cross_step, rtol=1e-12)
    for cross, loss in ((False, False), (True, False), (False, True)):
      chosen = collectives.plan(
        split, sched, CostModel("H100"), n, link, cross_step=cross, loss=loss
      )
      best = min(
        v[cross]
        for (k, _, _, e), v in sims.items()
        if (k in range(0, n_layers + 1, max(1, -(-n_layers // 12))) or k == n_layers)
        and (e is not None) == loss
      )
      got = chosen.cross_step if cross else chosen.makespan
      assert got <= best * (1 + 1e-9)


def test_carried_buckets_are_priced_against_the_forward_that_needs_them():
  """The cross-step step reduces its carried leaves in buckets of the plan's size, layer
  0 first, chained from the step's start; the forward waits at a layer whose bucket is
  not done (a hand case: 3 leaves of 1 MB, buckets of 2 MB)."""
  from ooojax.passes.collectives.carried import carried_buckets, carried_stall

  lk = collectives.get_link("nvlink")
  nbytes = [1 << 20] * 3
  assert carried_buckets((2, 0, 1), nbytes, 2 << 20) == [((2, 0), 2 << 20), ((1,), 1 << 20)]
  two, one = (collectives.bucket_seconds(lk, m << 20, 8) + 1e-5 for m in (2, 1))
  # leaf 2 is needed when the forward starts, leaf 1 half-way through a 1 s forward
  stall, link = carried_stall(
    (2, 0, 1), {2: 0.0, 0: 0.0, 1: 0.5}, 1.0, nbytes, 2 << 20, lk, 8, 1e-5
  )
  assert link == pytest.approx(two + one) and stall == pytest.approx(two)
  # a short forward: leaf 1's bucket, done at two + one, is waited for at 0.5 * fwd
  fwd = two
  stall, _ = carried_stall((2, 0, 1), {2: 0.0, 0: 0.0, 1: 0.5}, fwd, nbytes, 2 << 20, lk, 8, 1e-5)
  assert stall == pytest.approx(two + one - 0.5 * fwd)


def test_a_small_last_bucket_joins_the_one_before():
  """Issued after a large bucket, a small last one would force the large one's done
  before the backward ends (XLA:GPU keeps one collective in flight): it joins it."""
  from ooojax.passes.collectives.buckets import _group

  first = [(0, "W0"), (1, "W1"), (2, "W2")]
  last = {0: (0, "W0"), 1: (1, "W1"), 2: (2, "W2")}
  assert _group((first, last, (), [100, 100, 10]), 100, merge_tail=True) == [
    ((0,), 100, "W0"),
    ((1, 2), 110, "W2"),
  ]
  # a last bucket of a quarter of the size or more stays apart; the choice is priced apart
  assert len(_group((first, last, (), [100, 100, 25]), 100, merge_tail=True)) == 3
  assert len(_group((first, last, (), [100, 100, 10]), 100)) == 3


def test_the_plan_prices_one_collective_in_flight():
  """A bucket's start waits for the previous bucket's done (XLA:GPU keeps one collective
  in flight): the compute stream stalls there, which the queue model
  (`passes.simulate.simulate`, transfers queued behind each other) leaves out; the small
  last bucket is joined to the one before or kept apart, whichever simulates faster."""
  from ooojax.passes.ir import Action, Unit, UnitKind
  from ooojax.passes.simulate import simulate

  # F0 W0 W1 X0 on the compute stream; S0 (2 s) after W0, S1 (0.1 s) after W1
  k = UnitKind
  units = [
    Unit(k.FORWARD, 0, (), (), 1.0),
    Unit(k.DW, 0, (), ("F0",), 1.0),
    Unit(k.DW, 1, (), ("F0",), 0.1),
    Unit(k.DX, 0, (), ("F0",), 3.0),
    Unit(k.SEND, 0, (), ("W0",), 2.0),
    Unit(k.SEND, 1, (), ("W1",), 0.1),
  ]
  order = [Action(*a, 0) for a in (("F", 0), ("W", 0), ("W", 1), ("X", 0))]
  sends = [Action("S", i, collectives.LINK_STREAM) for i in (0, 1)]
  queued = simulate((order, sends), units, 0.0, links=(collectives.LINK_STREAM,))
  assert queued.makespan == pytest.approx(5.1)  # S0 2..4, S1 4..4.1, X0 2.1..5.1
  tl = collectives.in_flight_timeline(order, units, sends)
  span = {s.unit: (s.start, s.end) for s in tl.spans}
  # S1's start (at 2.1) forces S0's done (at 4): X0 runs 4..7
  assert span["S1"] == pytest.approx((4.0, 4.1)) and span["X0"] == pytest.approx((4.0, 7.0))
  assert tl.makespan == pytest.approx(7.0)

  split, sched = _split_sched(*_deep(L=9, D=256))
  lk, cm = collectives.get_link("10GbE"), CostModel("H100")
  costs = collectives.BucketCosts.of(cm.spec)
  size = 8 * (256 * 256 + 256) * 4  # 8 of the 9 layers: the last bucket holds one
  both = [
    collectives.build_plan(
      split, sched, 0, size, lk, 8, False, costs=costs, merge_tail=m, in_flight=1
    )
    for m in (True, False)
  ]
  assert len(both[0].buckets) < len(both[1].buckets)
  chosen = collectives.plan(split, sched, cm, 8, lk, bucket_bytes=size, first_k=0, in_flight=1)
  assert chosen.makespan == min(b.makespan for b in both) and chosen.early is None
  # the loss's all-reduce: after the forward (ahead of the first bucket) or after the last
  loss = [
    collectives.build_plan(split, sched, 0, size, lk, 8, False, costs=costs, early=e, in_flight=1)
    for e in (True, False)
  ]
  assert [len(p.link_actions) for p in loss] == [len(loss[0].buckets) + 1] * 2
  assert loss[0].link_actions[0].index == loss[1].link_actions[-1].index == -1
  chosen = collectives.plan(
    split, sched, cm, 8, lk, bucket_bytes=size, first_k=0, loss=True, in_flight=1
  )
  assert chosen.early is not None
  assert chosen.makespan <= min(p.makespan for p in loss)  # merged or not, early or late
