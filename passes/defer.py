"""defer: leave chosen dW clusters of one step to the next (single GPU).

Contract: `defer(split, schedule, leaves) -> Deferral`, and
`choose(split, schedule, cost) -> tuple[int, ...]` (which gradient leaves to
defer, by the cost model).

A deferred cluster is not computed in the step that traces it: the step
returns the values the cluster reads instead (`Deferral.carried`: typically a
layer's input activation and its output cotangent), and the next step runs
the cluster (`Deferral.late`, a jaxpr `carried -> grads`) beside its forward.
The optimizer update of a deferred parameter needs that gradient, so the next
step binds the parameter late: after `Deferral.anchor`, the last sizeable
forward conv / matmul before the parameter's first forward use
(`passes.stream_calls.LateLeaves`). Everything else of the step (forward, dX chain,
the other dW clusters and their schedule) is unchanged.

`choose` simulates the steady state (`steady_state`): step t+1 runs the
deferred clusters on stream 1 from its start while the forward runs up to the
first use of a deferred parameter, which then waits for them. Clusters are
tried one by one, latest first use first, and kept when the simulated step
gets faster. The first layers' dW, which end the backward with no dX work to
hide behind, have nothing in front of them in the next forward either: a
cluster pays only when its parameter is used late enough in the forward.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

from ooojax.passes import _compat
from ooojax.passes.cost import CostModel
from ooojax.passes.ir import Action, Kind, Schedule, Split, Unit, UnitKind
from ooojax.passes.schedule import _anchorable, _eqn_seconds, is_heavy
from ooojax.passes.simulate import simulate
from ooojax.passes.stream_calls import free_inputs


@dataclasses.dataclass(frozen=True)
class Deferral:
  """A step with some dW clusters left to the next step.

  split: the step's program: the deferred clusters' equations are DEAD, the
    outputs are `(value, *aux, *kept grads, *carried)`.
  schedule: the step's schedule without the deferred units.
  leaves: deferred gradient leaves (positions among the gradients), in order.
  kept: the other gradient leaves, in order.
  carried: avals of the values the next step needs (`late`'s inputs).
  late: a jaxpr `(*carried) -> (*grads of leaves)`: the deferred clusters.
  anchor: forward equation after which the next step binds the deferred
    parameters (-1: before the forward).
  first_use: the first forward equation reading a deferred parameter
    (len(eqns) when none does).
  """

  split: Split
  schedule: Schedule
  leaves: tuple[int, ...]
  kept: tuple[int, ...]
  carried: tuple[Any, ...]
  late: Any
  anchor: int
  first_use: int


def _param_var(split: Split, leaf: int):
  """The jaxpr input of gradient leaf `leaf`'s parameter (argnums=0: params lead the leaves)."""
  return split.jaxpr.jaxpr.invars[1 + len(split.consts) + leaf]


def first_uses(split: Split) -> dict[int, int]:
  """Gradient leaf -> index of the first forward equation reading its parameter."""
  jaxpr = split.jaxpr.jaxpr
  n = len(jaxpr.outvars) - split.grad_out_start
  want = {_param_var(split, i): i for i in range(n)}
  out: dict[int, int] = {}
  for k, (e, kind) in enumerate(zip(jaxpr.eqns, split.kinds)):
    if kind is not Kind.FORWARD:
      continue
    for v in e.invars:
      i = want.get(v) if isinstance(v, _compat.Var) else None
      if i is not None and i not in out:
        out[i] = k
  return out


def deferrable(split: Split) -> dict[int, int]:
  """Gradient leaf -> cluster index, for the clusters that can be deferred.

  A cluster holding a loop or another higher-order equation (a scan's
  W-scan) stays in its step: the skewed scan fuses it with its B-scan.
  """
  eqns = split.jaxpr.jaxpr.eqns
  out = {}
  for c in split.clusters:
    if any(any(True for _ in _compat.subjaxprs(eqns[k])) for k in c.eqns):
      continue
    out[c.grad_out - split.grad_out_start] = c.index
  return out


def _anchor_before(split: Split, first: int) -> int:
  """The last sizeable forward conv / matmul before `first` (else the last of any size)."""
  eqns = split.jaxpr.jaxpr.eqns
  fallback = -1
  for k in range(min(first, len(eqns)) - 1, -1, -1):
    if split.kinds[k] is not Kind.FORWARD or not is_heavy(eqns[k]):
      continue
    if _anchorable(eqns[k]):
      return k
    if (
      fallback < 0
      and len(eqns[k].outvars) == 1
      and not isinstance(eqns[k].outvars[0], _compat.DropVar)
    ):
      fallback = k
  return fallback


def defer(split: Split, sched: Schedule, leaves: Collection[int]) -> Deferral:
  """The step's program and schedule with the clusters of `leaves` left to the next step.

  Args:
    split: from `passes.split` (its parameters are the first dynamic leaves).
    sched: its schedule.
    leaves: gradient leaves to defer; each must be in `deferrable(split)`.

  Returns:
    A `Deferral`.
  """
  can = deferrable(split)
  leaves = tuple(sorted(set(leaves)))
  bad = [i for i in leaves if i not in can]
  if bad:
    names = {c.grad_out - split.grad_out_start: c.param for c in split.clusters}
    raise ValueError(
      f"gradient leaves {[names.get(i, i) for i in bad]} have no deferrable "
      "dW cluster (their gradient is part of the dX chain, or a loop)"
    )
  jaxpr = split.jaxpr.jaxpr
  eqns = jaxpr.eqns
  cl = {can[i]: i for i in leaves}
  ids = sorted(k for c in split.clusters if c.index in cl for k in c.eqns)
  # the late jaxpr: the deferred clusters' equations, their free inputs carried
  ins, _ = free_inputs(eqns, ids)
  start = split.grad_out_start
  n_grads = len(jaxpr.outvars) - start
  outs = [jaxpr.outvars[start + i] for i in leaves]
  late = _compat.open_jaxpr(
    [], ins, outs, [eqns[k] for k in ids], _compat.NO_EFFECTS, _compat.call_debug_info()
  )
  kept = tuple(i for i in range(n_grads) if i not in set(leaves))
  new_outs = [*jaxpr.outvars[:start], *(jaxpr.outvars[start + i] for i in kept), *ins]
  pos = {i: start + j for j, i in enumerate(kept)}
  dead = set(ids)
  kinds = tuple(Kind.DEAD if k in dead else kind for k, kind in enumerate(split.kinds))
  cluster_of = tuple(-1 if c in cl else c for c in split.cluster_of)
  clusters = tuple(
    dataclasses.replace(c, grad_out=pos[c.grad_out - start])
    for c in split.clusters
    if c.index not in cl
  )
  step = dataclasses.replace(
    split,
    jaxpr=_compat.closed(jaxpr.replace(outvars=new_outs)),
    kinds=kinds,
    cluster_of=cluster_of,
    clusters=clusters,
  )
  gone = {f"W{c}" for c in cl}
  uses = first_uses(split)
  first = min((uses.get(i, len(eqns)) for i in leaves), default=len(eqns))
  return Deferral(
    step,
    _without(sched, gone),
    leaves,
    kept,
    tuple(_compat.shape_dtype(v.aval) for v in ins),
    late,
    _anchor_before(split, first) if leaves else -1,
    first,
  )


def _without(sched: Schedule, gone: set[str]) -> Schedule:
  if not gone:
    return sched
  streams = tuple(tuple(a for a in s if a.unit not in gone) for s in sched.streams)
  calls = []
  for c in sched.calls:
    units = tuple(u for u in c.units if u not in gone)
    if units:
      calls.append(dataclasses.replace(c, units=units))
  syncs = tuple(p for p in sched.syncs if p[0] not in gone and p[1] not in gone)
  return dataclasses.replace(sched, streams=streams, syncs=syncs, calls=tuple(calls))


# --- the steady state, simulated -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SteadyState:
  """One steady-state step with `leaves` deferred (cost-model estimates, seconds).

  `streams` / `units`: the step as the simulator ran it: `F0` the forward up to
  the first use of a deferred parameter, `F1` the rest (after the deferred
  clusters and a sync), the deferred `W` units first on stream 1.
  """

  leaves: tuple[int, ...]
  makespan: float
  streams: tuple[tuple[Action, ...], ...]
  units: tuple[Unit, ...]


class _Steady:
  """Prices deferral sets against one split and schedule (shared per-equation costs)."""

  def __init__(self, split: Split, sched: Schedule, cost: CostModel):
    self.split, self.sched, self.sync = split, sched, cost.spec.sync
    eqns = split.jaxpr.jaxpr.eqns
    self.fwd = [k for k, kind in enumerate(split.kinds) if kind is Kind.FORWARD]
    secs = [_eqn_seconds(cost, eqns[k]) for k in self.fwd]
    self.prefix = [0.0]
    for s in secs:
      self.prefix.append(self.prefix[-1] + s)
    self.uses = first_uses(split)
    self.by = {u.name: u for u in sched.units}
    self.w_of = {c.grad_out - split.grad_out_start: f"W{c.index}" for c in split.clusters}

  def run(self, leaves: Sequence[int]) -> SteadyState:
    n = len(self.split.jaxpr.jaxpr.eqns)
    first = min((self.uses.get(i, n) for i in leaves), default=n)
    f0 = self.by["F0"]
    cut = bisect.bisect_left(self.fwd, first)
    total = self.prefix[-1] or 1.0
    frac = self.prefix[cut] / total
    d = tuple(self.w_of[i] for i in leaves)
    units = []
    for u in self.sched.units:
      if u.name == "F0":
        units.append(dataclasses.replace(u, cost=f0.cost * frac))
        units.append(
          Unit(
            UnitKind.FORWARD,
            1,
            (),
            ("F0", *d),
            f0.cost * (1 - frac),
            f0.util,
            "forward after the deferred parameters' update",
          )
        )
      elif u.name in d:
        units.append(dataclasses.replace(u, deps=()))
      elif u.deps == ("F0",):
        units.append(dataclasses.replace(u, deps=("F1",)))
      else:
        units.append(u)
    main = []
    for a in self.sched.streams[0]:
      if a.unit in d:
        continue
      main.append(a)
      if a.unit == "F0":
        main.append(Action("F", 1, 0))
    side = [Action("W", int(w[1:]), 1) for w in d]
    for s in self.sched.streams[1:]:
      side += [a for a in s if a.unit not in d]
    streams = (tuple(main), tuple(side))
    t = simulate(streams, units, self.sync).makespan
    return SteadyState(tuple(leaves), t, streams, tuple(units))


def steady_state(
  split: Split, sched: Schedule, cost: CostModel, leaves: Sequence[int] = ()
) -> SteadyState:
  """Simulates one steady-state step with the clusters of `leaves` deferred."""
  return _Steady(split, sched, cost).run(tuple(sorted(leaves)))


def choose(
  split: Split, sched: Schedule, cost: CostModel, *, min_gain: float = 1e-3
) -> tuple[int, ...]:
  """Gradient leaves to defer, by the cost model (see the module docstring).

  A cluster is kept when it shortens the simulated steady-state step by more
  than `min_gain` (relative).
  """
  st = _Steady(split, sched, cost)
  can = deferrable(split)
  n = len(split.jaxpr.jaxpr.eqns)
  order = sorted(can, key=lambda i: (-st.uses.get(i, n), i))
  chosen: list[int] = []
  best = st.run(()).makespan
  for i in order:
    if sched.unit(f"W{can[i]}").cost <= cost.spec.sync:
      continue
    t = st.run(sorted([*chosen, i])).makespan
    if t < best * (1 - min_gain):
      chosen.append(i)
      best = t
  return tuple(sorted(chosen))
