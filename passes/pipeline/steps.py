"""pipeline.steps: several training steps in one table, and their steady state.

Contract: `tile(sched, steps, shared=False) -> PipelineSchedule` (validated;
`tile(s, 1)` is `s`), `with_updates(sched)` (a one-step table with its `U`)
and `steady_state(sched, steps=4, costs=None, comm=0.0) -> SteadyState`
(simulated, never measured).

Why: with F = B = W and a synchronous step (every stage waits for the whole
step before the optimizer runs) no table idles less than (p-1)/(3m+p-1) of a
step, because the stages start and finish staggered. Zero Bubble's ZB-H2 gets
its near-zero bubble only when step t's drain overlaps step t + 1's warm-up.

`tile` lays out the per-stage orders of consecutive steps: on each stage, step
t's actions in the one-step table's order, the update `U` of each of its
chunks right after that chunk's last W, then step t + 1's actions. The only
dependency between steps is per (stage, chunk): a forward of step t + 1 reads
the weights that its own stage's U of step t writes, and that U waits for
every W of its step on that stage -- never a global barrier, so stage 0 may
start step t + 1 while the last stage still drains step t. The orders are
placed as soon as possible on unit ticks and the transfers lowered, as
`generate` does for one step. A stage starts step t + 1 only after all its W
of step t, so one step's activation bound per stage holds across steps (the
validator checks it on the tiled table).

Weights the first and the last virtual stage share (tied embeddings) take
gradient contributions from both, so their update needs a reduction across
the stages: `shared=True` adds the one cross-stage dependency that makes it
exact, the first stage's forwards of step t + 1 wait for the last stage's
update of step t too (the executor reduces and updates the shared weights at
the later of the two updates). 1F1B's last stage finishes before the first,
so that costs it nothing; ZB-H2 defers the last stage's W into the drain, so
stage 0 waits for the whole step: with F = B = W its steady bubble is its
one-step bubble again (`steady_state(..., shared=True)`), the tiling gain gone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ooojax.passes.pipeline.actions import COMPUTE, UPDATE, Action
from ooojax.passes.pipeline.place import _lower_comms, _place, shared_dep

if TYPE_CHECKING:  # `schedule` calls `tile` / `steady_state` (its methods): no import back
  from ooojax.passes.pipeline.schedule import PipelineSchedule

__all__ = ["SteadyState", "steady_state", "tile", "with_updates"]


def tile(sched: PipelineSchedule, steps: int, shared: bool = False) -> PipelineSchedule:
  """`steps` consecutive training steps of a one-step table, in one validated table.

  Args:
    sched: a one-step table (from `generate`).
    steps: how many steps to lay out (1 returns `sched` unchanged).
    shared: the first virtual stage's forwards of step t + 1 also wait for the
      last virtual stage's update of step t (weights both read: see above).

  Returns:
    A `PipelineSchedule` with `steps=steps`: actions of step t carry `step=t`
    (`1F0@1`), and each (stage, chunk) has one update `U` per step in the cell
    of its last W. Example:

    >>> from ooojax.passes.pipeline.generate import generate
    >>> one = generate("zb-h2", stages=4, microbatches=8)
    >>> two = tile(one, 2)
    >>> two.steps, two.ticks, 2 * one.ticks          # step 1 starts before step 0 ends
    (2, 51, 54)
    >>> [str(a) for a in two.grid[0][23]]            # stage 0: last W of step 0, its update
    ['0W7', '0U']
    >>> str(two.compute(0, 24)), str(two.compute(3, 26))  # stage 3 still drains step 0
    ('0F0@1', '3W7')
  """
  if not (isinstance(steps, int) and steps >= 1):
    raise ValueError(f"steps must be an int >= 1, got {steps!r}")
  if sched.steps != 1:
    raise ValueError(
      f"tile a one-step table; {sched.name!r} already holds {sched.steps} "
      "steps (tile the table it was tiled from)"
    )
  if steps == 1:
    return sched
  return _tiled(sched, steps, shared)


def with_updates(sched: PipelineSchedule) -> PipelineSchedule:
  """A one-step table with each (stage, chunk)'s update `U` after its last W: what
  a training program of one step runs (`tile(sched, 1)` is `sched` itself).

  >>> from ooojax.passes.pipeline.generate import generate
  >>> one = with_updates(generate("1f1b", stages=2, microbatches=2))
  >>> one.steps, [str(a) for a in one.grid[0][one.ticks - 1]]
  (1, ['0BW1', '0U'])
  """
  if sched.steps != 1:
    raise ValueError(
      f"with_updates takes a one-step table; {sched.name!r} holds {sched.steps} steps"
    )
  return _tiled(sched, 1, False)


def _tiled(sched: PipelineSchedule, steps: int, shared: bool) -> PipelineSchedule:
  one = [[a for a in row if a.kind in COMPUTE] for row in sched.orders()]
  orders = []
  for s, row in enumerate(one):
    last = {}  # chunk -> index of its last W (or BW) in the step's order
    for i, a in enumerate(row):
      if a.kind in ("W", "BW"):
        last[a.chunk] = i
    out: list[Action] = []
    for t in range(steps):
      for i, a in enumerate(row):
        out.append(dataclasses.replace(a, step=t))
        out += [Action(s, UPDATE, 0, c, t) for c in sorted(last) if last[c] == i]
    orders.append(out)
  S, v = sched.stages, sched.chunks
  grid = _place(
    S,
    sched.microbatches,
    v,
    orders,
    sched.lag,
    sched.placement,
    shared_dep(S * v - 1) if shared else None,
  )
  return dataclasses.replace(
    sched, grid=_lower_comms(S, v, grid, sched.lag, sched.placement), steps=steps
  ).validate()


@dataclasses.dataclass(frozen=True)
class SteadyState:
  """Per-step figures of a table tiled over `steps` steps (simulated).

  `step_times[t]`: when step t's last action (its last update included) ends,
  minus when step t - 1's ended; `step_bubbles[t]`: the idle share of
  `stages x step_times[t]` given step t's work. The first step pays the
  warm-up; later ones show the steady state.
  """

  name: str
  stages: int
  steps: int
  step_times: tuple[float, ...]
  step_bubbles: tuple[float, ...]
  bubble: float  # idle share over the whole tiled run
  one_step_bubble: float  # the one-step table alone: synchronous steps

  @property
  def steady_bubble(self) -> float:
    """The last step's bubble: what every further step costs."""
    return self.step_bubbles[-1]


def steady_state(
  sched: PipelineSchedule,
  steps: int = 4,
  costs: Mapping[str, float] | None = None,
  comm: float = 0.0,
  shared: bool = False,
) -> SteadyState:
  """Simulates `tile(sched, steps, shared)` and splits the timeline by step.

  `costs` as in `simulate` (`"U"`: a stage's optimizer update, default 0).
  `shared=True`: weights the first and the last stage share (tied embeddings).

  >>> from ooojax.passes.pipeline.generate import generate
  >>> st = steady_state(generate("zb-h2", 4, 8), steps=4)
  >>> round(st.one_step_bubble, 3), [round(b, 3) for b in st.step_bubbles]
  (0.111, [0.111, 0.0, 0.0, 0.0])
  >>> round(steady_state(generate("1f1b", 4, 8)).steady_bubble, 3)   # no gain
  0.273
  >>> round(steady_state(generate("zb-h2", 4, 8), shared=True).steady_bubble, 3)
  0.111
  """
  one = tile(sched, 1)  # the one-step table (and the argument checks)
  if steps < 2:
    raise ValueError(f"steady_state needs steps >= 2 to see a steady step, got {steps!r}")
  from ooojax.passes.pipeline.simulate import simulate

  tl = simulate(
    tile(one, steps, shared), costs, comm, shared_dep(one.virtual_stages - 1) if shared else None
  )
  end = [0.0] * steps
  work = [0.0] * steps
  for a, b, e in tl.spans:
    end[a.step] = max(end[a.step], e)
    work[a.step] += e - b
  times = tuple(e - p for e, p in zip(end, [0.0] + end[:-1]))
  S = sched.stages
  bubbles = tuple(1.0 - w / (S * d) if d > 0 else 0.0 for w, d in zip(work, times))
  return SteadyState(
    sched.name,
    S,
    steps,
    times,
    bubbles,
    tl.bubble_fraction,
    one.bubble_fraction({k: x for k, x in (costs or {}).items() if k != UPDATE}, comm),
  )
