"""pipeline.link: replay a pipeline table with its transfers on a link of finite bandwidth.

Contract: `simulate_link(sched, costs, link, mode) -> LinkTimeline` (simulated,
never measured); `LinkModel` (latency, bandwidth, duplex, blocking send, per-tick
cost) with presets from `passes.simulate.LINKS` (`LinkModel.of("10GbE", nbytes)`).

`passes.pipeline.simulate` prices a transfer as a delay: every value arrives
`comm` seconds after its producer ends, however many cross the same link at
once. Here each link is a resource. A transfer of `nbytes` occupies it for
`nbytes / bandwidth` seconds and arrives `latency` after its last byte, and
transfers queue on it first come, first served. A duplex link (Ethernet,
NVLink) is one resource per direction; a shaped loopback (one tbf qdisc on
`lo`, what `benchmarks/pipeline_mp.py --link-gbit` runs on) is one resource
both directions share.

Two ways a table can run (`mode`):

- `"executor"`: what `passes.pipeline.execute` does. Each device runs the
  table's ticks in order, a fused BW as B then W on ticks of their own
  (`generate.unfuse`, as the executor's plan does): the input gradient leaves
  after B. A tick costs its compute action (nothing on an idle
  tick) plus `link.tick`, the loop body's fixed cost (the switch, the slot
  writes). With lag 0 the tick's transfers follow its compute: a `ppermute`
  over the pairs that carry a value this tick (none: no collective at all).
  gloo's collective permute (and NCCL's send/recv) is a rendezvous: the bytes
  leave once the sender and the receiver have both reached it, the receiver
  leaves when they have arrived, and the sender leaves when its bytes are
  written (at once with `blocking_send=False`, after the wire time with
  True). Transfers that leave together on one resource share it and finish
  together (TCP's fair share between flows); later ones queue behind them.
  With lag 1 every tick but the first starts with the exchange of the
  previous tick's output over every pair the table uses (filler included: the
  executor sends unconditionally so that XLA may overlap it), then computes;
  a CPU runs the exchange before the compute, so nothing overlaps.
- `"overlap"`: transfers run beside compute (asynchronous collectives, the
  OOO BackProp paper's runtime): each stage runs its actions in the table's
  order as soon as their inputs have arrived; a transfer leaves when its
  producer ends and queues on its link. This is the floor a pipeline reaches
  when the link, not the executor, sets the pace.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Mapping, Sequence

from ooojax.passes.pipeline.actions import COMPUTE, UPDATE, Action, ScheduleError, deps, done
from ooojax.passes.pipeline.generate import unfuse
from ooojax.passes.pipeline.simulate import PipelineTimeline

__all__ = ["LinkModel", "LinkTimeline", "Transfer", "one_way_groups", "simulate_link"]


@dataclasses.dataclass(frozen=True)
class LinkModel:
  """A link between neighbouring stages and what one transfer on it carries.

  `latency` (s, one way), `bandwidth` (bytes/s; `math.inf`: free wire time),
  `nbytes` per transfer (one activation or input gradient), `duplex`: each
  direction its own resource (False: one resource both share, a shaped
  loopback), `blocking_send`: the sender waits for its bytes' wire time too,
  `tick`: seconds every executor tick costs besides its action; `one_way`:
  the executor runs each exchange as one-way permutes in a row (its CPU / gloo
  lowering, `execute.one_way`), each paying `latency` on its own; `burst`:
  bytes a token-bucket shaper (tbf) lets through at once after an idle spell
  (it refills at `bandwidth`; 0: every byte pays the wire).
  """

  latency: float = 0.0
  bandwidth: float = math.inf
  nbytes: float = 0.0
  duplex: bool = True
  blocking_send: bool = False
  tick: float = 0.0
  one_way: bool = False
  burst: float = 0.0
  name: str = ""

  @property
  def wire(self) -> float:
    """Seconds one transfer occupies its resource."""
    return self.nbytes / self.bandwidth if self.nbytes else 0.0

  def seconds(self, n: int = 1) -> float:
    """Seconds until the last of `n` transfers leaving together on one resource arrives."""
    return self.latency + n * self.wire

  @classmethod
  def of(cls, link, nbytes: float, **kw) -> LinkModel:
    """From a `passes.simulate.Link` or a preset name ("10GbE", "25GbE", "100GbE",
    "nvlink"), carrying `nbytes` per transfer."""
    from ooojax.passes.collectives.plan import get_link

    lk = get_link(link)
    return cls(lk.latency, lk.bandwidth, nbytes, name=lk.name, **kw)

  @classmethod
  def shaped_loopback(
    cls, gbit: float | None, nbytes: float, latency: float = 0.0, **kw
  ) -> LinkModel:
    """A loopback shaped to `gbit` Gbit/s (None: unshaped, free wire time): one
    resource for both directions."""
    bw = math.inf if gbit is None else gbit * 1e9 / 8
    return cls(
      latency,
      bw,
      nbytes,
      duplex=False,
      name="loopback" + (f" {gbit:g} Gbit/s" if gbit else ""),
      **kw,
    )


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One value crossing devices: leaves at `start`, arrives at `end`."""

  src: int
  dst: int
  kind: str  # "F" (an activation) or "B" (an input gradient); "X": lag 1 filler
  microbatch: int
  start: float
  end: float


@dataclasses.dataclass(frozen=True)
class LinkTimeline(PipelineTimeline):
  """Compute spans and transfers of one replay; `makespan` is the step time."""

  transfers: tuple[Transfer, ...] = ()
  mode: str = "executor"

  @property
  def link_busy(self) -> float:
    """Seconds transfers spent in flight, summed (they may overlap)."""
    return sum(t.end - t.start for t in self.transfers)


def _costs(costs, V: int) -> list[dict]:
  """Per virtual stage, {"F", "B", "W", "U"} seconds of one chunk."""
  base = {"F": 1.0, "B": 1.0, "W": 1.0, UPDATE: 0.0}
  if costs is None or isinstance(costs, Mapping):
    return [{**base, **(costs or {})}] * V
  if len(costs) != V:
    raise ValueError(
      f"costs lists {len(costs)} stages; give one mapping or one per virtual stage ({V})"
    )
  return [{**base, **c} for c in costs]


def _dur(c: Mapping[str, float], kind: str, chunks: int) -> float:
  return (c["B"] + c["W"]) / chunks if kind == "BW" else c[kind] / chunks


class _Wire:
  """Resources: first come, first served; transfers leaving together share."""

  def __init__(self, link: LinkModel):
    self.link, self.free, self.tokens = link, {}, {}

  def key(self, src: int, dst: int):
    return (src, dst) if self.link.duplex else (min(src, dst), max(src, dst))

  def send(self, ready: float, pairs: Sequence[tuple[int, int]]) -> dict:
    """(src, dst) -> (start, last byte out) for transfers all ready at `ready`."""
    groups: dict = {}
    for p in pairs:
      groups.setdefault(self.key(*p), []).append(p)
    out = {}
    lk = self.link
    for k, ps in groups.items():
      free = self.free.get(k, 0.0)
      start = max(ready, free)
      done = start + len(ps) * lk.wire
      if lk.burst and lk.wire:  # tokens saved while idle let bytes through at once
        tokens = min(lk.burst, self.tokens.get(k, lk.burst) + (start - free) * lk.bandwidth)
        nbytes = len(ps) * lk.nbytes
        done = start + max(nbytes - tokens, 0.0) / lk.bandwidth
        self.tokens[k] = max(tokens - nbytes, 0.0)
      self.free[k] = done
      out.update({p: (start, done) for p in ps})
    return out


def simulate_link(
  sched, costs=None, link: LinkModel | None = None, mode: str = "executor"
) -> LinkTimeline:
  """Replays `sched` with per-action `costs` on `link`; see the module doc.

  `costs`: `{"F", "B", "W"}` seconds per whole stage (an interleaved chunk
  costs 1 / chunks, BW = B + W), or one such mapping per virtual stage (the
  first stage's F embeds, the last's computes the loss).

  >>> from ooojax.passes.pipeline.generate import generate
  >>> lk = LinkModel(latency=0.0, bandwidth=1.0, nbytes=1.0)    # a transfer: 1 unit
  >>> simulate_link(generate("gpipe", 2, 2), None, lk, "overlap").makespan
  11.0
  """
  link = link or LinkModel()
  if mode not in ("executor", "overlap"):
    raise ValueError(f"mode must be 'executor' or 'overlap', got {mode!r}")
  if sched.steps != 1 and mode == "executor" and sched.lag:
    raise ValueError("the executor replay of a lag-1 table takes a one-step table")
  cs = _costs(costs, sched.virtual_stages)
  if mode == "overlap":
    return _overlap(sched, cs, link)
  return _executor(unfuse(sched), cs, link)  # the ticks the executor runs


def _executor(sched, cs, link: LinkModel) -> LinkTimeline:
  S, v = sched.stages, sched.chunks
  clock = [0.0] * S
  wire = _Wire(link)
  spans, transfers = [], []
  # lag 1: every pair the table ever sends over (what the executor's rings carry)
  ring = sorted(
    {
      (a.stage, _dest(sched, a))
      for row in sched.grid
      for cell in row
      for a in cell
      if a.kind[0] == "S"
    }
    - {(s, s) for s in range(S)}
  )
  moves = bool(ring)

  def exchange(pairs, kinds):
    """One exchange over `pairs`: one collective permute, or one-way ones in a row."""
    if link.one_way:
      for g in one_way_groups(pairs):
        permute(g, kinds)
    else:
      permute(pairs, kinds)

  def permute(pairs, kinds):
    """One collective permute over `pairs`: a rendezvous of each pair, then the wire."""
    ready = {}
    for s, d in pairs:
      ready.setdefault(max(clock[s], clock[d]), []).append((s, d))
    release = {}
    for r in sorted(ready):
      for (s, d), (b, e) in wire.send(r, ready[r]).items():
        arrive = e + link.latency
        release[d] = max(release.get(d, 0.0), arrive)
        release[s] = max(release.get(s, 0.0), e if link.blocking_send else b)
        k, m = kinds.get((s, d), ("X", -1))
        transfers.append(Transfer(s, d, k, m, b, arrive))
    for x, t in release.items():
      clock[x] = max(clock[x], t)

  for t in range(sched.ticks):
    if sched.lag and t and moves:  # lag 1: last tick's outputs over the used pairs first
      exchange(
        ring,
        {
          (a.stage, _dest(sched, a)): (a.kind[1], a.microbatch)
          for s in range(S)
          for a in sched.grid[s][t - 1]
          if a.kind[0] == "S"
        },
      )
    for s in range(S):
      for a in sched.grid[s][t]:
        if a.kind in COMPUTE or a.kind == UPDATE:
          c = cs[sched.vstage(s, a.chunk)]
          b, clock[s] = clock[s], clock[s] + _dur(c, a.kind, v)
          spans.append((a, b, clock[s]))
      clock[s] += link.tick
    if not sched.lag:
      sends = [a for s in range(S) for a in sched.grid[s][t] if a.kind[0] == "S"]
      pairs = {(a.stage, _dest(sched, a)): (a.kind[1], a.microbatch) for a in sends}
      if pairs:
        exchange(sorted(pairs), pairs)
  return LinkTimeline(tuple(spans), max(clock), S, tuple(transfers), "executor")


def one_way_groups(pairs):
  """`pairs` (src, dst) split into groups in which no device both sends and
  receives, first fit in pair order (a ring of even length: 2 groups); the
  executor's CPU exchange (`execute.one_way`) and its replay share it.

  >>> one_way_groups([(0, 1), (1, 0)])
  (((0, 1),), ((1, 0),))
  """
  groups: list[list] = []
  for src, dst in pairs:
    for g in groups:
      if all(src != d and dst != s for s, d in g):
        g.append((src, dst))
        break
    else:
      groups.append([(src, dst)])
  return tuple(tuple(g) for g in groups)


def _dest(sched, a: Action) -> int:
  vs = sched.vstage(a.stage, a.chunk)
  return sched.place(vs + 1 if a.kind == "SF" else vs - 1)[0]


def _overlap(sched, cs, link: LinkModel) -> LinkTimeline:
  """Event replay in time order: actions start when their stage is free and their
  inputs have arrived; transfers are booked on their resource in the order they
  become ready."""
  S, M, v, V = sched.stages, sched.microbatches, sched.chunks, sched.virtual_stages
  orders = sched.orders()
  fin: dict[tuple, float] = {}  # (kind, vstage, mb, step) -> end
  arrive: dict[tuple, float] = {}  # ((kind, vstage, mb, step), dst stage) -> arrival
  pos, free = [0] * S, [0.0] * S
  wire = _Wire(link)
  spans, transfers = [], []
  pending: list = []  # heap of (ready, seq, key, src, dst)
  seq = 0
  remaining = sum(len(o) for o in orders)

  def start_of(s):
    """Start time of stage s's next action, or None if an input is not yet known."""
    a = orders[s][pos[s]]
    vs = sched.vstage(s, a.chunk)
    t = free[s]
    for key in deps(a, vs, V - 1, M):
      src = sched.place(key[1])[0]
      if src == s:
        if key not in fin:
          return None
        t = max(t, fin[key])
      else:
        if (key, s) not in arrive:
          return None
        t = max(t, arrive[(key, s)])
    return t

  while remaining:
    best = None
    for s in range(S):
      if pos[s] < len(orders[s]):
        t = start_of(s)
        if t is not None and (best is None or t < best[0]):
          best = (t, s)
    if pending and (best is None or pending[0][0] <= best[0]):
      ready, _, key, src, dst = heapq.heappop(pending)
      ((b, e),) = wire.send(ready, [(src, dst)]).values()
      arrive[(key, dst)] = e + link.latency
      transfers.append(Transfer(src, dst, key[0], key[2], b, e + link.latency))
      continue
    if best is None:
      raise ScheduleError(f"{sched.name}: the per-stage orders deadlock")
    t, s = best
    a = orders[s][pos[s]]
    vs = sched.vstage(s, a.chunk)
    end = t + _dur(cs[vs], a.kind, v)
    spans.append((a, t, end))
    free[s], pos[s] = end, pos[s] + 1
    remaining -= 1
    fin.update(dict.fromkeys(done(a, vs), end))
    if a.kind == UPDATE:
      continue
    kind = "B" if a.kind == "BW" else a.kind
    tvs = vs + 1 if kind == "F" else vs - 1 if kind == "B" else None
    if tvs is not None and 0 <= tvs < V and sched.place(tvs)[0] != s:
      heapq.heappush(pending, (end, seq, (kind, vs, a.microbatch, a.step), s, sched.place(tvs)[0]))
      seq += 1
  makespan = max([e for _, _, e in spans] + [x.end for x in transfers] + [0.0])
  return LinkTimeline(tuple(spans), makespan, S, tuple(transfers), "overlap")
