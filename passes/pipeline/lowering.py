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
(stage kind, F / B / W, chunk) action (`simulate.select_cost`: 8-12x the
table's work on 4 stages). Command-buffer conditionals (CUDA graphs) would keep
the switch on the device, but XLA drops CONDITIONAL and WHILE from the command
types below CUDA 12.3 and a compile-only device reports no driver, so no test
here can see them (RESULTS, issue 48).

`auto` (the default): `switch` on CPU; on a GPU `select` where its wasted work
costs less than the host round trips it saves (small ticks), else `switch`.
`OOOJAX_TICKS=switch|select` forces one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["HOST_SYNC", "TICKS", "phase_costs", "select_pays", "stage_costs", "tick_lowering"]

TICKS = "OOOJAX_TICKS"
HOST_SYNC = 1e-4  # seconds per switch tick beyond its work (first H100 run, jax 0.11.2)


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
  from ooojax.passes.pipeline.simulate import select_cost, simulate

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
