"""pipeline.schedule: pipeline-parallel schedules as plain tables of actions.

Contract: `PipelineSchedule.validate()` (raises `ScheduleError`, a `ValueError`), and
`PipelineSchedule.parse(text)` / `to_text()` (round-trip).

A schedule is a grid, stage x tick; each cell holds a tuple of small hashable
`Action`s: at most one compute action (F, B, W or the fused BW of GPipe and
1F1B) plus the transfers of that tick (SF/RF: send/receive an activation;
SB/RB: send/receive an input gradient). A send and its receive sit at the same
tick: the value arrives at the end of that tick. Text form of an action:
`{stage}{kind}{microbatch}[.{chunk}]`, e.g. `2B5` or `0F3.1` (chunk 1 of an
interleaved schedule).

Several training steps (`tile(sched, steps)`, `passes.pipeline.steps`): one
table holds `steps` consecutive steps; an action's `step` says which (`1F0@1`),
and the update `U` of each (stage, chunk) after its step's last W sits in that
W's cell. Step t + 1's forwards on a stage wait for that stage's U of step t
only, so its warm-up overlaps step t's drain on the other stages.

Virtual stages (interleaved / modulo allocation): with `S` devices and `v`
chunks per device, chunk `c` of device `s` is virtual stage `c * S + s`, so
layer block `l` lives on device `l mod S` (the paper's modulo allocation with
k = 1 layer block per hop). ZB-V uses a V instead (`placement="v"`): device
`s` holds virtual stages `s` and `2S - 1 - s`.

Generators (`passes.pipeline.generate`) are pure functions returning these
tables. The validator, the simulator
(`passes.pipeline.simulate`), `plot()` and the executor
(`passes.pipeline.execute`) all read the same grid.
"""

from __future__ import annotations

import dataclasses

from ooojax.passes.pipeline import simulate as _simulate
from ooojax.passes.pipeline.actions import (
  COMMS,
  COMPUTE,
  UPDATE,
  Action,
  ScheduleError,
  deps,
  place_of,
  vstage_of,
)

__all__ = [
  "COMMS",
  "COMPUTE",
  "UPDATE",
  "Action",
  "PipelineSchedule",
  "ScheduleError",
  "place_of",
  "render",
  "validate",
  "vstage_of",
]


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
  """A stage x tick table of actions. See the module docstring.

  `bound[s]` is the most (microbatch, chunk) activations stage `s` may hold
  (F done, W not yet done) -- the schedule's declared memory bound. `lag`: a
  value sent at tick t is received at tick t + lag (0: at the end of the
  producer's own tick; 1: during the next tick, so the executor can overlap the
  transfer with that tick's compute). `steps`: training steps in the table
  (more than 1 only from `tile`); `microbatches` is per step.
  """

  name: str
  stages: int
  microbatches: int
  chunks: int
  grid: tuple[tuple[tuple[Action, ...], ...], ...]
  bound: tuple[int, ...]
  lag: int = 0
  placement: str = "modulo"  # or "v" (ZB-V)
  steps: int = 1

  # --- shape --------------------------------------------------------------
  @property
  def ticks(self) -> int:
    return len(self.grid[0]) if self.grid else 0

  @property
  def virtual_stages(self) -> int:
    return self.stages * self.chunks

  @property
  def fused(self) -> bool:
    return any(a.kind == "BW" for a in self.compute_actions())

  def vstage(self, stage: int, chunk: int) -> int:
    return vstage_of(self.stages, stage, chunk, self.placement)

  def place(self, vstage: int) -> tuple[int, int]:
    """(device stage, chunk) of a virtual stage."""
    return place_of(self.stages, vstage, self.placement)

  def compute(self, stage: int, tick: int) -> Action | None:
    for a in self.grid[stage][tick]:
      if a.kind in COMPUTE:
        return a
    return None

  def compute_actions(self):
    for row in self.grid:
      for cell in row:
        for a in cell:
          if a.kind in COMPUTE:
            yield a

  def orders(self) -> tuple[tuple[Action, ...], ...]:
    """Per stage, its compute and update (U) actions in tick order."""
    return tuple(
      tuple(a for cell in row for a in cell if a.kind in COMPUTE or a.kind == UPDATE)
      for row in self.grid
    )

  # --- text form ----------------------------------------------------------
  def to_text(self) -> str:
    head = (
      f"# {self.name} stages={self.stages} microbatches={self.microbatches} "
      f"chunks={self.chunks} bound={','.join(map(str, self.bound))}"
      + (f" lag={self.lag}" if self.lag else "")
      + (f" placement={self.placement}" if self.placement != "modulo" else "")
      + (f" steps={self.steps}" if self.steps != 1 else "")
    )
    rows = [" ".join("+".join(map(str, cell)) or "." for cell in row) for row in self.grid]
    return "\n".join([head, *rows])

  @classmethod
  def parse(cls, text: str) -> PipelineSchedule:
    """Inverse of `to_text()`; does not validate (call `.validate()`)."""
    lines = [l for l in text.strip().splitlines() if l.strip()]
    if not lines or not lines[0].startswith("#"):
      raise ValueError(
        "a pipeline table starts with '# name stages=S microbatches=M chunks=V bound=b0,b1,...'"
      )
    name, *fields = lines[0][1:].split()
    kv = dict(f.split("=", 1) for f in fields)
    grid = tuple(
      tuple(
        () if tok == "." else tuple(Action.parse(a) for a in tok.split("+")) for tok in line.split()
      )
      for line in lines[1:]
    )
    return cls(
      name,
      int(kv["stages"]),
      int(kv["microbatches"]),
      int(kv["chunks"]),
      grid,
      tuple(int(b) for b in kv["bound"].split(",")),
      int(kv.get("lag", 0)),
      kv.get("placement", "modulo"),
      int(kv.get("steps", 1)),
    )

  def __str__(self) -> str:
    return render(self)

  # --- checks and metrics (thin: the work is in the functions below) -------
  def validate(self) -> PipelineSchedule:
    """Raises `ScheduleError` (a `ValueError`) unless the table is valid; returns self."""
    validate(self)
    return self

  def peak_activations(self) -> tuple[int, ...]:
    """Per stage, the most (microbatch, chunk) activations held at once (F done, W not).

    An interleaved chunk holds 1/chunks of a whole stage's activations.
    """
    return _peaks(self)

  def simulate(self, costs=None, comm: float = 0.0):
    return _simulate.simulate(self, costs, comm)

  def bubble_fraction(self, costs=None, comm: float = 0.0) -> float:
    """Idle share of `stages x makespan` when each action takes `costs[kind]`.

    `costs`: `{"F": tf, "B": tb, "W": tw}` per chunk (default all 1; BW = B + W).
    """
    return self.simulate(costs, comm).bubble_fraction

  def plot(self, costs=None, ax=None, comm: float = 0.0):
    return _simulate.plot(self, costs, ax=ax, comm=comm)

  # --- several steps (passes.pipeline.steps) -----------------------------
  def tile(self, steps: int) -> PipelineSchedule:
    """`steps` consecutive steps of this table in one; see `passes.pipeline.steps.tile`."""
    from ooojax.passes.pipeline import steps as _steps

    return _steps.tile(self, steps)

  def steady_state(self, steps: int = 4, costs=None, comm: float = 0.0):
    """Per-step times and bubbles of this table tiled over `steps` (simulated)."""
    from ooojax.passes.pipeline import steps as _steps

    return _steps.steady_state(self, steps, costs, comm)

  def steady_bubble(self, steps: int = 4, costs=None, comm: float = 0.0) -> float:
    """Idle share of the last of `steps` tiled steps (simulated): the steady state."""
    return self.steady_state(steps, costs, comm).steady_bubble


# --- rendering --------------------------------------------------------------
def _cell_text(cell) -> str:
  """A cell's compute action, with `+U` when a stage's update follows it."""
  a = next((x for x in cell if x.kind in COMPUTE), None)
  txt = str(a) if a is not None else ""
  if any(x.kind == UPDATE for x in cell):
    txt += "+U" if txt else str(next(x for x in cell if x.kind == UPDATE))
  return txt or "."


def render(
  sched: PipelineSchedule, mark: tuple[int, int] | None = None, max_ticks: int = 64
) -> str:
  """The stage x tick grid of compute actions; `mark=(stage, tick)` is flagged `>..<`."""
  t0 = 0
  if mark is not None and mark[1] >= max_ticks:
    t0 = max(0, mark[1] - max_ticks // 2)
  t1 = min(sched.ticks, t0 + max_ticks)
  width = max([len(_cell_text(c)) for row in sched.grid for c in row] + [3]) + 2
  steps = f", {sched.steps} steps" if sched.steps != 1 else ""
  lines = [
    f"{sched.name}: {sched.stages} stages x {sched.ticks} ticks, "
    f"{sched.microbatches} microbatches, {sched.chunks} chunk(s){steps}"
  ]
  lines.append("tick  " + "".join(str(t).center(width) for t in range(t0, t1)))
  for s, row in enumerate(sched.grid):
    cells = []
    for t in range(t0, min(t1, len(row))):
      txt = _cell_text(row[t])
      if mark == (s, t):
        txt = f">{txt}<"
      cells.append(txt.center(width))
    lines.append(f"s{s:<4} " + "".join(cells))
  if t1 < sched.ticks:
    lines.append(f"... {sched.ticks - t1} more ticks")
  return "\n".join(lines)


def _at(step: int) -> str:
  return f"@{step}" if step else ""


def _deps(sched: PipelineSchedule, a: Action) -> list[tuple[str, int, int, int]]:
  return deps(a, sched.vstage(a.stage, a.chunk), sched.virtual_stages - 1, sched.microbatches)


def validate(sched: PipelineSchedule) -> None:
  """Checks shapes, exactly-once, dependencies (across steps too), transfers and
  the memory bound."""
  S, M, V, N = sched.stages, sched.microbatches, sched.chunks, sched.steps

  def fail(msg, where=None):
    raise ScheduleError(f"invalid pipeline schedule {sched.name!r}: {msg}\n" + render(sched, where))

  if len(sched.grid) != S or len({len(r) for r in sched.grid}) > 1:
    fail(f"the grid must have {S} rows of equal length (one per stage)")
  if len(sched.bound) != S:
    fail(f"bound must list one number per stage ({S}), got {sched.bound}")
  if not (isinstance(N, int) and N >= 1):
    fail(f"steps must be an int >= 1, got {N!r}")
  # Keys: (kind, virtual stage, microbatch, step); "B" also stands for BW.
  done: dict[tuple[str, int, int, int], int] = {}
  sends: dict[tuple[str, int, int, int], tuple[int, int]] = {}  # -> (stage, tick)
  recvs: dict[tuple[str, int, int, int], tuple[int, int]] = {}
  for s, row in enumerate(sched.grid):
    for t, cell in enumerate(row):
      n_compute = 0
      for a in cell:
        if a.stage != s:
          fail(f"{a} is in row {s}; an action sits in its own stage's row", (s, t))
        if not (0 <= a.microbatch < M and 0 <= a.chunk < V and 0 <= a.step < N):
          fail(
            f"{a}: microbatch must be in [0, {M}), chunk in [0, {V}) and step in [0, {N})", (s, t)
          )
        vs = sched.vstage(s, a.chunk)
        if a.kind in COMPUTE:
          n_compute += 1
          key = ("B" if a.kind == "BW" else a.kind, vs, a.microbatch, a.step)
          if key in done or (a.kind == "BW" and ("W", *key[1:]) in done):
            fail(f"{a} runs twice; every F, B and W runs exactly once", (s, t))
          done[key] = t
          if a.kind == "BW":
            done[("W", *key[1:])] = t
        elif a.kind == UPDATE:
          key = (UPDATE, vs, 0, a.step)
          if key in done:
            fail(f"{a} runs twice; a stage's update runs once per step", (s, t))
          done[key] = t
        else:
          book = sends if a.kind[0] == "S" else recvs
          key = (a.kind[1], vs, a.microbatch, a.step)
          if key in book:
            fail(f"{a} appears twice", (s, t))
          book[key] = (s, t)
      if n_compute > 1:
        fail(f"stage {s} has {n_compute} compute actions at tick {t}; at most one", (s, t))
  # exactly once
  updates = any(k[0] == UPDATE for k in done)
  if N > 1 and not updates:
    fail(
      f"a table of {N} steps needs each stage's update U after each step's last W; "
      "build it with tile(sched, steps)"
    )
  for step in range(N):
    for vs in range(sched.virtual_stages):
      st, c = sched.place(vs)
      for m in range(M):
        for k in ("F", "B", "W"):
          if (k, vs, m, step) not in done:
            fail(
              f"{Action(st, k, m, c, step)} is missing; every F, B and W runs exactly "
              "once" + (" per step" if N > 1 else "")
            )
      if updates and (UPDATE, vs, 0, step) not in done:
        fail(
          f"{Action(st, UPDATE, 0, c, step)} is missing; with updates in the table "
          "every (stage, chunk) has one per step"
        )
  # dependencies and transfers
  bw = {a for a in sched.compute_actions() if a.kind == "BW"}
  for t in range(sched.ticks):  # in tick order: the earliest violation is reported
    for s in range(S):
      for a in sched.grid[s][t]:
        if a.kind not in COMPUTE and a.kind != UPDATE:
          continue
        if a.kind == "W" and Action(s, "BW", a.microbatch, a.chunk, a.step) in bw:
          continue
        for kind, dvs, m, step in _deps(sched, a):
          tp = done[(kind, dvs, m, step)]
          ps, pc = sched.place(dvs)
          # An update runs after its W in the same tick; everything else a tick later.
          if tp > t or (tp == t and a.kind != UPDATE):
            why = (
              "; step t + 1's forwards read the weights that stage's update of step t writes"
              if kind == UPDATE
              else "; a stage's update waits for every W of its step"
              if a.kind == UPDATE
              else ""
            )
            fail(
              f"{a} at tick {t} needs {Action(ps, kind, m, pc, step)} (tick {tp}) first{why}",
              (s, t),
            )
          if ps != s:  # crosses devices: needs a send at tp and a receive at tp
            ch = "F" if kind == "F" else "B"
            if sends.get((ch, dvs, m, step)) != (ps, tp):
              fail(
                f"{a} needs S{ch}{m}{_at(step)} from stage {ps} at tick {tp} (missing send)", (s, t)
              )
            if recvs.get((ch, sched.vstage(s, a.chunk), m, step)) != (s, tp + sched.lag):
              fail(
                f"{a} needs R{ch} of microbatch {m}{_at(step)} on stage {s} at tick "
                f"{tp + sched.lag} (missing receive)",
                (s, t),
              )
            if tp + sched.lag >= t:
              fail(
                f"{a} at tick {t} runs before its input arrives (tick "
                f"{tp + sched.lag}, lag {sched.lag})",
                (s, t),
              )
  for (ch, vs, m, step), (s, t) in sends.items():
    tvs = vs + 1 if ch == "F" else vs - 1
    if not 0 <= tvs < sched.virtual_stages:
      fail(f"S{ch}{m}{_at(step)} on stage {s} has no destination stage", (s, t))
    ds, _ = sched.place(tvs)
    if recvs.get((ch, tvs, m, step)) != (ds, t + sched.lag):
      fail(
        f"the send {s}S{ch}{m}{_at(step)} at tick {t} has no matching receive on stage {ds} "
        f"at tick {t + sched.lag}",
        (s, t),
      )
    if done.get((ch, vs, m, step)) != t:
      fail(f"the send {s}S{ch}{m}{_at(step)} at tick {t} is not at its producer's tick", (s, t))
  for (ch, vs, m, step), (s, t) in recvs.items():
    svs = vs - 1 if ch == "F" else vs + 1
    if not 0 <= svs < sched.virtual_stages or (ch, svs, m, step) not in sends:
      fail(f"the receive {s}R{ch}{m}{_at(step)} at tick {t} has no matching send", (s, t))
  # memory bound: per stage over the whole table, so across steps too
  peaks = _peaks(sched, sched.bound, fail)
  del peaks


def _peaks(sched: PipelineSchedule, bound=None, fail=None) -> tuple[int, ...]:
  peaks = []
  for s, row in enumerate(sched.grid):
    live = peak = 0
    for t, cell in enumerate(row):
      for a in cell:
        if a.kind == "F":
          live += 1
          peak = max(peak, live)
          if bound is not None and live > bound[s]:
            fail(
              f"stage {s} holds {live} activations at tick {t}, over its bound {bound[s]}", (s, t)
            )
        elif a.kind in ("W", "BW"):
          live -= 1
    peaks.append(peak)
  return tuple(peaks)
