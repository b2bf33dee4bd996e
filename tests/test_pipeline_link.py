"""The link-true pipeline simulator (passes.pipeline.link) on cases worked by hand, and
`ooo` planned on the link (passes.pipeline.depth): its depth choice across link costs,
and its tables through the executor equal jax.grad."""

import dataclasses

import pytest

import ooojax as ooo
from ooojax.passes.pipeline.depth import pick_measured, plan_ooo, trial_tables
from ooojax.passes.pipeline.generate import generate, unfuse
from ooojax.passes.pipeline.link import LinkModel, simulate_link
from tests.conftest import assert_trees_close
from tests.test_pipeline import _jit, _mesh, _mlp, _reference

COSTS = {"F": 1.0, "B": 0.5, "W": 0.5}  # BW = 1


def test_transfers_queue_on_the_link():
  """GPipe, 2 stages, 4 microbatches, a transfer's wire time 2 (twice a forward):
  the forwards leave at 1, 2, 3, 4 but the link takes them one at a time, so
  they arrive at 3, 5, 7, 9; stage 1 ends its forwards at 10 and its BWs at
  11..14; the input gradients arrive at 13, 15, 17, 19 on the other direction;
  stage 0's last BW ends at 20. A delay-only model (every value 2 late, no
  queue) says 14."""
  g = generate("gpipe", 2, 4)
  slow = LinkModel(latency=0.0, bandwidth=1.0, nbytes=2.0)
  tl = simulate_link(g, COSTS, slow, "overlap")
  assert tl.makespan == 20.0
  assert [(t.start, t.end) for t in tl.transfers if t.kind == "F"] == [
    (1.0, 3.0),
    (3.0, 5.0),
    (5.0, 7.0),
    (7.0, 9.0),
  ]
  assert g.simulate(COSTS, 2.0).makespan == 14.0
  # a free link: the table's own step
  assert simulate_link(g, COSTS, LinkModel(), "overlap").makespan == g.simulate(COSTS).makespan


def test_executor_replay_by_hand():
  """The tick loop: a tick's transfers follow its compute, sender and receiver meet
  (rendezvous), the receiver leaves when the bytes have arrived; a fused BW runs
  as B then W on ticks of their own (what the executor runs), so the input
  gradient leaves after B.
  GPipe 2 x 2, wire 1: s0 F0 ends 1, meets s1 (idle) at 1, s1 has F0's input at 2;
  F1 ends 2 on s0, F0 ends 3 on s1: they meet at 3, s1 has F1 at 4, runs it to 5,
  B0 to 5.5, sends; s0 (waiting since 3) has it at 6.5, B0 to 7, W0 to 7.5;
  s1's W0 (5.5..6) and B1 (6..6.5) meet s0 at 7.5, s0 has the gradient at 8.5
  and ends B1 at 9, W1 at 9.5 (fused, the replay said 10)."""
  tl = simulate_link(
    generate("gpipe", 2, 2), COSTS, LinkModel(bandwidth=1.0, nbytes=1.0), "executor"
  )
  assert tl.makespan == 9.5
  # free transfers, no tick cost: the step of the table the executor runs
  f, u = generate("1f1b", 4, 8), unfuse(generate("1f1b", 4, 8))
  assert simulate_link(f, COSTS, LinkModel(), "executor").makespan == u.simulate(COSTS).makespan
  assert u.simulate(COSTS).makespan < f.simulate(COSTS).makespan  # dX leaves after B
  # every tick costs 0.25 more on every device: 1F1B's 4 x 8 lock-step adds ticks x 0.25
  tick = simulate_link(f, COSTS, LinkModel(tick=0.25), "executor").makespan
  assert tick == pytest.approx(u.simulate(COSTS).makespan + 0.25 * u.ticks)


def test_both_directions_share_a_shaped_loopback():
  """1F1B 2 x 4: at its steady ticks an activation goes up while an input gradient
  comes down. Duplex: each takes its wire time (1); one shared resource (a tbf
  qdisc on lo): both leave together and end together after 2."""
  f = generate("1f1b", 2, 4)
  for duplex, span in ((True, 1.0), (False, 2.0)):
    tl = simulate_link(f, COSTS, LinkModel(bandwidth=1.0, nbytes=1.0, duplex=duplex), "executor")
    starts = {}
    for t in tl.transfers:
      starts.setdefault(t.start, []).append(t)
    together = [ts for ts in starts.values() if len(ts) == 2]
    assert together and all(t.end - t.start == span for ts in together for t in ts)
  assert (
    simulate_link(f, COSTS, LinkModel(bandwidth=1.0, nbytes=1.0, duplex=False), "executor").makespan
    == 17.5
  )


def test_token_bucket_lets_a_burst_through():
  """GPipe 2 x 4, wire 2 per transfer, a tbf bucket of 2 (one transfer) refilling at
  the bandwidth (1): F0 leaves at 1 on a full bucket and arrives at once; F1 at 2
  finds 1 token (refilled for 1 s), so it takes 1; F2 (3) and F3 (queued to 5)
  find none: 2 each. Arrivals 1, 3, 5, 7 (without the bucket 3, 5, 7, 9); the
  gradients (the other direction, its own bucket) 9, 11, 13, 15; step 16."""
  lk = LinkModel(bandwidth=1.0, nbytes=2.0, burst=2.0)
  tl = simulate_link(generate("gpipe", 2, 4), COSTS, lk, "overlap")
  assert [t.end for t in tl.transfers if t.kind == "F"] == [1.0, 3.0, 5.0, 7.0]
  assert [t.end for t in tl.transfers if t.kind == "B"] == [9.0, 11.0, 13.0, 15.0]
  assert tl.makespan == 16.0


def test_one_way_exchange_runs_the_two_directions_in_a_row():
  """The executor's CPU exchange (`execute.one_way`): a tick whose activation goes up
  while a gradient comes down runs two one-way permutes, each paying the
  latency: in the replay the second leaves when the first has arrived."""
  from ooojax.passes.pipeline.link import one_way_groups

  assert one_way_groups([(0, 1), (1, 0)]) == (((0, 1),), ((1, 0),))
  assert one_way_groups([(0, 1), (1, 2), (2, 3), (3, 0)]) == (
    ((0, 1), (2, 3)),
    ((1, 2), (3, 0)),
  )
  f = generate("1f1b", 2, 4)
  both = simulate_link(f, COSTS, LinkModel(latency=0.25), "executor")
  one = simulate_link(f, COSTS, LinkModel(latency=0.25, one_way=True), "executor")
  starts = {}
  for t in both.transfers:
    starts.setdefault(t.start, []).append(t)
  assert any(len(ts) == 2 for ts in starts.values())  # steady ticks: both ways at once
  assert len({t.start for t in one.transfers}) == len(one.transfers)  # never together
  assert one.makespan > both.makespan


@pytest.mark.parametrize("mode", ["overlap", "executor"])
def test_depth_choice_across_link_costs(mode):
  """On every link ooo is at least as fast as GPipe and 1F1B within GPipe's memory;
  on a slow link it keeps more in flight than 1F1B."""
  S, M = 4, 8
  extras = {}
  for wire in (0.0, 0.5, 1.0, 2.0, 4.0):
    lk = LinkModel(bandwidth=1.0, nbytes=wire)
    sched, c = plan_ooo(S, M, COSTS, lk, mode=mode)
    assert c.step <= min(c.gpipe, c.one_f_one_b) * (1 + 1e-9), (wire, c)
    assert max(sched.peak_activations()) <= M and sched.name == "ooo"
    assert c.step == pytest.approx(simulate_link(sched, COSTS, lk, mode).makespan)
    extras[wire] = c.extra if c.form == "ooo" else (M if c.form == "gpipe" else 0)
  assert max(extras[w] for w in (1.0, 2.0, 4.0)) > 0  # deeper than 1F1B's S - s
  # within 1F1B's memory (budget S) it still is never slower than 1F1B
  lk = LinkModel(bandwidth=1.0, nbytes=2.0)
  sched, c = plan_ooo(S, M, COSTS, lk, budget=S, mode=mode)
  assert max(sched.peak_activations()) <= S and c.step <= c.one_f_one_b * (1 + 1e-9)
  with pytest.raises(ValueError, match="budget"):
    plan_ooo(S, M, COSTS, lk, budget=0)


def test_measured_trial_picks_the_fastest():
  """ooo-auto's pieces: the trial's candidates (the planned table, ooo at 1F1B's
  depth, GPipe's, 1F1B's; unique, within the budget, each named "ooo") and the
  pick by measured times (paired by round where the trial alternated), the earlier
  label winning within the tie margin."""
  S, M = 2, 8
  slow = LinkModel(bandwidth=1.0, nbytes=4.0)
  cands = trial_tables(S, M, COSTS, slow)
  labels = [lab for lab, _ in cands]
  texts = [t.to_text() for _, t in cands]
  assert labels[:2] == ["ooo", "planned"] and len(set(texts)) == len(texts)
  assert all(t.name == "ooo" for _, t in cands)
  wanted = [plan_ooo(S, M, COSTS, slow)[0]] + [generate(n, S, M) for n in ("ooo", "gpipe", "1f1b")]
  assert {dataclasses.replace(t, name="ooo").to_text() for t in wanted} == set(texts)
  assert "planned" not in [lab for lab, _ in trial_tables(S, M)]  # no link: no plan
  assert all(max(t.peak_activations()) <= S for _, t in trial_tables(S, M, budget=S))
  times = {"ooo": [7.0, 7.2, 6.9], "planned": [9.0, 9.5, 9.1], "gpipe": [6.0, 6.1, 9.0]}
  assert pick_measured(times) == "gpipe"
  assert pick_measured({**times, "gpipe": [6.85, 6.9, 7.05]}) == "ooo"  # within 3%
  # Rounds pair: the host ran slow in rounds 3-5 for ooo, and turned fast again
  # within round 3 before GPipe ran. The medians (20 vs 10.5) would pick GPipe;
  # round by round GPipe is 5% slower in four of five.
  split = {"ooo": [10.0, 10.0, 20.0, 20.0, 20.0], "gpipe": [10.5, 10.5, 10.5, 21.0, 21.0]}
  assert pick_measured(split) == "ooo"
  assert pick_measured({**split, "gpipe": split["gpipe"][:4]}) == "gpipe"  # no rounds: medians
  with pytest.raises(ValueError, match="at least one time"):
    pick_measured({"ooo": []})
  with pytest.raises(ValueError, match="positive step times"):  # not a ZeroDivisionError
    pick_measured({"ooo": [0.0, 1.0], "gpipe": [1.0, 1.0]})


def test_planned_tables_match_jax_grad():
  """Two depths the planner picks (a free and a slow link) run through the executor
  and equal jax.value_and_grad of the unpipelined model."""
  plan = lambda w: ooo.pipeline.schedule(  # noqa: E731
    "ooo", 2, 4, link=LinkModel(bandwidth=1.0, nbytes=w), costs=COSTS, mode="overlap"
  )
  tables = {max(t.peak_activations()): t for t in (plan(0.0), plan(0.5))}
  assert len(tables) == 2  # two different depths
  stage_fn, loss_fn, params, x, t = _mlp(2)
  ref_loss, ref_grads = _reference(stage_fn, loss_fn, params, x, t)
  for sched in tables.values():
    step = ooo.pipeline.value_and_grad(
      stage_fn, loss_fn, mesh=_mesh(2), axis_name="stage", schedule=sched
    )
    loss, grads = _jit(step)(params, (x, t))
    assert_trees_close(loss, ref_loss)
    assert_trees_close(grads, ref_grads)


def test_explain_shows_the_planned_depth():
  from ooojax.models import mlp_stack

  stage_fn, loss_fn, params, batch = mlp_stack.make(4, layers=4, dim=256, hidden=1024, batch=32)
  r = ooo.pipeline.explain(stage_fn, loss_fn, "ooo", params, batch, microbatches=8, link="10GbE")
  d = r.depth
  assert d is not None and d.step <= min(d.gpipe, d.one_f_one_b) * (1 + 1e-9)
  assert r.schedule.peak_activations() == d.peak and max(d.peak) <= 8
  text = r.summary()
  assert "in-flight depth" in text and "GPipe" in text and "1F1B" in text
  with pytest.raises(ValueError, match="ooo"):
    ooo.pipeline.schedule("gpipe", 2, 4, link=LinkModel())
