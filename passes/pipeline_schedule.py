"""pipeline_schedule: pipeline-parallel schedules as plain tables of actions.

Contract: `generate(name, stages, microbatches, chunks=1) -> PipelineSchedule`,
`PipelineSchedule.validate()` (raises `ScheduleError`, a `ValueError`), and
`PipelineSchedule.parse(text)` / `to_text()` (round-trip).

A schedule is a grid, stage x tick; each cell holds a tuple of small hashable
`Action`s: at most one compute action (F, B, W or the fused BW of GPipe and
1F1B) plus the transfers of that tick (SF/RF: send/receive an activation;
SB/RB: send/receive an input gradient). A send and its receive sit at the same
tick: the value arrives at the end of that tick. Text form of an action:
`{stage}{kind}{microbatch}[.{chunk}]`, e.g. `2B5` or `0F3.1` (chunk 1 of an
interleaved schedule).

Virtual stages (interleaved / modulo allocation): with `S` devices and `v`
chunks per device, chunk `c` of device `s` is virtual stage `c * S + s`, so
layer block `l` lives on device `l mod S` (the paper's modulo allocation with
k = 1 layer block per hop). ZB-V uses a V instead (`placement="v"`): device
`s` holds virtual stages `s` and `2S - 1 - s`.

Generators are pure functions: a greedy list scheduler picks, at each unit
tick and on each stage, the next action allowed by the schedule's policy (what
has priority, how many activations may be in flight, when W runs). The grid is
then the as-soon-as-possible tick placement of those per-stage orders, and the
transfers are added by `_lower_comms`. The validator, the simulator
(`passes.pipeline_simulate`), `plot()` and the executor
(`passes.pipeline_exec`) all read the same grid.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

COMPUTE = ("F", "B", "W", "BW")
COMMS = ("SF", "RF", "SB", "RB")
_ACTION_RE = re.compile(r"^(\d+)(BW|SF|RF|SB|RB|F|B|W)(\d+)(?:\.(\d+))?$")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
  """One action of one stage: `kind` of `microbatch` for virtual-stage `chunk`."""
  stage: int
  kind: str
  microbatch: int
  chunk: int = 0

  def __str__(self) -> str:
    c = f".{self.chunk}" if self.chunk else ""
    return f"{self.stage}{self.kind}{self.microbatch}{c}"

  @classmethod
  def parse(cls, text: str) -> Action:
    m = _ACTION_RE.match(text.strip())
    if m is None:
      raise ValueError(f"cannot parse pipeline action {text!r}; expected e.g. '2B5' "
                       "(stage 2, B of microbatch 5) or '0F3.1' (chunk 1)")
    return cls(int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4) or 0))


def vstage_of(S: int, stage: int, chunk: int, placement: str = "modulo") -> int:
  """Virtual stage of (device stage, chunk): modulo `chunk * S + stage`, or the
  V shape of ZB-V (chunk 0 goes down the devices, chunk 1 comes back up)."""
  if placement == "v":
    return stage if chunk == 0 else 2 * S - 1 - stage
  return chunk * S + stage


def place_of(S: int, vs: int, placement: str = "modulo") -> tuple[int, int]:
  """(device stage, chunk) of a virtual stage; inverse of `vstage_of`."""
  if placement == "v":
    return (vs, 0) if vs < S else (2 * S - 1 - vs, 1)
  return vs % S, vs // S


class ScheduleError(ValueError):
  """An invalid pipeline table; the message shows the grid with the bad action marked."""


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
  """A stage x tick table of actions. See the module docstring.

  `bound[s]` is the most (microbatch, chunk) activations stage `s` may hold
  (F done, W not yet done) -- the schedule's declared memory bound. `lag`: a
  value sent at tick t is received at tick t + lag (0: at the end of the
  producer's own tick; 1: during the next tick, so the executor can overlap the
  transfer with that tick's compute).
  """
  name: str
  stages: int
  microbatches: int
  chunks: int
  grid: tuple[tuple[tuple[Action, ...], ...], ...]
  bound: tuple[int, ...]
  lag: int = 0
  placement: str = "modulo"   # or "v" (ZB-V)

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
    """Per stage, its compute actions in tick order."""
    return tuple(tuple(a for cell in row for a in cell if a.kind in COMPUTE)
                 for row in self.grid)

  # --- text form ----------------------------------------------------------
  def to_text(self) -> str:
    head = (f"# {self.name} stages={self.stages} microbatches={self.microbatches} "
            f"chunks={self.chunks} bound={','.join(map(str, self.bound))}"
            + (f" lag={self.lag}" if self.lag else "")
            + (f" placement={self.placement}" if self.placement != "modulo" else ""))
    rows = [" ".join("+".join(map(str, cell)) or "." for cell in row) for row in self.grid]
    return "\n".join([head, *rows])

  @classmethod
  def parse(cls, text: str) -> PipelineSchedule:
    """Inverse of `to_text()`; does not validate (call `.validate()`)."""
    lines = [l for l in text.strip().splitlines() if l.strip()]
    if not lines or not lines[0].startswith("#"):
      raise ValueError("a pipeline table starts with '# name stages=S microbatches=M "
                       "chunks=V bound=b0,b1,...'")
    name, *fields = lines[0][1:].split()
    kv = dict(f.split("=", 1) for f in fields)
    grid = tuple(tuple(() if tok == "." else tuple(Action.parse(a) for a in tok.split("+"))
                       for tok in line.split()) for line in lines[1:])
    return cls(name, int(kv["stages"]), int(kv["microbatches"]), int(kv["chunks"]),
               grid, tuple(int(b) for b in kv["bound"].split(",")), int(kv.get("lag", 0)),
               kv.get("placement", "modulo"))

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
    from passes import pipeline_simulate
    return pipeline_simulate.simulate(self, costs, comm)

  def bubble_fraction(self, costs=None, comm: float = 0.0) -> float:
    """Idle share of `stages x makespan` when each action takes `costs[kind]`.

    `costs`: `{"F": tf, "B": tb, "W": tw}` per chunk (default all 1; BW = B + W).
    """
    return self.simulate(costs, comm).bubble_fraction

  def plot(self, costs=None, ax=None, comm: float = 0.0):
    from passes import pipeline_simulate
    return pipeline_simulate.plot(self, costs, ax=ax, comm=comm)


# --- rendering --------------------------------------------------------------
def render(sched: PipelineSchedule, mark: tuple[int, int] | None = None,
           max_ticks: int = 64) -> str:
  """The stage x tick grid of compute actions; `mark=(stage, tick)` is flagged `>..<`."""
  t0 = 0
  if mark is not None and mark[1] >= max_ticks:
    t0 = max(0, mark[1] - max_ticks // 2)
  t1 = min(sched.ticks, t0 + max_ticks)
  width = max([len(str(a)) for a in sched.compute_actions()] + [3]) + 2
  lines = [f"{sched.name}: {sched.stages} stages x {sched.ticks} ticks, "
           f"{sched.microbatches} microbatches, {sched.chunks} chunk(s)"]
  lines.append("tick  " + "".join(str(t).center(width) for t in range(t0, t1)))
  for s, row in enumerate(sched.grid):
    cells = []
    for t in range(t0, min(t1, len(row))):
      a = next((x for x in row[t] if x.kind in COMPUTE), None)
      txt = str(a) if a is not None else "."
      if mark == (s, t):
        txt = f">{txt}<"
      cells.append(txt.center(width))
    lines.append(f"s{s:<4} " + "".join(cells))
  if t1 < sched.ticks:
    lines.append(f"... {sched.ticks - t1} more ticks")
  return "\n".join(lines)


# --- dependencies -------------------------------------------------------------
def _deps(sched: PipelineSchedule, a: Action) -> list[tuple[str, int, int]]:
  """(kind, vstage, microbatch) the compute action `a` waits for; kind "B" means B or BW."""
  vs, last = sched.vstage(a.stage, a.chunk), sched.virtual_stages - 1
  if a.kind == "F":
    return [("F", vs - 1, a.microbatch)] if vs > 0 else []
  if a.kind in ("B", "BW"):
    d = [("F", vs, a.microbatch)]
    return d + ([("B", vs + 1, a.microbatch)] if vs < last else [])
  return [("B", vs, a.microbatch)]  # W


def validate(sched: PipelineSchedule) -> None:
  """Checks shapes, exactly-once, dependencies, transfers and the memory bound."""
  S, M, V = sched.stages, sched.microbatches, sched.chunks

  def fail(msg, where=None):
    raise ScheduleError(f"invalid pipeline schedule {sched.name!r}: {msg}\n"
                        + render(sched, where))

  if len(sched.grid) != S or len({len(r) for r in sched.grid}) > 1:
    fail(f"the grid must have {S} rows of equal length (one per stage)")
  if len(sched.bound) != S:
    fail(f"bound must list one number per stage ({S}), got {sched.bound}")
  done: dict[tuple[str, int, int], int] = {}
  sends: dict[tuple[str, int, int], tuple[int, int]] = {}  # (kind, vs, mb) -> (stage, tick)
  recvs: dict[tuple[str, int, int], tuple[int, int]] = {}
  for s, row in enumerate(sched.grid):
    for t, cell in enumerate(row):
      n_compute = 0
      for a in cell:
        if a.stage != s:
          fail(f"{a} is in row {s}; an action sits in its own stage's row", (s, t))
        if not (0 <= a.microbatch < M and 0 <= a.chunk < V):
          fail(f"{a}: microbatch must be in [0, {M}) and chunk in [0, {V})", (s, t))
        vs = sched.vstage(s, a.chunk)
        if a.kind in COMPUTE:
          n_compute += 1
          key = ("B" if a.kind == "BW" else a.kind, vs, a.microbatch)
          if key in done or (a.kind == "BW" and ("W", vs, a.microbatch) in done):
            fail(f"{a} runs twice; every F, B and W runs exactly once", (s, t))
          done[key] = t
          if a.kind == "BW":
            done[("W", vs, a.microbatch)] = t
        else:
          book = sends if a.kind[0] == "S" else recvs
          key = (a.kind[1], vs, a.microbatch)
          if key in book:
            fail(f"{a} appears twice", (s, t))
          book[key] = (s, t)
      if n_compute > 1:
        fail(f"stage {s} has {n_compute} compute actions at tick {t}; at most one", (s, t))
  # exactly once
  for vs in range(sched.virtual_stages):
    st, c = sched.place(vs)
    for m in range(M):
      for k in ("F", "B", "W"):
        if (k, vs, m) not in done:
          fail(f"{Action(st, k, m, c)} is missing; every F, B and W runs exactly once")
  # dependencies and transfers
  bw = {a for a in sched.compute_actions() if a.kind == "BW"}
  for t in range(sched.ticks):  # in tick order: the earliest violation is reported
    for s in range(S):
      for a in sched.grid[s][t]:
        if a.kind not in COMPUTE:
          continue
        if a.kind == "W" and Action(s, "BW", a.microbatch, a.chunk) in bw:
          continue
        for kind, dvs, m in _deps(sched, a):
          tp = done[(kind, dvs, m)]
          if tp >= t:
            ps, pc = sched.place(dvs)
            fail(f"{a} at tick {t} needs {Action(ps, kind, m, pc)} (tick {tp}) first", (s, t))
          ps, _ = sched.place(dvs)
          if ps != s:  # crosses devices: needs a send at tp and a receive at tp
            ch = "F" if kind == "F" else "B"
            if sends.get((ch, dvs, m)) != (ps, tp):
              fail(f"{a} needs S{ch}{m} from stage {ps} at tick {tp} (missing send)", (s, t))
            if recvs.get((ch, sched.vstage(s, a.chunk), m)) != (s, tp + sched.lag):
              fail(f"{a} needs R{ch} of microbatch {m} on stage {s} at tick "
                   f"{tp + sched.lag} (missing receive)", (s, t))
            if tp + sched.lag >= t:
              fail(f"{a} at tick {t} runs before its input arrives (tick "
                   f"{tp + sched.lag}, lag {sched.lag})", (s, t))
  for (ch, vs, m), (s, t) in sends.items():
    tvs = vs + 1 if ch == "F" else vs - 1
    if not 0 <= tvs < sched.virtual_stages:
      fail(f"S{ch}{m} on stage {s} has no destination stage", (s, t))
    ds, _ = sched.place(tvs)
    if recvs.get((ch, tvs, m)) != (ds, t + sched.lag):
      fail(f"the send {s}S{ch}{m} at tick {t} has no matching receive on stage {ds} "
           f"at tick {t + sched.lag}", (s, t))
    if done.get((ch, vs, m)) != t:
      fail(f"the send {s}S{ch}{m} at tick {t} is not at its producer's tick", (s, t))
  for (ch, vs, m), (s, t) in recvs.items():
    svs = vs - 1 if ch == "F" else vs + 1
    if not 0 <= svs < sched.virtual_stages or (ch, svs, m) not in sends:
      fail(f"the receive {s}R{ch}{m} at tick {t} has no matching send", (s, t))
  # memory bound
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
            fail(f"stage {s} holds {live} activations at tick {t}, over its bound "
                 f"{bound[s]}", (s, t))
        elif a.kind in ("W", "BW"):
          live -= 1
    peaks.append(peak)
  return tuple(peaks)


# --- generation -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Policy:
  """How the greedy generator chooses. `limit[s]`: in-flight activation bound."""
  fused: bool             # B and W as one BW action
  first: str              # "F": forwards before backwards (GPipe); "B": backward first
  w: str                  # "fill" (when idle), "eager" (right after B), "lazy" (when forced)
  limit: tuple[int, ...]   # activations held (F done, W not): the memory bound
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
    return Policy(False, "B", "fill", (2 * S - 1,) * S,
                  tuple(2 * (S - s) - 1 for s in range(S)))
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


def generate(name: str, stages: int, microbatches: int, chunks: int | None = None,
             lag: int = 0) -> PipelineSchedule:
  """Generates and validates a named schedule.

  Args:
    name: one of `SCHEDULES`.
    stages: pipeline stages (devices on the stage axis).
    microbatches: microbatches per step.
    chunks: virtual stages per device (only `interleaved`; default 2).
    lag: ticks a transfer takes after its producer's tick (0 or 1; see
      `PipelineSchedule`).

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
  orders = _greedy(stages, microbatches, chunks, pol, placement)
  if lag not in (0, 1):
    raise ValueError(f"lag must be 0 or 1, got {lag!r}")
  grid = _place(stages, microbatches, chunks, orders, lag, placement)
  sched = PipelineSchedule(name, stages, microbatches, chunks, _lower_comms(
      stages, chunks, grid, lag, placement), pol.limit, lag, placement)
  return sched.validate()


def _greedy(S: int, M: int, v: int, pol: Policy, placement: str = "modulo"
            ) -> list[list[Action]]:
  """Unit-time list scheduling (F = B = W = 1, BW = 2) under the policy."""
  V = S * v
  fin: dict[tuple[str, int, int], int] = {}   # finish tick (exclusive)
  free = [0] * S
  live = [0] * S
  fwd_order = [sorted(((m, c) for m in range(M) for c in range(v)),
                      key=lambda mc: (mc[0] // S, mc[1], mc[0] % S)) for _ in range(S)]
  nf = [0] * S
  pending_b: list[list[tuple[int, int]]] = [[] for _ in range(S)]
  pending_w: list[list[tuple[int, int]]] = [[] for _ in range(S)]
  orders: list[list[Action]] = [[] for _ in range(S)]
  total = S * M * v * 3
  count, t, idle = 0, 0, 0

  def ready(key):
    return key in fin and fin[key] <= t

  while count < total:
    progressed = False
    for s in range(S):
      if free[s] > t:
        continue
      # candidates
      b_ok = [(m, c) for m, c in pending_b[s]
              if (vs := vstage_of(S, s, c, placement)) == V - 1 or ready(("B", vs + 1, m))]
      b_ok.sort(key=lambda mc: (mc[0] // S, -mc[1], mc[0] % S))
      def f_ready(mc):
        vs = vstage_of(S, s, mc[1], placement)
        return vs == 0 or ready(("F", vs - 1, mc[0]))
      rest = fwd_order[s][nf[s]:]
      if placement == "v":  # any arrived forward, the deeper chunk first
        cands = sorted((mc for mc in rest if f_ready(mc)), key=lambda mc: (-mc[1], mc[0]))
        f_next = cands[0] if cands else (rest[0] if rest else None)
      else:
        f_next = rest[0] if rest else None
      f_in = f_next is not None and f_ready(f_next)
      f_ok = (f_in and live[s] < pol.limit[s]
              and len(pending_b[s]) < pol.limit_b[s])
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
      dur = 2 if kind == "BW" else 1
      orders[s].append(Action(s, kind, m, c))
      free[s] = t + dur
      progressed = True
      if kind == "F":
        fwd_order[s].remove((m, c))
        fwd_order[s].insert(nf[s], (m, c))
        nf[s] += 1
        live[s] += 1
        pending_b[s].append((m, c))
        fin[("F", vs, m)] = t + 1
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
    idle = 0 if progressed or any(f > t for f in free) else idle + 1
    if idle > 2:
      raise ScheduleError(f"schedule generation deadlocked at tick {t} (policy {pol}); "
                          "use more microbatches or another schedule")
    t += 1
  return orders


def _place(S: int, M: int, v: int, orders: Sequence[Sequence[Action]], lag: int = 0,
           placement: str = "modulo") -> list[list[list[Action]]]:
  """As-soon-as-possible unit-tick placement of per-stage orders."""
  V = S * v
  done: dict[tuple[str, int, int], int] = {}
  pos = [0] * S
  grid: list[list[list[Action]]] = [[] for _ in range(S)]
  t = idle = 0
  while any(pos[s] < len(orders[s]) for s in range(S)):
    placed = []
    for s in range(S):
      if pos[s] >= len(orders[s]):
        continue
      a = orders[s][pos[s]]
      vs = vstage_of(S, s, a.chunk, placement)
      if a.kind == "F":
        need = [("F", vs - 1)] if vs > 0 else []
      elif a.kind in ("B", "BW"):
        need = [("F", vs)] + ([("B", vs + 1)] if vs < V - 1 else [])
      else:
        need = [("B", vs)]
      if all(done.get((k, d, a.microbatch), t)
             + (lag if place_of(S, d, placement)[0] != s else 0) < t
             for k, d in need):
        placed.append(a)
    for s in range(S):
      grid[s].append([])
    idle = 0 if placed else idle + 1
    if idle > lag + 1:  # nothing placed and nothing still in transit
      raise ScheduleError(f"per-stage orders deadlock at tick {t}")
    for a in placed:
      grid[a.stage][t].append(a)
      pos[a.stage] += 1
      vs = vstage_of(S, a.stage, a.chunk, placement)
      done[("B" if a.kind == "BW" else a.kind, vs, a.microbatch)] = t
    t += 1
  return grid


def _lower_comms(S: int, v: int, grid, lag: int = 0, placement: str = "modulo"
                 ) -> tuple[tuple[tuple[Action, ...], ...], ...]:
  """Adds the send/receive pair of every value crossing devices, at its producer's tick."""
  V = S * v
  out = [[list(cell) for cell in row] for row in grid]
  for s, row in enumerate(grid):
    for t, cell in enumerate(row):
      for a in cell:
        vs = vstage_of(S, s, a.chunk, placement)
        if a.kind == "F" and vs < V - 1:
          tvs = vs + 1
          ch = "F"
        elif a.kind in ("B", "BW") and vs > 0:
          tvs = vs - 1
          ch = "B"
        else:
          continue
        ds, dc = place_of(S, tvs, placement)
        if ds == s:  # same device (one-stage interleaving): no transfer
          continue
        out[s][t].append(Action(s, "S" + ch, a.microbatch, a.chunk))
        out[ds][t + lag].append(Action(ds, "R" + ch, a.microbatch, dc))
  return tuple(tuple(tuple(cell) for cell in row) for row in out)
