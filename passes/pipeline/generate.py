"""pipeline.generate: the named pipeline schedules, generated as tables.

Contract: `generate(name, stages, microbatches, chunks=None, lag=0) -> PipelineSchedule`
(validated). A greedy list scheduler picks, at each unit tick (F = B = W = 1,
fused BW = 2) and on each stage, the next action its schedule's `Policy`
allows: what has priority, how many activations may be held and how deep the
warm-up goes, when W runs. The grid is the as-soon-as-possible tick placement
of those per-stage orders; `_lower_comms` adds the transfers.
"""

from __future__ import annotations

import dataclasses
import heapq

from ooojax.passes.pipeline.actions import UPDATE
from ooojax.passes.pipeline.place import _lower_comms, _place, shared_dep
from ooojax.passes.pipeline.schedule import (
  Action,
  PipelineSchedule,
  ScheduleError,
  place_of,
  vstage_of,
)


@dataclasses.dataclass(frozen=True)
class Policy:
  """How the greedy generator chooses. `limit[s]`: in-flight activation bound."""

  fused: bool  # B and W as one BW action
  first: str  # "F": forwards before backwards (GPipe); "B": backward first
  w: str  # "fill" (when idle), "eager" (right after B), "lazy" (when forced)
  limit: tuple[int, ...]  # activations held (F done, W not): the memory bound
  limit_b: tuple[int, ...]  # forwards ahead of their B (F done, B not): the warm-up depth
  lazy_stages: tuple[int, ...] = ()  # stages whose W is "lazy" whatever `w` says


def _policy(name: str, S: int, M: int, v: int) -> Policy:
  warm = tuple(S - s for s in range(S))  # 1F1B: stage s holds S - s
  if name == "gpipe":
    return Policy(True, "F", "fill", (M * v,) * S, (M * v,) * S)
  if name == "1f1b":
    return Policy(True, "B", "fill", warm, warm)
  if name == "ooo":
    # Gradient fast-forwarding: B's dX is sent at once and W runs right after;
    # F waits for W within 1F1B's bound (S - s); the last stage defers its W
    # towards the drain, holding at most 1F1B's peak (S).
    return Policy(False, "F", "eager", warm[:-1] + (S,), warm, lazy_stages=(S - 1,))
  if name == "zb-h1":
    # 1F1B's warm-up, W fills the gaps; every stage within 1F1B's peak (S).
    return Policy(False, "F", "fill", (S,) * S, warm)
  if name == "zb-h2":
    # Deeper warm-up (2(S - s) - 1) and 2S - 1 held: no idle tick between a
    # stage's first and last action (the parallelogram of Zero Bubble's ZB-H2).
    return Policy(False, "B", "fill", (2 * S - 1,) * S, tuple(2 * (S - s) - 1 for s in range(S)))
  if name == "zb-v":
    # Two chunks per device in a V (device s holds layer blocks s and 2S-1-s);
    # within 1F1B's peak memory: 2S chunk activations = S whole-stage ones.
    return Policy(False, "F", "fill", (2 * S,) * S, (2 * S,) * S)
  if name == "interleaved":
    # Megatron's interleaved warm-up depth, in chunk activations.
    lim = tuple((v - 1) * S + 2 * (S - s) - 1 for s in range(S))
    return Policy(True, "F", "fill", lim, lim)
  raise ValueError(f"unknown pipeline schedule {name!r}; use one of {SCHEDULES}")


SCHEDULES = ("gpipe", "1f1b", "ooo", "zb-h1", "zb-h2", "interleaved", "zb-v")


def generate(
  name: str, stages: int, microbatches: int, chunks: int | None = None, lag: int = 0, costs=None
) -> PipelineSchedule:
  """Generates and validates a named schedule.

  Args:
    name: one of `SCHEDULES`.
    stages: pipeline stages (devices on the stage axis).
    microbatches: microbatches per step.
    chunks: virtual stages per device (only `interleaved`; default 2).
    lag: ticks a transfer takes after its producer's tick (0 or 1; see
      `PipelineSchedule`).
    costs: `{"F", "B", "W"}` durations per whole stage the greedy generator
      plans with (default 1 each), e.g. from the cost model.

  Returns:
    A valid `PipelineSchedule`. Example:

    >>> s = generate("1f1b", stages=4, microbatches=8)
    >>> round(s.bubble_fraction(), 3)   # (p - 1) / (m + p - 1)
    0.273
    >>> PipelineSchedule.parse(s.to_text()) == s
    True
  """
  if not (isinstance(stages, int) and stages >= 1):
    raise ValueError(f"stages must be an int >= 1, got {stages!r}")
  if not (isinstance(microbatches, int) and microbatches >= 1):
    raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
  placement = "v" if name == "zb-v" else "modulo"
  if name == "interleaved":
    chunks = 2 if chunks is None else chunks
  elif name == "zb-v":
    if chunks not in (None, 2):
      raise ValueError(f"zb-v has exactly 2 chunks per device, got chunks={chunks}")
    chunks = 2
  elif chunks not in (None, 1):
    raise ValueError(f"chunks={chunks} is for name='interleaved' only")
  chunks = chunks or 1
  if not (isinstance(chunks, int) and chunks >= 1):
    raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
  pol = _policy(name, stages, microbatches, chunks)
  orders = _greedy(stages, microbatches, chunks, pol, placement, costs)
  if lag not in (0, 1):
    raise ValueError(f"lag must be 0 or 1, got {lag!r}")
  grid = _place(stages, microbatches, chunks, orders, lag, placement)
  sched = PipelineSchedule(
    name,
    stages,
    microbatches,
    chunks,
    _lower_comms(stages, chunks, grid, lag, placement),
    pol.limit,
    lag,
    placement,
  )
  return sched.validate()


def unfuse(sched: PipelineSchedule) -> PipelineSchedule:
  """The same per-stage orders with every fused BW as B then W, placed on unit ticks.

  What a lock-step executor should run: each of its ticks lasts as long as its
  slowest cell, so a BW (two units) beside an F (one) idles the F's stage for a
  unit; split, every tick holds one unit of work and the per-stage order (hence
  what each stage holds) is unchanged but for W's record living one tick longer.

  >>> s = generate("1f1b", stages=2, microbatches=4)
  >>> u = unfuse(s)
  >>> u.fused, s.fused, u.ticks > s.ticks
  (False, True, True)
  """
  if not sched.fused:
    return sched
  orders: list[list[Action]] = []
  for s, row in enumerate(sched.grid):
    out: list[Action] = []
    for cell in row:
      for a in cell:
        if a.kind == "BW":
          out += [dataclasses.replace(a, kind="B"), dataclasses.replace(a, kind="W")]
        elif a.kind in ("F", "B", "W", UPDATE):
          out.append(a)
    orders.append(out)
  S, v = sched.stages, sched.chunks
  extra = shared_dep(S * v - 1) if synced(sched) else None  # keep tile(shared=True)'s
  grid = _place(S, sched.microbatches, v, orders, sched.lag, sched.placement, extra)
  return dataclasses.replace(
    sched, grid=_lower_comms(S, v, grid, sched.lag, sched.placement)
  ).validate()


def synced(sched: PipelineSchedule) -> bool:
  """Whether every step's first forward of virtual stage 0 follows the last virtual
  stage's update of the step before (tiled with `shared=True`, or by chance)."""
  last, f0, ul = sched.virtual_stages - 1, {}, {}
  for s, row in enumerate(sched.grid):
    for t, cell in enumerate(row):
      for a in cell:
        vs = sched.vstage(s, a.chunk)
        if a.kind == "F" and vs == 0:
          f0[a.step] = min(f0.get(a.step, t), t)
        elif a.kind == UPDATE and vs == last:
          ul[a.step] = t
  return all(f0[n] > ul[n - 1] for n in range(1, sched.steps)) if ul else False


def _greedy(
  S: int, M: int, v: int, pol: Policy, placement: str = "modulo", costs=None, comm: float = 0.0
) -> list[list[Action]]:
  """Event-driven list scheduling under the policy; durations from `costs`
  (per whole stage, default F = B = W = 1; a chunk costs 1 / v; BW = B + W);
  a value from another device is ready `comm` after its producer ends."""
  V = S * v
  c = {"F": 1.0, "B": 1.0, "W": 1.0, **(costs or {})}
  dur_of = {"F": c["F"] / v, "B": c["B"] / v, "W": c["W"] / v, "BW": (c["B"] + c["W"]) / v}
  fin: dict[tuple[str, int, int], float] = {}  # finish time
  free = [0] * S
  live = [0] * S
  fwd_order = [
    sorted(
      ((m, c) for m in range(M) for c in range(v)), key=lambda mc: (mc[0] // S, mc[1], mc[0] % S)
    )
    for _ in range(S)
  ]
  nf = [0] * S
  pending_b: list[list[tuple[int, int]]] = [[] for _ in range(S)]
  pending_w: list[list[tuple[int, int]]] = [[] for _ in range(S)]
  orders: list[list[Action]] = [[] for _ in range(S)]
  total = S * M * v * 3
  count, t, idle = 0, 0.0, 0
  events: list[float] = []  # every finish (and arrival) time: the next event is the heap's min

  def ready(key, s=None):
    late = comm if s is not None and place_of(S, key[1], placement)[0] != s else 0.0
    return key in fin and fin[key] + late <= t

  while count < total:
    progressed = False
    for s in range(S):
      if free[s] > t:
        continue
      # candidates
      b_ok = [
        (m, c)
        for m, c in pending_b[s]
        if (vs := vstage_of(S, s, c, placement)) == V - 1 or ready(("B", vs + 1, m), s)
      ]
      b_ok.sort(key=lambda mc: (mc[0] // S, -mc[1], mc[0] % S))

      def f_ready(mc):
        vs = vstage_of(S, s, mc[1], placement)
        return vs == 0 or ready(("F", vs - 1, mc[0]), s)

      if placement == "v":  # any arrived forward, the deeper chunk first
        rest = fwd_order[s][nf[s] :]
        cands = sorted((mc for mc in rest if f_ready(mc)), key=lambda mc: (-mc[1], mc[0]))
        f_next = cands[0] if cands else (rest[0] if rest else None)
      else:
        f_next = fwd_order[s][nf[s]] if nf[s] < len(fwd_order[s]) else None
      f_in = f_next is not None and f_ready(f_next)
      f_ok = f_in and live[s] < pol.limit[s] and len(pending_b[s]) < pol.limit_b[s]
      wpol = "lazy" if s in pol.lazy_stages else pol.w
      choice = None
      if pending_w[s] and wpol == "eager":
        choice = ("W", pending_w[s][0])
      elif pol.first == "F" and f_ok:
        choice = ("F", f_next)
      elif b_ok:
        choice = ("BW" if pol.fused else "B", b_ok[0])
      elif f_ok:
        choice = ("F", f_next)
      elif pending_w[s] and (wpol == "fill" or f_next is None or (f_in and not f_ok)):
        choice = ("W", pending_w[s][0])
      if choice is None:
        continue
      kind, (m, c) = choice
      vs = vstage_of(S, s, c, placement)
      dur = dur_of[kind]
      orders[s].append(Action(s, kind, m, c))
      free[s] = t + dur
      heapq.heappush(events, t + dur)
      if comm:
        heapq.heappush(events, t + dur + comm)
      progressed = True
      if kind == "F":
        fwd_order[s].remove((m, c))
        fwd_order[s].insert(nf[s], (m, c))
        nf[s] += 1
        live[s] += 1
        pending_b[s].append((m, c))
        fin[("F", vs, m)] = t + dur
        count += 1
      elif kind in ("B", "BW"):
        pending_b[s].remove((m, c))
        fin[("B", vs, m)] = t + dur
        count += 1
        if kind == "B":
          pending_w[s].append((m, c))
        else:
          live[s] -= 1
          count += 1
      else:
        pending_w[s].remove((m, c))
        live[s] -= 1
        count += 1
    while events and events[0] <= t:
      heapq.heappop(events)
    later = bool(events)
    idle = 0 if progressed or later else idle + 1
    if idle > 2 or (not later and not progressed):
      raise ScheduleError(
        f"schedule generation deadlocked at tick {t} (policy {pol}); "
        "use more microbatches or another schedule"
      )
    t = events[0] if later else t + 1  # the next finish: nothing changes before it
  return orders
