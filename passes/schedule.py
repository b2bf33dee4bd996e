"""schedule: a list scheduler that places dW clusters on a second stream.

Contract: `schedule(split, cost_model, streams=2) -> Schedule`.

Units: `F0` (the forward pass), `X0..Xn` (dX chain segments, cut where a dW
cluster's last input becomes ready) and `W0..Wm` (one per dW cluster). The dX
chain runs on stream 0 in order: it is the critical path. Each dW cluster goes
to stream 1 as soon as its inputs are ready (FIFO), unless the cost model says
it is too small to pay for the cross-stream sync, in which case it stays on
stream 0 right after the segment that feeds it (its in-order place). If the
simulated two-stream schedule is not faster than the in-order one, the
in-order schedule is returned. Linear in the number of equations.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from passes import _compat
from passes.cost import CostModel
from passes.ir import Action, Kind, Schedule, Split, Unit, UnitKind
from passes.simulate import simulate


def build_units(split: Split, cost: CostModel) -> tuple[Unit, ...]:
  """Groups the classified equations into F / X / W units with dependencies."""
  eqns = split.jaxpr.jaxpr.eqns
  producer: dict = {}
  for k, e in enumerate(eqns):
    for v in e.outvars:
      producer[v] = k
  # For each cluster: the last dX equation it reads from.
  ready: list[int] = []
  for c in split.clusters:
    last = -1
    for k in c.eqns:
      for v in eqns[k].invars:
        if isinstance(v, _compat.Var):
          p = producer.get(v, -1)
          if p >= 0 and split.kinds[p] is Kind.DX:
            last = max(last, p)
    ready.append(last)
  cuts = set(ready)
  segments: list[list[int]] = [[]]
  seg_of: dict[int, int] = {}
  for k, kind in enumerate(split.kinds):
    if kind is Kind.DX:
      segments[-1].append(k)
      seg_of[k] = len(segments) - 1
      if k in cuts:
        segments.append([])
  if not segments[-1]:
    segments.pop()

  fwd = [k for k, kind in enumerate(split.kinds) if kind is Kind.FORWARD]
  c = cost.unit_cost([eqns[k] for k in fwd], label="forward")
  units = [Unit(UnitKind.FORWARD, 0, tuple(fwd), (), c.seconds, c.util, "forward")]
  prev = "F0"
  for i, seg in enumerate(segments):
    c = cost.unit_cost([eqns[k] for k in seg], label=f"X{i}")
    units.append(Unit(UnitKind.DX, i, tuple(seg), (prev,), c.seconds, c.util, f"X{i}"))
    prev = f"X{i}"
  for cl, r in zip(split.clusters, ready):
    dep = f"X{seg_of[r]}" if r >= 0 else "F0"
    c = cost.unit_cost([eqns[k] for k in cl.eqns], label=cl.param)
    units.append(Unit(UnitKind.DW, cl.index, cl.eqns, (dep,), c.seconds, c.util, cl.param))
  return tuple(units)


def in_order(units: Sequence[Unit]) -> tuple[tuple[Action, ...], ...]:
  """Everything on stream 0, each dW cluster right after the segment feeding it."""
  after: dict[str, list[Unit]] = {}
  for u in units:
    if u.kind is UnitKind.DW:
      after.setdefault(u.deps[0], []).append(u)
  order: list[Action] = []
  for u in units:
    if u.kind is UnitKind.DW:
      continue
    order.append(Action(u.kind.value, u.index, 0))
    order.extend(Action("W", w.index, 0) for w in after.get(u.name, []))
  return (tuple(order),)


def _assign(units: Sequence[Unit], on_side: set[str]) -> tuple[tuple[Action, ...], ...]:
  main: list[Action] = []
  side: list[Action] = []
  for a in in_order(units)[0]:
    if a.unit in on_side:
      side.append(Action("W", a.index, 1))
    else:
      main.append(a)
  return (tuple(main), tuple(side))


def _syncs(streams, units) -> tuple[tuple[str, str], ...]:
  where = {a.unit: s for s, q in enumerate(streams) for a in q}
  out = []
  for u in units:
    for d in u.deps:
      if d in where and u.name in where and where[d] != where[u.name]:
        out.append((d, u.name))
  return tuple(out)


def schedule(split: Split, cost: CostModel, streams: int = 2) -> Schedule:
  """Builds the schedule; see the module docstring.

  Args:
    split: the output of `passes.split.split`.
    cost: prices units; its `spec` names the device the schedule is for.
    streams: 1 gives the in-order schedule; 2 allows a dW stream.
  """
  if streams not in (1, 2):
    raise ValueError(f"streams must be 1 or 2, got {streams!r}")
  units = build_units(split, cost)
  spec = cost.spec
  base = in_order(units)
  t_base = simulate(base, units, spec.sync).makespan
  best, t_best = base, t_base
  if streams == 2:
    # Overlap pays only when the cluster outlasts the sync it costs.
    side = {u.name for u in units if u.kind is UnitKind.DW and u.cost > spec.sync}
    if side:
      cand = _assign(units, side)
      t = simulate(cand, units, spec.sync).makespan
      if t < t_base:
        best, t_best = cand, t
  best = tuple(s for s in best if s) or ((),)
  return Schedule(best, _syncs(best, units), units, t_best, t_base, spec.name)


def replace_streams(sched: Schedule, streams: Sequence[Sequence[Action]],
                    sync: float = 0.0) -> Schedule:
  """A hand-edited schedule (e.g. parsed from text), re-simulated."""
  streams = tuple(tuple(s) for s in streams)
  names = sorted(a.unit for s in streams for a in s)
  want = sorted(u.name for u in sched.units)
  if names != want:
    raise ValueError(f"schedule must run every unit exactly once; got {names}, "
                     f"expected {want}")
  t = simulate(streams, sched.units, sync).makespan
  return dataclasses.replace(sched, streams=streams, syncs=_syncs(streams, sched.units),
                             makespan=t)
