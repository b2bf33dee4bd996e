"""schedule: a list scheduler that places dW clusters on a second stream.

Contract: `schedule(split, cost_model, streams=2) -> Schedule`.

Units: `F0` (the forward pass), `X0..Xn` (dX chain segments, cut where a dW
cluster's last input becomes ready) and `W0..Wm` (one per dW cluster). The dX
chain is the critical path (every segment's bottom level is the rest of the
chain), so it runs on stream 0 in order. dW clusters are taken in the order
they become ready; each goes to stream 1 when (a) it outlasts the sync it
costs, (b) heavy dX work (a conv or matmul) is still to come on stream 0 to
hide it, and (c) stream 1's backlog would let at least half of it finish
before the dX chain does. Otherwise it stays on stream 0 right after the
segment that feeds it (its in-order place); the first layer's dW, with no dX
work left after it, is the usual case.

Side units issued after the same segment form one asynchronous `Call` (one
sync pays for a conv's dW and its bias's). Each call's window is chosen from
the simulated timeline: its done is tied to the first heavy stream-0 equation
expected to end after the call does, so XLA keeps that much dX work between
the call's start and done. The calls are then fitted to the two that XLA:GPU
keeps in flight (`passes.slots`: light calls folded into heavy ones, call k
started after call k-2's done). If the simulated two-stream schedule is not faster
than the in-order one, the in-order schedule is returned. Linear in the
number of equations, plus two simulations.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from ooojax.passes import _compat, slots, stream_cost
from ooojax.passes.cost import MATMUL_PRIMS, CostModel, estimate
from ooojax.passes.ir import Action, Call, Kind, Schedule, Split, Unit, UnitKind
from ooojax.passes.simulate import Timeline, simulate


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


def _eqn_seconds(cost: CostModel, eqn, c=None) -> float:
  c = estimate(eqn) if c is None else c
  dtype = getattr(eqn.outvars[0].aval, "dtype", None) if eqn.outvars else None
  t = cost.eqn_seconds(c, eqn.primitive.name in MATMUL_PRIMS, dtype)
  return t + (cost.spec.launch if c.kernel else 0.0)


def is_heavy(eqn) -> bool:
  """A conv or matmul: the kernels worth overlapping, and worth hiding behind."""
  return eqn.primitive.name in MATMUL_PRIMS


# An anchor must surely stay a kernel of its own: XLA rewrites small matmuls
# (split-K into a batched dot plus a reduction, fused into a neighbour), and a
# barrier on a value that no longer exists is dropped with its window.
ANCHOR_MIN_FLOPS = 2.0**23
ANCHOR_MIN_ELEMS = 2**14


def _anchorable(eqn, c=None) -> bool:
  c = estimate(eqn) if c is None else c
  return is_heavy(eqn) and c.flops >= ANCHOR_MIN_FLOPS and c.out_elems >= ANCHOR_MIN_ELEMS


def _heavy_fractions(split: Split, cost: CostModel, units) -> dict[str, list[tuple[float, int]]]:
  """Per dX unit: (fraction of the unit done when the eqn ends, eqn) for its anchorable eqns."""
  eqns = split.jaxpr.jaxpr.eqns
  out: dict[str, list[tuple[float, int]]] = {}
  for u in units:
    if u.kind is not UnitKind.DX:
      continue
    costs = [estimate(eqns[k]) for k in u.eqns]  # once per equation: read twice
    times = [_eqn_seconds(cost, eqns[k], c) for k, c in zip(u.eqns, costs)]
    total = sum(times) or 1.0
    acc, rows = 0.0, []
    for k, t, c in zip(u.eqns, times, costs):
      acc += t
      if _anchorable(eqns[k], c):
        rows.append((acc / total, k))
    out[u.name] = rows
  return out


# Why XLA:GPU runs a dW cluster best on stream 0 (measured on ResNet-50, batch 32,
# compile-only H100: admitting them cost 196 kernels and 6.5% more bytes written
# beside jax.grad's; see benchmarks/RESULTS.md, "Kernel parity").
LIGHT = "light (no conv/matmul): XLA fuses it into the dX chain's kernels; a side call re-reads"
PADDED = (
  "its conv pads its input asymmetrically: jax.grad shares that pad kernel with the "
  "forward conv, a side call pads again"
)


def stays_on_main(eqns, unit: Unit) -> str | None:
  """Why a dW unit stays on stream 0 of a GPU plan (`LIGHT`, `PADDED`), or None."""
  heavy = [eqns[k] for k in unit.eqns if is_heavy(eqns[k])]
  if not heavy:
    return LIGHT
  for e in heavy:
    if e.primitive.name == "conv_general_dilated" and _compat.conv_asymmetric_padding(e):
      return PADDED
  return None


def _admit(units: Sequence[Unit], heavy: dict, sync: float) -> set[str]:
  """Greedy side-stream admission in ready order; see the module docstring."""
  main = [u for u in units if u.kind in (UnitKind.FORWARD, UnitKind.DX)]
  ends, t = [], 0.0
  for u in main:
    t += u.cost
    ends.append(t)
  main_end = t
  # time at which the last heavy eqn of the main stream ends (on an unloaded stream)
  last_heavy = 0.0
  for u, e in zip(main, ends):
    if heavy.get(u.name):
      last_heavy = e - u.cost * (1.0 - heavy[u.name][-1][0])
  after: dict[str, list[Unit]] = {}
  for u in units:
    if u.kind is UnitKind.DW:
      after.setdefault(u.deps[0], []).append(u)
  side: set[str] = set()
  t_side = 0.0
  for u, issue in zip(main, ends):
    if issue >= last_heavy:
      break  # no heavy dX work left to hide anything behind
    end = max(t_side, issue + sync)
    for w in after.get(u.name, ()):
      if w.cost <= sync or end + w.cost - main_end > w.cost / 2:
        continue
      side.add(w.name)
      end += w.cost
    t_side = max(t_side, end)
  return side


def plan_calls(
  streams,
  units: Sequence[Unit],
  timeline: Timeline | None = None,
  heavy: dict | None = None,
  heavy_side: set[str] | None = None,
  eqn_unit: dict[int, int] | None = None,
  main_heavy: dict | None = None,
) -> tuple[Call, ...]:
  """Groups side-stream actions into calls and picks each call's anchor.

  Side units issued after the same stream-0 unit share a call. With a
  `timeline` and the `heavy` equations of each dX unit, the anchor is the
  first heavy stream-0 equation expected to end after the call does (else
  the last heavy one after its issue point); without them, no anchor. With
  `heavy_side` (the side units holding a conv or matmul) and `eqn_unit`
  (stream-0 equation -> position of its unit), the calls are then fitted to
  the two XLA:GPU keeps in flight (`passes.slots.fit`).
  """
  if len(streams) < 2:
    return ()
  by = {u.name: u for u in units}
  main = [a.unit for a in streams[0]]
  spans = {s.unit: s for s in timeline.spans} if timeline is not None else {}
  # heavy stream-0 equations as (expected end, eqn), in stream order
  marks: list[tuple[float, int]] = []
  pos: dict[str, int] = {}
  for name in main:
    pos[name] = len(marks)
    sp = spans.get(name)
    for frac, k in (heavy or {}).get(name, ()):
      marks.append(((sp.start + frac * (sp.end - sp.start)) if sp else 0.0, k))
  calls: list[Call] = []
  for s_idx, stream in enumerate(streams[1:], 1):
    group: list[str] = []
    for i, a in enumerate(stream):
      group.append(a.unit)
      nxt = stream[i + 1].unit if i + 1 < len(stream) else None
      after = by[a.unit].deps[0]
      if nxt is not None and by[nxt].deps[0] == after:
        continue
      anchor = -1
      first = pos.get(after, len(marks))
      # marks of `after` itself end before the call starts
      first += len((heavy or {}).get(after, ()))
      cands = marks[first:]
      if cands and spans:
        end = max(spans[g].end for g in group if g in spans)
        j = bisect.bisect_left([m[0] for m in cands], end)
        anchor = cands[min(j, len(cands) - 1)][1]
      calls.append(Call(tuple(group), s_idx, after, anchor))
      group = []
  if heavy_side is not None and eqn_unit is not None and spans:
    every = {**(main_heavy or {}), **(heavy or {})}
    marks_at = [(pos_of, k) for pos_of, name in enumerate(main) for _, k in every.get(name, ())]
    calls = list(slots.fit(calls, main, eqn_unit, marks_at, heavy_side))
  return tuple(calls)


def _plan(split: Split, units, side: set[str], heavy: dict, sync: float):
  """(streams, timeline, calls) with `side` on stream 1."""
  cand = _assign(units, side)
  tl = simulate(cand, units, sync)
  eqns = split.jaxpr.jaxpr.eqns
  heavy_side = {
    u.name for u in units if u.kind is UnitKind.DW and any(is_heavy(eqns[k]) for k in u.eqns)
  }
  main = [a.unit for a in cand[0]]
  by = {u.name: u for u in units}
  eqn_unit = {k: i for i, n in enumerate(main) for k in by[n].eqns}
  # a conv's or matmul's filter gradient stays a kernel of its own however
  # small its output (the first layer's), so ANCHOR_MIN_ELEMS does not apply
  main_heavy = {
    n: [
      (1.0, k)
      for k in by[n].eqns
      if is_heavy(eqns[k]) and estimate(eqns[k]).flops >= ANCHOR_MIN_FLOPS
    ]
    for n in main
    if by[n].kind is UnitKind.DW
  }
  return cand, tl, plan_calls(cand, units, tl, heavy, heavy_side, eqn_unit, main_heavy)


def schedule(split: Split, cost: CostModel, streams: int = 2, min_speedup: float = 1.0) -> Schedule:
  """Builds the schedule; see the module docstring.

  Args:
    split: the output of `passes.split.split`.
    cost: prices units; its `spec` names the device the schedule is for. A
      calibrated spec (`DeviceSpec.pinned_call`, `passes.calibration`) keeps only
      the calls that pay for themselves (`passes.stream_cost`).
    streams: 1 gives the in-order schedule; 2 allows a dW stream.
    min_speedup: the predicted speedup over in-order a two-stream plan must reach
      (1.03 for `mode="auto"`), else the in-order schedule is returned.
  """
  if streams not in (1, 2):
    raise ValueError(f"streams must be 1 or 2, got {streams!r}")
  units = build_units(split, cost)
  spec = cost.spec
  base = in_order(units)
  t_base = simulate(base, units, spec.sync).makespan
  best, t_best, calls, kept = base, t_base, (), ()
  priced = spec.pinned_call is not None
  if streams == 2:
    heavy = _heavy_fractions(split, cost, units)
    side = _admit(units, heavy, spec.sync)
    if spec.name.upper() != "CPU":  # kernel parity with jax.grad on XLA:GPU
      eqns = split.jaxpr.jaxpr.eqns
      why = {u.name: stays_on_main(eqns, u) for u in units if u.name in side}
      kept = tuple((n, r) for n, r in why.items() if r is not None)
      side -= {n for n, _ in kept}
    if side:
      cand, tl, calls = _plan(split, units, side, heavy, spec.sync)
      t_cand = tl.makespan
      if priced and calls:
        pr = stream_cost.price(calls, [a.unit for a in cand[0]], units, spec.pinned_call)
        kept += pr.kept
        if pr.keep != side:
          side = set(pr.keep)
          cand, tl, calls = (
            _plan(split, units, side, heavy, spec.sync) if side else (base, None, ())
          )
          t_cand = tl.makespan if tl is not None else t_base
        t_cand += len(calls) * spec.pinned_call
      if calls and t_cand < t_base and t_base / t_cand >= min_speedup:
        best, t_best = cand, t_cand
      else:
        if calls and priced:
          need = max(min_speedup, 1.0)
          kept += tuple((n, stream_cost.below(t_base / t_cand, need)) for n in sorted(side))
        calls = ()
  best = tuple(s for s in best if s) or ((),)
  if priced and streams == 2:
    main = [a.unit for a in base[0] if a.unit.startswith(("F", "X"))]
    on_side = {a.unit for a in best[1]} if len(best) > 1 else set()
    known = on_side | {n for n, _ in kept}
    eqns = split.jaxpr.jaxpr.eqns
    for u in units:
      if u.kind is UnitKind.DW and u.name not in known and (r := stays_on_main(eqns, u)):
        kept += ((u.name, r),)
    kept += stream_cost.why_main(units, main, on_side, kept, spec.pinned_call)
  kept = kept if calls or priced else ()
  return Schedule(best, _syncs(best, units), units, t_best, t_base, spec.name, calls, kept)


def replace_streams(
  sched: Schedule, streams: Sequence[Sequence[Action]], sync: float = 0.0
) -> Schedule:
  """A hand-edited schedule (e.g. parsed from text), re-simulated.

  Its calls group side units by issue point, with no anchors (the hand edit
  decides the order; XLA decides the windows).
  """
  streams = tuple(tuple(s) for s in streams)
  names = sorted(a.unit for s in streams for a in s)
  want = sorted(u.name for u in sched.units)
  if names != want:
    raise ValueError(f"schedule must run every unit exactly once; got {names}, expected {want}")
  t = simulate(streams, sched.units, sync).makespan
  return dataclasses.replace(
    sched,
    streams=streams,
    syncs=_syncs(streams, sched.units),
    makespan=t,
    calls=plan_calls(streams, sched.units),
  )
