"""pipeline.lowering: which tick loop a table runs on a mesh, and what it costs.

Contract: `tick_lowering(mesh, sched=None, prog=None) -> "switch" | "select"`
(`ticks.tick_loop(..., select=...)`); `phase_costs(prog, device)` prices each
stage kind's F / B / W; `select_pays(sched, costs, comm)` compares the two.

`switch`: a tick runs one `lax.switch` over the table's actions, records and
updates under `cond`, lag-0 transfers under a switch over the table's send
patterns. On CPU a conditional is a branch. XLA:GPU's conditional thunk copies
its branch index to the host and waits for the device on every execution: on
the first H100 the ticks cost about 0.1 ms each beyond their work
(`HOST_SYNC`; benchmarks/RESULTS.md, "The first GPU run").

`select`: every tick runs every action the table uses and keeps its row's
(`where`), sends on every pair, writes records, aux and updates under `where`:
no conditional, nothing waits on the host, but each tick computes every
(stage kind, F / B / W, chunk) action (`select_cost`: 8-12x the
table's work on 4 stages).

`GRAPHS`: the XLA options under which a GPU runs the whole tick loop as one
CUDA graph (a device-side while with device-side conditionals, the ring's
collectives inside): no tick returns to the host. XLA drops CONDITIONAL and
WHILE below CUDA 12.3 (driver and runtime); a compile-only device given a
driver version (`gpu_hlo.target_config(..., driver=...)`) shows the capture in
XLA's log (tests/test_pipeline_graphs.py). Not a default: on one H200 it did
not pay (benchmarks.executor_cost --graphs; RESULTS, issue 48).

`auto` (the default): `switch` on CPU; on a GPU `select` where its wasted work
costs less than the host round trips it saves (small ticks), else `switch`.
`OOOJAX_TICKS=switch|select` forces one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ooojax.passes.pipeline.actions import UPDATE

if TYPE_CHECKING:
  from ooojax.passes.pipeline.schedule import PipelineSchedule

__all__ = [
  "GRAPHS",
  "HOST_SYNC",
  "TICKS",
  "SelectCost",
  "phase_costs",
  "select_cost",
  "select_pays",
  "stage_costs",
  "tick_lowering",
]

TICKS = "OOOJAX_TICKS"
HOST_SYNC = 1e-4  # s per switch tick beyond its work (first H100 run, jax 0.11.2, 3 conds a tick;
# one H200: 88 us with 3, 54 us with the 1 a GPU runs now, and as much as one CUDA graph
# of the loop: the ticks' extra kernels, not the host (RESULTS, issue 48))
GRAPHS = {
  "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,COLLECTIVES,CONDITIONAL,WHILE",
  "xla_gpu_graph_min_graph_size": 1,
}


def phase_costs(prog, device) -> tuple[tuple[str, float, float, float], ...]:
  """Per stage kind of `prog` (`program.Program`): (name, F, B, W) seconds for
  one microbatch on one chunk, priced by the cost model for `device`."""
  from ooojax.passes.cost import CostModel

  cm = CostModel(device)
  out = []
  for fl in prog.flavors:
    price = lambda ids, fl=fl: cm.unit_cost([fl.jaxpr.eqns[k] for k in ids]).seconds  # noqa: E731
    kind = (
      "first and last"
      if fl.first and fl.last
      else ("first" if fl.first else "last" if fl.last else "middle")
    )
    out.append((kind, price(fl.f_eqns), price(fl.b_eqns), price(fl.w_eqns)))
  return tuple(out)


def stage_costs(phases, chunks: int) -> dict:
  """Per whole stage, the slowest stage kind's F / B / W (lock-step ticks)."""
  return {k: max(p[i] for p in phases) * chunks for i, k in enumerate("FBW", 1)}


def select_pays(sched, costs: Mapping[str, float], comm: float = 0.0) -> bool:
  """Whether the `select` ticks' simulated step is no longer than the table's
  plus `HOST_SYNC` per tick (what `switch` pays on a GPU)."""
  from ooojax.passes.pipeline.generate import unfuse
  from ooojax.passes.pipeline.simulate import simulate

  switch = simulate(sched, costs, comm).makespan + unfuse(sched).ticks * HOST_SYNC
  return select_cost(sched, costs, comm).makespan <= switch


def tick_lowering(mesh, sched=None, prog=None) -> str:
  """`switch` or `select` for a table on `mesh`'s devices (see the module doc).
  Without `sched` and `prog` a GPU gets `select`."""
  mode = os.environ.get(TICKS, "auto")
  if mode not in ("auto", "switch", "select"):
    raise ValueError(f"{TICKS}={mode!r}: use auto (the default), switch or select")
  if mode != "auto":
    return mode
  dev = mesh.devices.flat[0]
  if dev.platform == "cpu":
    return "switch"
  if sched is None or prog is None:
    return "select"
  from ooojax.passes.cost import DEVICE_SPECS

  kind = str(getattr(dev, "device_kind", "")).upper()
  name = next((n for n in DEVICE_SPECS if n in kind and n != "CPU"), "H100")
  return (
    "select" if select_pays(sched, stage_costs(phase_costs(prog, name), sched.chunks)) else "switch"
  )


@dataclasses.dataclass(frozen=True)
class SelectCost:
  """The `select` tick loop, priced (simulated): every device runs, on every
  tick, every (stage kind, F / B / W, chunk) action the table holds, and keeps
  its own; the rest is masked (wasted) work. Ticks are lock-step."""

  ticks: int
  actions: tuple[tuple[str, str, int], ...]  # (stage kind, kind, chunk) run every tick
  tick: float  # one tick: every action (and, with lag 0, the transfer after it)
  makespan: float
  useful: float  # the table's own work, summed over the stages
  stages: int

  comm: float = 0.0  # the part of `tick` that waits for the transfer (lag 0)

  @property
  def wasted_fraction(self) -> float:
    """Share of the computed work that is masked: `1 - useful / computed`."""
    computed = self.stages * self.ticks * (self.tick - self.comm)
    return 1.0 - self.useful / computed if computed else 0.0


def _stage_kind(vs: int, V: int) -> str:
  return "only" if V == 1 else "first" if vs == 0 else "last" if vs == V - 1 else "middle"


def select_cost(
  sched: PipelineSchedule, costs: Mapping[str, float] | None = None, comm: float = 0.0
) -> SelectCost:
  """What the `select` tick loop costs: `ticks x (sum of every action's cost)`,
  the table run lock-step with fused BW split (`generate.unfuse`, as the
  executor runs it); with lag 0 each tick also waits for its transfer, with lag
  1 the transfer runs beside the tick's work. Stage kinds are first / middle /
  last (one stage function; automatic cuts with unequal stages have more).

  >>> from ooojax.passes.pipeline.generate import generate
  >>> c = select_cost(generate("gpipe", 2, 2))   # 8 ticks, first and last F, B, W each
  >>> c.ticks, len(c.actions), c.makespan, round(c.wasted_fraction, 3)
  (8, 6, 48.0, 0.875)
  """
  from ooojax.passes.pipeline.generate import unfuse
  from ooojax.passes.pipeline.simulate import _cost

  costs = {"F": 1.0, "B": 1.0, "W": 1.0, UPDATE: 0.0, **(costs or {})}
  u = unfuse(sched)
  V = u.virtual_stages
  acts, useful = set(), 0.0
  for s, row in enumerate(u.grid):
    for cell in row:
      for a in cell:
        if a.kind in ("F", "B", "W"):
          acts.add((_stage_kind(u.vstage(s, a.chunk), V), a.kind, a.chunk))
          useful += _cost(costs, a.kind, u.chunks)
  order = {"first": 0, "only": 0, "middle": 1, "last": 2}
  actions = tuple(sorted(acts, key=lambda x: (order[x[0]], x[2], "FBW".index(x[1]))))
  work = sum(_cost(costs, k, u.chunks) for _, k, _ in actions)
  upd = costs[UPDATE] * u.chunks / u.chunks if u.steps > 1 else 0.0  # every tick, masked
  work += upd
  tick = work + comm if sched.lag == 0 else max(work, comm)
  return SelectCost(u.ticks, actions, tick, u.ticks * tick, useful, u.stages, tick - work)
