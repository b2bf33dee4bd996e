"""The pipeline tick loop's two lowerings, per schedule, on a compile-only GPU:
`conditional`s in the compiled step's loop (each one a host round trip on
XLA:GPU), temporary memory, and the simulated step of each lowering
(`passes.pipeline.lowering`; `lowering.select_cost`). Nothing runs.

  python -m benchmarks.tick_lowering                      # compile-only H100
  python -m benchmarks.tick_lowering --layers 8 --dim 512 --write

Simulated steps (cost model, not measured): `table` is the table's own event
replay, `switch` adds `HOST_SYNC` per tick (the first H100's ~0.1 ms), `select`
runs every action on every tick (`ticks x sum of actions`).
"""

from __future__ import annotations

import argparse
import os

import jax

import ooojax as ooo
from benchmarks import _mlp_model as model, _report
from ooojax import gpu_hlo
from ooojax.passes.hlo import schedule as hlo_schedule
from ooojax.passes.pipeline.generate import unfuse
from ooojax.passes.pipeline.lowering import HOST_SYNC, TICKS, select_cost

NAMES = ("gpipe", "1f1b", "ooo", "zb-h1", "zb-h2", "interleaved", "zb-v")


def _loop_conditionals(text: str) -> int:
  s = hlo_schedule.parse(text)
  return sum(i.op == "conditional" for c in s.loop_bodies() for i in s.computations[c])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gpu", default="H100")
  ap.add_argument("--stages", type=int, default=4)
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--hidden", type=int, default=1024)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--schedules", nargs="+", default=list(NAMES))
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  S, M = a.stages, a.microbatches
  mesh = gpu_hlo.mesh(a.gpu, S, ("stage",))
  sd = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  ms = lambda t: f"{t * 1e3:.3f}"  # noqa: E731
  rows = []
  for name in a.schedules:
    sched = ooo.pipeline.schedule(name, stages=S, microbatches=M)
    params = model.make_params(sched.virtual_stages, a.layers, a.dim, a.hidden)
    batch = model.make_batch(a.batch, a.dim)
    compiled = {}
    for low in ("switch", "select"):
      os.environ[TICKS] = low  # read while the executor traces (a new step: a new trace)
      step = ooo.pipeline.value_and_grad(
        model.stage_fn, model.loss_fn, mesh=mesh, axis_name="stage", schedule=sched
      )
      c = gpu_hlo.compiled(jax.jit(step), *jax.tree.map(sd, (params, batch)), mesh=mesh)
      compiled[low] = (_loop_conditionals(c.as_text()), c.memory_analysis().temp_size_in_bytes)
    os.environ.pop(TICKS)
    r = ooo.pipeline.explain(
      model.stage_fn, model.loss_fn, sched, params, batch, device=a.gpu, microbatches=M
    )
    ticks = unfuse(sched).ticks
    unit = []
    for costs in ({"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 1.0, "B": 2.0, "W": 1.0}):
      table = sched.simulate(costs).makespan
      unit.append(f"{select_cost(sched, costs).makespan / table:.1f}x")
    sel = r.select_cost()
    switch = r.step_seconds + ticks * HOST_SYNC
    rows.append(
      f"| {name} | {ticks} | {len(sel.actions)} | {compiled['switch'][0]} / "
      f"{compiled['select'][0]} | {compiled['switch'][1] / 2**20:.2f} / "
      f"{compiled['select'][1] / 2**20:.2f} | {unit[0]} | {unit[1]} | "
      f"{ms(r.step_seconds)} / {ms(switch)} / {ms(sel.makespan)} | "
      f"{sel.wasted_fraction:.0%} | {r.lowering} |"
    )
    print(rows[-1], flush=True)
  lines = _report.header("Pipeline tick loops: switch vs select (benchmarks/tick_lowering.py)")
  lines += [
    f"Compile-only {a.gpu} x {S} stages (nothing ran), {M} microbatches, {a.layers} "
    f"residual MLP blocks D={a.dim} H={a.hidden}, batch {a.batch}, float32. Conditionals: "
    "in the compiled step's while-loop bodies (each one a host round trip per tick on "
    "XLA:GPU). Temp: `memory_analysis().temp_size_in_bytes`. Select / table: the select "
    "loop's simulated step over the table's at F:B:W = 1:1:1 and 1:2:1. Steps in ms, "
    f"simulated with the {a.gpu} cost model: the table's, switch (table + "
    f"{HOST_SYNC * 1e3:.1f} ms host round trip per tick), select (every action every "
    "tick); wasted: the select loop's masked share of its work; auto: what "
    "`OOOJAX_TICKS=auto` picks on this GPU for this model.",
    "",
    "| schedule | ticks | actions | conditionals switch / select | temp MiB switch / select "
    "| select / table 1:1:1 | 1:2:1 | step ms table / switch / select (simulated) "
    "| wasted | auto |",
    "|---|---|---|---|---|---|---|---|---|---|",
    *rows,
  ]
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
