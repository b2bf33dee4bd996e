"""slots: at most two side-stream calls in flight, each with dX work in its window.

Contract: `fit(calls, main, eqn_unit, marks, heavy_units, slots=SLOTS) -> calls`.

XLA:GPU (jax >= 0.12) runs a stream-annotated call as an async pair on the
"parallel" execution thread, and its latency-hiding scheduler then places the
pair itself with at most `xla_gpu_experimental_parallel_async_compute_limit`
(default 2) pairs in flight. Where more calls than that overlap, it moves
dones up past their anchors, and those windows lose their dX work. This pass
makes the plan respect the limit by construction, so the scheduler never has
to choose:

1. Light calls (no conv or matmul in their units) cost a slot and hide
   little: each joins a heavy call with the same anchor (the next one issued,
   else the one before), or, in a group with none, the light calls of that
   anchor share one call. A call of several units is issued after the last of
   the units' segments.
2. Call k waits for the done of call k - `slots` (`Call.wait`): its inputs are
   tied to that call's outputs, so its start cannot come before that done.
   The calls then form `slots` chains, one call in flight per chain. Where that
   leaves call k's anchor no later than the awaited call's unit, the call is
   issued after the awaited anchor's unit and re-anchored on the first heavy
   equation of a later unit (none left: no anchor).

The emitter closes each window at its anchor (`passes.stream_calls.Anchor`):
left open, the scheduler stretches a done down to the call that waits for it.
On jax 0.11.2 the pairs are on the caller's thread and nothing moves them; the
same plan holds there (the waits only start a call later). Linear in the
number of calls.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence

from ooojax.passes.ir import Call

# XLA:GPU's default `xla_gpu_experimental_parallel_async_compute_limit`.
SLOTS = 2


def _merge(group: Sequence[Call], pos: Mapping[str, int]) -> Call:
  """One call for `group` (issue order kept), issued after the latest segment."""
  after = max((c.after for c in group), key=lambda a: pos.get(a, -1))
  return dataclasses.replace(group[0], units=tuple(u for c in group for u in c.units), after=after)


def fold_light(
  calls: Sequence[Call], heavy: Sequence[bool], pos: Mapping[str, int]
) -> tuple[Call, ...]:
  """Step 1: every light call joins a heavy call of its anchor (see the module doc)."""
  out: list[Call] = []
  i = 0
  while i < len(calls):
    j = i
    while j < len(calls) and calls[j].anchor == calls[i].anchor:
      j += 1
    group, hv = calls[i:j], heavy[i:j]
    if calls[i].anchor < 0:  # unanchored calls are left as planned
      out.extend(group)
    elif not any(hv):
      out.append(_merge(group, pos))
    else:
      members: list[list[Call]] = [[c] for c, h in zip(group, hv) if h]
      owner = [sum(hv[: m + 1]) - 1 for m in range(len(group))]  # heavy calls up to m, 0-based
      for m, (c, h) in enumerate(zip(group, hv)):
        if h:
          continue
        nxt = owner[m] + 1  # the next heavy call issued, else the one before
        tgt = members[nxt] if nxt < len(members) else members[owner[m]]
        tgt.append(c)
      for mem in members:
        mem.sort(key=group.index)
        out.append(_merge(mem, pos))
    i = j
  return tuple(out)


def fit(
  calls: Sequence[Call],
  main: Sequence[str],
  eqn_unit: Mapping[int, int],
  marks: Sequence[tuple[int, int]],
  heavy_units: set[str],
  slots: int = SLOTS,
) -> tuple[Call, ...]:
  """The calls fitted to `slots` in flight (see the module docstring).

  Args:
    calls: planned calls in issue order (`passes.schedule.plan_calls`).
    main: stream-0 unit names in order.
    eqn_unit: stream-0 equation index -> position of its unit in `main`.
    marks: (unit position, equation) of every anchorable stream-0 equation, in order.
    heavy_units: side units holding a conv or matmul.
    slots: calls allowed in flight.
  """
  if not calls or slots < 1:
    return tuple(calls)
  pos = {n: i for i, n in enumerate(main)}
  heavy = [any(u in heavy_units for u in c.units) for c in calls]
  folded = fold_light(calls, heavy, pos)
  mark_pos = [p for p, _ in marks]
  out: list[Call] = []
  for k, c in enumerate(folded):
    if k < slots:
      out.append(c)
      continue
    w = out[k - slots]
    if w.anchor < 0 or w.anchor not in eqn_unit:  # its done is the end: nothing to chain on
      out.append(c)
      continue
    wpos = eqn_unit[w.anchor]
    after = c.after if pos.get(c.after, -1) >= wpos else main[wpos]
    anchor = c.anchor
    if anchor < 0 or eqn_unit.get(anchor, -1) <= pos[after]:
      j = bisect.bisect_right(mark_pos, pos[after])
      anchor = marks[j][1] if j < len(marks) else -1
    out.append(dataclasses.replace(c, after=after, anchor=anchor, wait=w.units))
  return tuple(out)
