"""simulate: replay a `Schedule` on a fluid model of one device with streams.

Contract: `simulate(streams, units, sync) -> Timeline`.

Each stream runs its actions in order. An action starts once its stream is
free and every unit it depends on has finished (plus `sync` seconds when that
unit ran on another stream). Concurrent actions share the device: each one
alone keeps a share `util` of it busy, and when the shares of the running
actions add up to more than 1 they all slow down by that sum (processor
sharing). Overlap is therefore only free for work that leaves the device
partly idle: small, launch-bound kernels. Streams listed in `links` are
network links instead: their actions (transfers) run in order on the link
and do not load the device. All times are cost-model estimates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from ooojax.passes.ir import Action, Unit


@dataclasses.dataclass(frozen=True)
class Link:
  """A network link: a transfer of `n` bytes takes `latency + n / bandwidth`."""

  name: str
  latency: float  # seconds
  bandwidth: float  # bytes per second

  def seconds(self, nbytes: float) -> float:
    return self.latency + nbytes / self.bandwidth


# Collectives XLA:GPU keeps in flight at once (its scheduler's default, per kind):
# a collective's start comes after the previous one's done.
COLLECTIVES_IN_FLIGHT = 1

LINKS = {
  "nvlink": Link("nvlink", 2e-6, 450e9),  # H100 NVLink 4, per direction
  "100GbE": Link("100GbE", 10e-6, 100e9 / 8),
  "25GbE": Link("25GbE", 15e-6, 25e9 / 8),
  "10GbE": Link("10GbE", 20e-6, 10e9 / 8),
}


@dataclasses.dataclass
class LinkQueue:
  """Collectives on one link next to a compute stream: the rule `passes.hlo.replay` and
  the data-parallel planner (`passes.collectives.costs.one_in_flight`) share.

  A start queues its transfer behind the link's previous one (one link serialises
  them); a done waits for its transfer (the compute stream stalls until it ends).
  `in_flight`: XLA:GPU's latency-hiding scheduler keeps at most this many
  collectives started and not done (its default: one), so a start beyond it
  forces the oldest one's done first. None: no limit (a compiled program's
  order already holds XLA's).
  """

  in_flight: int | None = COLLECTIVES_IN_FLIGHT
  free: float = 0.0  # when the link finishes what it was given
  open: list = dataclasses.field(default_factory=list)  # ends of started, not done

  def start(self, t: float, seconds: float) -> tuple[float, float, float]:
    """A collective reached at compute clock `t`: (the clock once it is issued,
    its transfer's start, its end)."""
    while self.in_flight is not None and len(self.open) >= self.in_flight:
      t = max(t, self.open.pop(0))  # the oldest's done, forced here
    start = max(t, self.free)
    self.free = end = start + seconds
    self.open.append(end)
    return t, start, end

  def done(self, t: float, end: float) -> float:
    """The compute clock after the done of the transfer ending at `end`."""
    if end in self.open:
      self.open.remove(end)
    return max(t, end)

  def copy(self) -> LinkQueue:
    return dataclasses.replace(self, open=list(self.open))


@dataclasses.dataclass(frozen=True)
class Span:
  unit: str
  stream: int
  start: float
  end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
  spans: tuple[Span, ...]
  makespan: float

  def per_stream(self) -> dict[int, list[Span]]:
    out: dict[int, list[Span]] = {}
    for s in self.spans:
      out.setdefault(s.stream, []).append(s)
    return out


class DeadlockError(ValueError):
  """The schedule waits on a unit that can never run before it."""


def simulate(
  streams: Sequence[Sequence[Action]],
  units: Sequence[Unit],
  sync: float = 0.0,
  links: Collection[int] = (),
) -> Timeline:
  """Runs the schedule and returns per-unit spans and the makespan.

  >>> from ooojax.passes.ir import Action, Unit, UnitKind
  >>> a = Unit(UnitKind.DX, 0, (), (), cost=1.0, util=0.5)
  >>> b = Unit(UnitKind.DW, 0, (), (), cost=1.0, util=0.5)
  >>> simulate([[Action("X", 0, 0)], [Action("W", 0, 1)]], [a, b]).makespan
  1.0
  """
  by_name = {u.name: u for u in units}
  queues = [list(q) for q in streams]
  where = {a.unit: i for i, q in enumerate(queues) for a in q}
  pos = [0] * len(queues)
  done: dict[str, float] = {}
  running: dict[int, list] = {}  # stream -> [unit, remaining solo seconds, start]
  spans: list[Span] = []
  now = 0.0
  total = len(where)

  def ready_at(s: int) -> float | None:
    """When the head of stream `s` may start, or None while a dep is unfinished."""
    t = 0.0
    for d in by_name[queues[s][pos[s]].unit].deps:
      if d not in where:
        continue  # not scheduled (e.g. empty): nothing to wait for
      if d not in done:
        return None
      t = max(t, done[d] + (sync if where[d] != s else 0.0))
    return t

  while len(done) < total:
    waiting = {}
    for s in range(len(queues)):
      if s in running or pos[s] >= len(queues[s]):
        continue
      t = ready_at(s)
      if t is not None and t <= now + 1e-15:
        running[s] = [by_name[queues[s][pos[s]].unit], by_name[queues[s][pos[s]].unit].cost, now]
      elif t is not None:
        waiting[s] = t
    if not running:
      if not waiting:
        heads = [queues[s][pos[s]].unit for s in range(len(queues)) if pos[s] < len(queues[s])]
        raise DeadlockError(
          f"schedule deadlocks: {heads} wait on units that never "
          "finish; check the stream order against the deps"
        )
      now = min(waiting.values())
      continue
    load = sum(r[0].util for s, r in running.items() if s not in links)
    rates = {s: 1.0 if s in links else 1.0 / max(1.0, load) for s in running}
    step = min(r[1] / rates[s] for s, r in running.items())
    if waiting:
      step = min(step, min(waiting.values()) - now)
    now += step
    for s in list(running):
      r = running[s]
      r[1] -= step * rates[s]
      if r[1] <= 1e-15:
        done[r[0].name] = now
        spans.append(Span(r[0].name, s, r[2], now))
        pos[s] += 1
        del running[s]
  return Timeline(tuple(spans), now)
