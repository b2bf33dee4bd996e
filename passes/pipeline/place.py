"""pipeline.place: per-stage orders placed on ticks, and the transfers lowered.

Contract: `_place(S, M, v, orders, lag, placement, extra=None)` puts each
stage's actions at the first tick their dependencies allow (a grid of lists),
`_lower_comms(S, v, grid, lag, placement)` adds the send / receive pairs,
`shared_dep(last)` is `tile(shared=True)`'s extra dependency. Shared by
`generate` (one step) and `steps` (a table tiled over steps); it reads only
`actions`, so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Sequence

from ooojax.passes.pipeline.actions import (
  UPDATE,
  Action,
  ScheduleError,
  deps,
  place_of,
  vstage_of,
)


def shared_dep(last: int):
  """`_place`'s extra dependency of `tile(shared=True)`: the first virtual stage's
  forwards of step t wait for the last virtual stage's update of step t - 1."""

  def extra(a, vs):
    return [(UPDATE, last, 0, a.step - 1)] if a.kind == "F" and vs == 0 and a.step else []

  return extra


def _place(
  S: int,
  M: int,
  v: int,
  orders: Sequence[Sequence[Action]],
  lag: int = 0,
  placement: str = "modulo",
  extra=None,
) -> list[list[list[Action]]]:
  """As-soon-as-possible unit-tick placement of per-stage orders (with `U`
  updates, placed in the cell of the W they follow). `extra(action, vstage)`:
  further (kind, vstage, microbatch, step) an action waits for."""
  V = S * v
  done: dict[tuple[str, int, int, int], int] = {}
  pos = [0] * S
  grid: list[list[list[Action]]] = [[] for _ in range(S)]

  def ready(a, t, same_tick):
    vs = vstage_of(S, a.stage, a.chunk, placement)
    for key in deps(a, vs, V - 1, M) + (extra(a, vs) if extra else []):
      tp = done.get(key)
      if tp is None:
        return False
      tp += lag if place_of(S, key[1], placement)[0] != a.stage else 0
      if tp > t or (tp == t and not same_tick):
        return False
    return True

  def mark(a, t):
    grid[a.stage][t].append(a)
    pos[a.stage] += 1
    vs = vstage_of(S, a.stage, a.chunk, placement)
    if a.kind == UPDATE:
      done[(UPDATE, vs, 0, a.step)] = t
      return
    done[("B" if a.kind == "BW" else a.kind, vs, a.microbatch, a.step)] = t
    if a.kind == "BW":
      done[("W", vs, a.microbatch, a.step)] = t

  t = idle = 0
  while any(pos[s] < len(orders[s]) for s in range(S)):
    placed = [
      orders[s][pos[s]]
      for s in range(S)
      if pos[s] < len(orders[s])
      and orders[s][pos[s]].kind != UPDATE
      and ready(orders[s][pos[s]], t, False)
    ]
    for s in range(S):
      grid[s].append([])
    for a in placed:
      mark(a, t)
    for s in range(S):  # an update joins the cell of its last W
      while (
        pos[s] < len(orders[s])
        and orders[s][pos[s]].kind == UPDATE
        and ready(orders[s][pos[s]], t, True)
      ):
        placed.append(orders[s][pos[s]])
        mark(orders[s][pos[s]], t)
    idle = 0 if placed else idle + 1
    if idle > lag + 1:  # nothing placed and nothing still in transit
      raise ScheduleError(f"per-stage orders deadlock at tick {t}")
    t += 1
  return grid


def _lower_comms(
  S: int, v: int, grid, lag: int = 0, placement: str = "modulo"
) -> tuple[tuple[tuple[Action, ...], ...], ...]:
  """Adds the send/receive pair of every value crossing devices, at its producer's tick."""
  V = S * v
  out = [[list(cell) for cell in row] for row in grid]
  for s, row in enumerate(grid):
    for t, cell in enumerate(row):
      for a in cell:
        vs = vstage_of(S, s, a.chunk, placement)
        if a.kind == "F" and vs < V - 1:
          tvs = vs + 1
          ch = "F"
        elif a.kind in ("B", "BW") and vs > 0:
          tvs = vs - 1
          ch = "B"
        else:
          continue
        ds, dc = place_of(S, tvs, placement)
        if ds == s:  # same device (one-stage interleaving): no transfer
          continue
        out[s][t].append(Action(s, "S" + ch, a.microbatch, a.chunk, a.step))
        out[ds][t + lag].append(Action(ds, "R" + ch, a.microbatch, dc, a.step))
  return tuple(tuple(tuple(cell) for cell in row) for row in out)
