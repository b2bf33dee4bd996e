"""pipeline.balance: how many of the stack's layers each virtual stage runs.

Contract: `balance(layers, costs, sched, how="balanced") -> Balance`, a pure
function of the cost-model prices (`StackCosts`: F, B and W seconds of one
layer, of the prologue and of the epilogue, per microbatch) and of the table;
`price(cut, p_avals, b_avals) -> StackCosts` prices a `passes.pipeline.cut.Cut`
with `passes.cost`. Read by `ooojax.pipeline`, which gives each count its own
stage function (`Cut.stage_fn(n)`) and pads the stage-stacked parameters to
the largest count (`Cut.stage_params(leaves, counts)`).

The executor runs the table lock-step: a tick lasts as long as its slowest
cell (`generate.unfuse`), so a split is scored by the table's makespan with
each cell priced by its virtual stage (`counts[v]` layers, plus the prologue
on the first virtual stage and the epilogue on the last). That accounts for
the placement: interleaved puts chunk c of stage s on device s, zb-v the
first and the last virtual stage both on device 0. Ties go to the smaller
busiest device, then the smaller slowest virtual stage, then the split
nearest to even, so equal costs keep the even split. The search: from the
near-even split, from a greedy fill per virtual stage and from one per
device, move one layer at a time while the score improves. Every virtual
stage keeps at least one layer, and the middle ones differ by at most one:
each distinct count is a stage kind of its own to trace and compile, and the
stage stacks are padded to the largest count (memory on every device).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from ooojax.passes.pipeline.generate import unfuse
from ooojax.passes.pipeline.schedule import PipelineSchedule

__all__ = ["Balance", "Phases", "StackCosts", "balance", "even", "price"]

_KIND = {"F": 0, "B": 1, "W": 2}


@dataclasses.dataclass(frozen=True)
class Phases:
  """Seconds of one microbatch's F, B (input gradient) and W (weight gradient)."""

  f: float = 0.0
  b: float = 0.0
  w: float = 0.0

  @property
  def total(self) -> float:
    return self.f + self.b + self.w


@dataclasses.dataclass(frozen=True)
class StackCosts:
  layer: Phases  # one layer of the stack
  prologue: Phases  # what the first virtual stage runs before it (embedding)
  epilogue: Phases  # what the last runs after it (final norm, head, loss)


@dataclasses.dataclass(frozen=True)
class Balance:
  """The layers per virtual stage and how they were chosen (cost model, not measured)."""

  counts: tuple[int, ...]  # layers of virtual stage v
  how: str  # "balanced", "even" or "given"
  stage_seconds: tuple[float, ...]  # per virtual stage: F + B + W of one microbatch
  device_seconds: tuple[float, ...]  # per device: the sum over its virtual stages
  step_seconds: float  # the lock-step table's makespan with these counts
  even_step_seconds: float  # ... with the near-even split

  def summary(self) -> str:
    ms = lambda xs: ", ".join(f"{x * 1e3:.3f}" for x in xs)  # noqa: E731
    return (
      f"layers per virtual stage {self.counts} ({self.how}); per microbatch F+B+W "
      f"(cost model) {ms(self.stage_seconds)} ms per virtual stage, "
      f"{ms(self.device_seconds)} ms per device; step {self.step_seconds * 1e3:.3f} "
      f"ms (simulated, lock-step) vs {self.even_step_seconds * 1e3:.3f} ms even"
    )

  def __str__(self) -> str:
    return self.summary()


def even(layers: int, vstages: int) -> tuple[int, ...]:
  """`layers / vstages` each; a remainder goes one layer apiece to the middle virtual
  stages first (they run no prologue or epilogue), then the first.

  >>> even(8, 4), even(7, 4), even(5, 2)
  ((2, 2, 2, 2), (2, 2, 2, 1), (3, 2))
  """
  n, extra = divmod(layers, vstages)
  order = list(range(1, vstages - 1)) + [0, vstages - 1]
  counts = [n] * vstages
  for v in order[:extra]:
    counts[v] += 1
  return tuple(counts)


def balance(
  layers: int, costs: StackCosts, sched: PipelineSchedule, how: str | Sequence[int] = "balanced"
) -> Balance:
  """Layers per virtual stage of `sched` (see the module doc).

  Args:
    layers: the stack's layer count L.
    costs: the cost-model seconds of one layer, the prologue and the epilogue.
    sched: the table the step runs (its placement and tick order).
    how: "balanced" (least simulated makespan), "even" (`even`), or the counts
      themselves (one per virtual stage, each at least 1, summing to L).

  >>> from ooojax.passes.pipeline.generate import generate
  >>> heavy_head = StackCosts(Phases(1, 1, 1), Phases(), Phases(3, 3, 3))
  >>> balance(8, heavy_head, generate("1f1b", 2, 4)).counts
  (5, 3)
  >>> balance(8, StackCosts(Phases(1, 1, 1), Phases(), Phases()), generate("1f1b", 4, 8)).counts
  (2, 2, 2, 2)
  """
  V = sched.virtual_stages
  if layers < V:
    raise ValueError(
      f"the stack has {layers} layers, fewer than the {V} virtual stages "
      "(stages x chunks) it would be split over; use fewer stages or chunks"
    )
  score = _scorer(layers, costs, sched)
  base = even(layers, V)
  if isinstance(how, str):
    if how == "even":
      counts = base
    elif how == "balanced":
      starts = {base, _fill(layers, costs, V, None), _fill(layers, costs, V, sched)}
      counts = min((_climb(c, score) for c in starts if _tidy(c)), key=score)
    else:
      raise ValueError(
        f"layers={how!r}: pass 'balanced', 'even' or a tuple of {V} layer "
        "counts, one per virtual stage"
      )
  else:
    counts = tuple(int(n) for n in how)
    if len(counts) != V or min(counts) < 1 or sum(counts) != layers:
      raise ValueError(
        f"layers={tuple(how)} must give each of the {V} virtual stages "
        f"(stages x chunks) at least one layer and sum to the stack's "
        f"{layers} layers, e.g. {base}"
      )
    how = "given"
  t = _times(counts, costs)
  dev = [0.0] * sched.stages
  for v, x in enumerate(t):
    dev[sched.place(v)[0]] += x
  return Balance(
    counts,
    how,
    tuple(t),
    tuple(dev),
    float(score(counts)[0] * score.ref),
    float(score(base)[0] * score.ref),
  )


def _extra(costs: StackCosts, V: int) -> np.ndarray:
  """(V, 3): the prologue's and the epilogue's F, B, W on their virtual stages."""
  out = np.zeros((V, 3))
  out[0] += (costs.prologue.f, costs.prologue.b, costs.prologue.w)
  out[V - 1] += (costs.epilogue.f, costs.epilogue.b, costs.epilogue.w)
  return out


def _times(counts, costs: StackCosts) -> list[float]:
  ex = _extra(costs, len(counts)).sum(1)
  return [n * costs.layer.total + float(e) for n, e in zip(counts, ex)]


def _scorer(layers: int, costs: StackCosts, sched: PipelineSchedule):
  """`score(counts)`: (makespan, busiest device, slowest virtual stage, distance from
  even), the times relative to the whole model's and rounded so float noise ties."""
  V, S = sched.virtual_stages, sched.stages
  u = unfuse(sched)
  cells = np.full((u.ticks, S), 3 * V, np.int64)  # 3V: idle
  for s in range(S):
    for t in range(u.ticks):
      a = u.compute(s, t)
      if a is not None and a.kind in _KIND:
        cells[t, s] = 3 * u.vstage(s, a.chunk) + _KIND[a.kind]
  layer = np.array([costs.layer.f, costs.layer.b, costs.layer.w])
  extra = _extra(costs, V)
  owner = np.array([sched.place(v)[0] for v in range(V)])
  ref = layers * layer.sum() + extra.sum()
  ref = ref if ref > 0 else 1.0
  mean = layers / V

  def score(counts):
    n = np.asarray(counts, float)
    cell = np.append((n[:, None] * layer + extra).ravel(), 0.0)
    per_v = cell[:-1].reshape(V, 3).sum(1)
    per_d = np.bincount(owner, per_v, minlength=S)
    r = lambda x: round(float(x) / ref, 9)  # noqa: E731
    return (
      r(cell[cells].max(1).sum()),
      r(per_d.max()),
      r(per_v.max()),
      round(float(np.abs(n - mean).sum()), 9),
    )

  score.ref = ref
  return score


def _fill(layers: int, costs: StackCosts, V: int, sched) -> tuple[int, ...]:
  """One layer per virtual stage, then each next layer where the time after it is least:
  per virtual stage, or (with `sched`) on the least busy device, in its least busy
  virtual stage."""
  ex = _extra(costs, V).sum(1)
  lt = costs.layer.total
  counts = [1] * V
  t = [lt + float(e) for e in ex]
  if sched is None:
    heap = [(t[v] + lt, v) for v in range(V)]
    heapq.heapify(heap)
    for _ in range(layers - V):
      _, v = heapq.heappop(heap)
      counts[v] += 1
      t[v] += lt
      heapq.heappush(heap, (t[v] + lt, v))
    return tuple(counts)
  owner = [sched.place(v)[0] for v in range(V)]
  for _ in range(layers - V):
    dev = [0.0] * sched.stages
    for v in range(V):
      dev[owner[v]] += t[v]
    d = min(range(sched.stages), key=lambda s: (dev[s], s))
    v = min((v for v in range(V) if owner[v] == d), key=lambda v: (t[v], v))
    counts[v] += 1
    t[v] += lt
  return tuple(counts)


def _tidy(n) -> bool:
  """Middle virtual stages differ by at most one layer: at most four layer counts
  (each its own flavor to trace and compile), and little padding."""
  mid = n[1:-1]
  return not mid or max(mid) - min(mid) <= 1


def _climb(counts: tuple[int, ...], score) -> tuple[int, ...]:
  """Moves one layer between two virtual stages while the best such move improves
  (keeping the split `_tidy`)."""
  n, best = list(counts), score(counts)
  for _ in range(sum(counts) * len(counts)):
    move = None
    for i in range(len(n)):
      if n[i] <= 1:
        continue
      for j in range(len(n)):
        if i == j:
          continue
        n[i], n[j] = n[i] - 1, n[j] + 1
        s = score(n) if _tidy(n) else best
        if s < best:
          best, move = s, (i, j)
        n[i], n[j] = n[i] + 1, n[j] - 1
    if move is None:
      break
    n[move[0]] -= 1
    n[move[1]] += 1
  return tuple(n)


def price(cut, p_avals: Sequence, b_avals: Sequence, device=None) -> StackCosts:
  """The cost-model seconds (`passes.cost.CostModel` on `device`, default the local
  one) of one microbatch through a layer, the prologue and the epilogue of `cut`;
  `p_avals` / `b_avals` the parameter and batch leaves' shapes of one microbatch.
  Backward phases are priced from `jax.vjp`: B as the input cotangent's share, W as
  the rest (the split pass cuts them more finely; this only ranks splits)."""
  import jax
  import jax.numpy as jnp

  from ooojax.passes.cost import CostModel

  cm = CostModel(device)
  secs = lambda f, *a: cm.unit_cost(jax.make_jaxpr(f)(*a).jaxpr.eqns).seconds  # noqa: E731
  sh = tuple(p_avals[i] for i in cut.shared)
  ins = tuple(b_avals[i] for i in cut.inputs)
  tg = tuple(b_avals[i] for i in cut.targets)
  x = jax.eval_shape(cut.input_fn, ins, sh)
  row = [p_avals[i] for i in cut.stacked[0]]
  if cut.state:  # a layer's model state, then its probes (`passes.pipeline.state`)
    row += [b_avals[i] for i in cut.state[0]]
  if cut.scanned:  # one layer's slice of the stacked leaves
    row = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in row]
  row += list(cut.emit_avals)
  # side leaves (a mask's tokens): only their shapes matter to the price
  consts = cut.consts_fn(tuple(jnp.zeros(b_avals[i].shape, b_avals[i].dtype) for i in cut.side))
  ones = lambda y: jax.tree.map(jnp.ones_like, y)  # noqa: E731

  def phases(f, wrt_x, *args):
    """F, B, W of `f(x, w)`: B the vjp to `x` alone (when `wrt_x`), W the rest."""
    fwd = secs(f, *args)
    dx = (
      secs(lambda *a: jax.vjp(lambda x: f(x, a[1]), a[0])[1](ones(f(*a))), *args) if wrt_x else fwd
    )
    full = secs(lambda *a: jax.vjp(f, *a)[1](ones(f(*a))), *args)
    return Phases(fwd, max(dx - fwd, 0.0), max(full - dx, 0.0))

  layer = phases(lambda x, w: cut.layer_fn(consts, w, x), True, x, tuple(row))
  pro = phases(lambda i, s: cut.input_fn(i, s), False, ins, sh)
  epi = phases(lambda y, s: cut.loss_fn(y, tg, s), True, x, sh)
  return StackCosts(layer, pro, epi)
