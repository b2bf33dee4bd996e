"""ooojax.passes.slots: the call plan never asks XLA:GPU for more than two calls in flight.

Pure plan checks (no compile): the compiled proof is tests/test_overlap.py on
the compile-only H100, on jax 0.11.2 and on the newest jax.
"""

from ooojax.passes import slots
from ooojax.passes.ir import Call

MAIN = [f"X{i}" for i in range(8)]
# anchorable stream-0 equations: (position of their unit in MAIN, equation)
MARKS = [(2, 20), (4, 40), (6, 60), (7, 70)]
EQN_UNIT = {k: p for p, k in MARKS}


def _c(units, after, anchor):
  return Call(tuple(units.split()), 1, after, anchor)


def _in_flight(calls):
  """Most calls in flight at once when call k starts after its wait's anchor
  and ends at its own (unit positions, as the emitted ties order them)."""
  pos = {n: i for i, n in enumerate(MAIN)}
  by = {c.units: c for c in calls}
  spans = []
  for c in calls:
    start = pos[c.after]
    if c.wait:
      start = max(start, EQN_UNIT[by[c.wait].anchor])
    spans.append((start, EQN_UNIT.get(c.anchor, len(MAIN))))
  return max(sum(s <= t < e for s, e in spans) for t in range(len(MAIN)))


def test_light_calls_join_a_heavy_call_of_their_anchor():
  calls = [_c("W0", "X0", 20), _c("W1", "X0", 20), _c("W2", "X1", 20)]
  out = slots.fit(calls, MAIN, EQN_UNIT, MARKS, heavy_units={"W1"})
  # W0 (light) joins the next heavy call issued, W2 (light, last) the one before:
  # one call, issued once all three units' inputs exist
  assert [(c.units, c.after, c.anchor) for c in out] == [(("W0", "W1", "W2"), "X1", 20)]


def test_light_calls_with_no_heavy_call_share_one():
  calls = [_c("W0", "X0", 20), _c("W1", "X1", 20), _c("W2", "X1", 40)]
  out = slots.fit(calls, MAIN, EQN_UNIT, MARKS, heavy_units={"W2"})
  assert [(c.units, c.after, c.anchor) for c in out] == [
    (("W0", "W1"), "X1", 20),
    (("W2",), "X1", 40),
  ]


def test_third_call_waits_for_the_first_and_is_reanchored_after_it():
  # three heavy calls on one anchor: XLA:GPU keeps two in flight
  calls = [_c("W0", "X0", 20), _c("W1", "X0", 20), _c("W2", "X1", 20), _c("W3", "X3", 40)]
  out = slots.fit(calls, MAIN, EQN_UNIT, MARKS, heavy_units={"W0", "W1", "W2", "W3"})
  assert [c.wait for c in out] == [(), (), ("W0",), ("W1",)]
  # W2 starts once W0 is done (at X2's equation 20): issued after X2, closes on X4's
  assert (out[2].after, out[2].anchor) == ("X2", 40)
  # W3 already waited past X2 and its anchor is later: unchanged
  assert (out[3].after, out[3].anchor) == ("X3", 40)
  assert _in_flight(out) <= slots.SLOTS
  # every call still has main-stream heavy work inside its window
  pos = {n: i for i, n in enumerate(MAIN)}
  assert all(EQN_UNIT[c.anchor] > pos[c.after] for c in out)


def test_no_mark_left_means_no_anchor():
  calls = [_c("W0", "X5", 70), _c("W1", "X6", 70), _c("W2", "X6", 70)]
  out = slots.fit(calls, MAIN, EQN_UNIT, MARKS, heavy_units={"W0", "W1", "W2"})
  assert (out[2].wait, out[2].after, out[2].anchor) == (("W0",), "X7", -1)


def test_slots_limit_is_respected_on_a_long_chain():
  calls = [_c(f"W{i}", MAIN[i // 3], MARKS[min(i // 3, 3)][1]) for i in range(12)]
  heavy = {f"W{i}" for i in range(0, 12, 2)}
  out = slots.fit(calls, MAIN, EQN_UNIT, MARKS, heavy)
  assert sorted(u for c in out for u in c.units) == sorted(u for c in calls for u in c.units)
  assert _in_flight(out) <= slots.SLOTS
  assert all(any(u in heavy for u in c.units) for c in out)  # light ones folded in
