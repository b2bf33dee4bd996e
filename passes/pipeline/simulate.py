"""pipeline.simulate: replay a pipeline table with per-action costs; plot it.

Contract: `simulate(sched, costs, comm) -> PipelineTimeline`, `plot(sched, costs)`;
`select_cost(sched, costs, comm) -> SelectCost`: the `select` tick loop's step
(a GPU's lowering, `passes.pipeline.ticks.tick_lowering`), which runs every
action the table uses on every tick.

Each stage runs its compute actions in the table's order; an action starts once
its stage is free and what it depends on has finished (plus `comm` seconds when
that came from another device). `costs` are per whole stage (`{"F", "B", "W"}`,
default 1 each, and `"U"`, a stage's optimizer update in a multi-step table,
default 0); an interleaved chunk costs `1 / chunks` of them and the fused BW
costs B + W. The result is a cost-model estimate, never a measurement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ooojax.passes.pipeline.actions import UPDATE, Action, ScheduleError, deps, done

if TYPE_CHECKING:
  from ooojax.passes.pipeline.schedule import PipelineSchedule

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "BW": "#C44E52", "U": "#8172B3"}


@dataclasses.dataclass(frozen=True)
class PipelineTimeline:
  spans: tuple[tuple[Action, float, float], ...]  # (action, start, end)
  makespan: float
  stages: int

  @property
  def busy(self) -> float:
    return sum(e - b for _, b, e in self.spans)

  @property
  def bubble_fraction(self) -> float:
    """Idle share of `stages x makespan`."""
    total = self.stages * self.makespan
    return 1.0 - self.busy / total if total else 0.0

  @property
  def inner_bubble_fraction(self) -> float:
    """Idle share between each stage's first start and last end.

    What Zero Bubble's ZB-H2 drives to zero: the staggered start and end of the
    stages (a parallelogram) can overlap the optimizer step and the next step.
    """
    lo, hi = [float("inf")] * self.stages, [0.0] * self.stages
    for a, b, e in self.spans:
      lo[a.stage], hi[a.stage] = min(lo[a.stage], b), max(hi[a.stage], e)
    window = sum(h - l for l, h in zip(lo, hi) if h > l)
    return 1.0 - self.busy / window if window else 0.0


def _cost(costs: Mapping[str, float], kind: str, chunks: int) -> float:
  if kind == "BW":
    return (costs["B"] + costs["W"]) / chunks
  return costs[kind] / chunks


def simulate(
  sched: PipelineSchedule, costs: Mapping[str, float] | None = None, comm: float = 0.0, extra=None
) -> PipelineTimeline:
  """Event replay of the table's per-stage orders (`extra(action, vstage)`: further
  dependencies, as in `place._place`; `steps.steady_state(shared=True)`'s).

  >>> from ooojax.passes.pipeline.generate import generate
  >>> simulate(generate("gpipe", 2, 2)).makespan   # 3 ticks of F, then BW = 2 x 3
  9.0
  """
  costs = {"F": 1.0, "B": 1.0, "W": 1.0, UPDATE: 0.0, **(costs or {})}
  orders = sched.orders()
  S, M = sched.stages, sched.microbatches
  fin: dict[tuple[str, int, int, int], float] = {}  # (kind, vstage, mb, step) -> end
  pos, free = [0] * S, [0.0] * S
  spans = []
  remaining = sum(len(o) for o in orders)
  while remaining:
    moved = False
    for s in range(S):
      while pos[s] < len(orders[s]):
        a = orders[s][pos[s]]
        vs = sched.vstage(s, a.chunk)
        start = free[s]
        ok = True
        for key in deps(a, vs, sched.virtual_stages - 1, M) + (extra(a, vs) if extra else []):
          if key not in fin:
            ok = False
            break
          remote = sched.place(key[1])[0] != s
          start = max(start, fin[key] + (comm if remote else 0.0))
        if not ok:
          break
        end = start + _cost(costs, a.kind, sched.chunks)
        fin.update(dict.fromkeys(done(a, vs), end))
        spans.append((a, start, end))
        free[s] = end
        pos[s] += 1
        remaining -= 1
        moved = True
    if not moved:
      raise ScheduleError(f"{sched.name}: the per-stage orders deadlock")
  makespan = max((e for _, _, e in spans), default=0.0)
  return PipelineTimeline(tuple(spans), makespan, S)


def plot(
  sched: PipelineSchedule, costs: Mapping[str, float] | None = None, ax=None, comm: float = 0.0
):
  """Stages x time, F / B / W (and fused BW) coloured, microbatch numbers inside.

  Returns the matplotlib Axes.
  """
  import matplotlib.pyplot as plt

  tl = simulate(sched, costs, comm)
  if ax is None:
    _, ax = plt.subplots(figsize=(min(2 + tl.makespan * 0.35, 24), 0.5 + 0.45 * sched.stages))
  for a, b, e in tl.spans:
    if a.kind == UPDATE and e == b:  # a free update: a mark where the next step may start
      ax.plot([b, b], [a.stage - 0.45, a.stage + 0.45], color="black", lw=1.5)
      continue
    # Alternate steps are drawn lighter, so a tiled table shows where steps overlap.
    ax.barh(
      a.stage,
      e - b,
      left=b,
      color=COLORS[a.kind],
      edgecolor="white",
      height=0.9,
      alpha=0.55 if a.step % 2 else 1.0,
    )
    if a.kind == UPDATE:
      continue
    label = f"{a.microbatch}" + (f".{a.chunk}" if sched.chunks > 1 else "")
    if (e - b) * 2.5 >= len(label) * min(1.0, tl.makespan / 30):  # skip labels that cannot fit
      ax.text((b + e) / 2, a.stage, label, ha="center", va="center", fontsize=7, color="white")
  ax.set_yticks(range(sched.stages))
  ax.set_yticklabels([f"stage {s}" for s in range(sched.stages)])
  ax.invert_yaxis()
  ax.set_xlabel("time (cost units, simulated)")
  steps = f" x {sched.steps} steps (alternate steps lighter, | = update)" if sched.steps > 1 else ""
  ax.set_title(
    f"{sched.name}{steps}: bubble {tl.bubble_fraction:.1%}, "
    f"peak activations {max(sched.peak_activations())}"
  )
  kinds = sorted(
    {a.kind for a, b, e in tl.spans if a.kind != UPDATE or e > b}, key="F B W BW U".split().index
  )
  from matplotlib.patches import Patch

  ax.legend(
    handles=[Patch(color=COLORS[k], label=k) for k in kinds],
    loc="upper left",
    bbox_to_anchor=(1.0, 1.0),
    fontsize=7,
  )
  return ax
