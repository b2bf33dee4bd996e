"""pipeline.plan: a validated table -> per (tick, device) integer rows and slot counts.

Contract: `plan(sched, flavor_of) -> Plan`, read by `passes.pipeline.ticks`.

Every buffer the executor keeps is a stack of slots: received activations
("act"), received input gradients ("grad"), F's residual records ("fres": what
B and W read) and B's records ("bres": what W reads). A slot is assigned by
interval colouring over the table, per device, so a device holds as many
records as the table keeps alive at once (`peak_activations()`), not one per
microbatch. Slot `count` of a receive stack is a trash slot: what a ring
carries that this device does not keep goes there, so every tick runs the
same writes; a record slot `count` means "this tick writes no record".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ooojax.passes.pipeline.schedule import PipelineSchedule

KINDS = ("F", "B", "W", "BW")
BUFFERS = ("act", "grad", "fres", "bres")

# Per (tick, device) integers. `branch` indexes `Plan.branches` (0: idle); `mb`
# is the microbatch's index over all steps of the table (step * M + m), `step`
# its step, and `upd` a bit per chunk whose optimizer update (U) runs at the end
# of this tick (tables tiled over steps); `sync` (the same on every device) is 1
# at the tick of step t's later update of the first and the last virtual stage,
# where the weights they share are reduced and updated;
# `in_slot` is the act (F) or grad (B, BW) slot the action reads; `fres` /
# `bres` the record slots it reads (B, W) or writes (`fres` for F, `bres` for
# B); `*_act` / `*_grad` the slots that what arrives on the up ring (from
# stage s - 1), the down ring (from s + 1), or locally (the same device: the
# tip of ZB-V's V) is written to.
# `up_pat` / `dn_pat` (the same on every device) index `Plan.patterns[ring]`:
# which (sender, receiver) pairs of that ring carry a value at this tick.
FIELDS = (
  "branch",
  "mb",
  "step",
  "upd",
  "sync",
  "in_slot",
  "fres",
  "bres",
  "f_write",
  "b_write",
  "up_act",
  "up_grad",
  "dn_act",
  "dn_grad",
  "loc_act",
  "loc_grad",
  "up_pat",
  "dn_pat",
)
F = {name: i for i, name in enumerate(FIELDS)}


@dataclasses.dataclass(frozen=True)
class Plan:
  rows: np.ndarray  # (ticks, stages, len(FIELDS)) int32
  branches: tuple[tuple[int, str, int], ...]  # (flavor, kind, chunk) per branch >= 1
  counts: dict  # slots per buffer (without trash)
  patterns: dict = dataclasses.field(default_factory=dict)  # ring -> ((src, dst) pairs, ...)


def _colour(intervals):
  """Interval colouring: `intervals` [(start, end, key)] -> ({key: slot}, n_slots).

  A slot is reusable by an interval starting at or after the tick its previous
  holder ended (receive buffers are read before the tick's writes).
  """
  free_at: list[int] = []
  slot = {}
  for start, end, key in sorted(intervals):
    for i, f in enumerate(free_at):
      if f <= start:
        free_at[i] = end
        slot[key] = i
        break
    else:
      slot[key] = len(free_at)
      free_at.append(end)
  return slot, len(free_at)


def _intervals(sched: PipelineSchedule, ev: dict) -> dict[str, list]:
  """Per buffer, (first tick, end tick, (device, microbatch, chunk, step)) of every value."""
  V = sched.virtual_stages
  ivs: dict[str, list] = {b: [] for b in BUFFERS}
  b_tick = lambda s, m, c, n: ev.get(("B", s, m, c, n), ev.get(("BW", s, m, c, n)))  # noqa: E731
  for (kind, s, m, c, n), t in ev.items():
    vs = sched.vstage(s, c)
    if kind == "RF":
      ivs["act"].append((t, ev[("F", s, m, c, n)], (s, m, c, n)))
    elif kind == "RB":
      ivs["grad"].append((t, b_tick(s, m, c, n), (s, m, c, n)))
    elif kind == "F":
      if vs < V - 1 and sched.place(vs + 1)[0] == s:  # local hand-off to the next chunk
        nc = sched.place(vs + 1)[1]
        ivs["act"].append((t, ev[("F", s, m, nc, n)], (s, m, nc, n)))
      end = ev.get(("W", s, m, c, n), ev.get(("BW", s, m, c, n)))
      # +1: the record is written at the end of F's tick and read during W's.
      ivs["fres"].append((t, end + 1, (s, m, c, n)))
    if kind in ("B", "BW") and vs > 0 and sched.place(vs - 1)[0] == s:
      pc = sched.place(vs - 1)[1]
      ivs["grad"].append((t, b_tick(s, m, pc, n), (s, m, pc, n)))
    if kind == "B":
      ivs["bres"].append((t, ev[("W", s, m, c, n)] + 1, (s, m, c, n)))
  return ivs


def plan(sched: PipelineSchedule, flavor_of: Callable[[int, int], int]) -> Plan:
  """Rows of `sched` for the executor; `flavor_of(device, chunk)` names the branch family."""
  S, T, V = sched.stages, sched.ticks, sched.virtual_stages
  ev: dict[tuple, int] = {}
  for s, row in enumerate(sched.grid):
    for t, cell in enumerate(row):
      for a in cell:
        ev[(a.kind, s, a.microbatch, a.chunk, a.step)] = t
  slots, counts = {}, {}
  for name, iv in _intervals(sched, ev).items():
    n = 0
    for s in range(S):  # buffers are per device; a buffer's size is the max over devices
      sl, k = _colour([x for x in iv if x[2][0] == s])
      slots.update({(name, *key): v for key, v in sl.items()})
      n = max(n, k)
    counts[name] = n
  rows = np.zeros((T, S, len(FIELDS)), np.int32)
  for name in ("up_act", "dn_act", "loc_act"):
    rows[:, :, F[name]] = counts["act"]
  for name in ("up_grad", "dn_grad", "loc_grad"):
    rows[:, :, F[name]] = counts["grad"]
  rows[:, :, F["f_write"]] = counts["fres"]
  rows[:, :, F["b_write"]] = counts["bres"]
  branches: dict[tuple[int, str, int], int] = {}
  ring_of = lambda s, other: "up" if s == (other + 1) % S else "dn"  # noqa: E731
  sync: dict[int, int] = {}  # step -> the tick of its later end-of-stack update
  for s, row in enumerate(sched.grid):
    for t, cell in enumerate(row):
      for a in cell:
        key = (s, a.microbatch, a.chunk, a.step)
        r = rows[t, s]
        vs = sched.vstage(s, a.chunk)
        if a.kind in KINDS:
          b = (flavor_of(s, a.chunk), a.kind, a.chunk)
          r[F["branch"]] = branches.setdefault(b, len(branches) + 1)
          r[F["mb"]] = a.step * sched.microbatches + a.microbatch
          r[F["step"]] = a.step
          if a.kind == "F":
            r[F["in_slot"]] = slots.get(("act", *key), 0)
            r[F["f_write"]] = slots[("fres", *key)]
          else:
            r[F["fres"]] = slots[("fres", *key)]
            if a.kind in ("B", "BW"):
              r[F["in_slot"]] = slots.get(("grad", *key), 0)
            if a.kind == "B":
              r[F["b_write"]] = slots[("bres", *key)]
            if a.kind == "W":
              r[F["bres"]] = slots[("bres", *key)]
          tvs = vs + 1 if a.kind == "F" else vs - 1
          if a.kind != "W" and 0 <= tvs < V and sched.place(tvs)[0] == s:
            buf = "act" if a.kind == "F" else "grad"
            r[F["loc_" + buf]] = slots[(buf, s, a.microbatch, sched.place(tvs)[1], a.step)]
        elif a.kind == "U":
          r[F["upd"]] |= 1 << a.chunk
          if vs in (0, V - 1):
            sync[a.step] = max(sync.get(a.step, t), t)
        elif a.kind in ("RF", "RB"):
          ps = sched.place(vs - 1 if a.kind == "RF" else vs + 1)[0]
          buf = "act" if a.kind == "RF" else "grad"
          r[F[f"{ring_of(s, ps)}_{buf}"]] = slots[(buf, *key)]
  for t in sync.values():
    rows[t, :, F["sync"]] = 1
  order = tuple(sorted(branches, key=branches.get))
  return Plan(rows, order, counts, _patterns(rows, counts, S))


def _patterns(rows, counts, S) -> dict:
  """Per ring, the distinct sets of (sender, receiver) pairs a tick uses; writes
  each tick's set index into the `*_pat` columns (pattern 0: nothing moves)."""
  out = {}
  for ring, src in (("up", lambda d: (d - 1) % S), ("dn", lambda d: (d + 1) % S)):
    pats: dict[tuple, int] = {(): 0}
    for t in range(rows.shape[0]):
      pairs = tuple(
        sorted(
          (src(d), d)
          for d in range(S)
          if rows[t, d, F[f"{ring}_act"]] < counts["act"]
          or rows[t, d, F[f"{ring}_grad"]] < counts["grad"]
        )
      )
      rows[t, :, F[f"{ring}_pat"]] = pats.setdefault(pairs, len(pats))
    out[ring] = tuple(sorted(pats, key=pats.get))
  return out
