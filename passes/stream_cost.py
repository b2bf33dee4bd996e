"""stream_cost: what a stream call costs and gains on a calibrated GPU (issue 50).

Contract: `price(calls, streams, units, spec) -> Priced`: which planned calls pay
for themselves, and why each dropped dW cluster stays on stream 0;
`predict_step(t_grad, ...)`: a step's time from jax.grad's and the GPU terms.

The GPU terms are physical, per device, from a calibration file
(`passes.calibration`, written by `benchmarks/stream_pairs.py` on that GPU):

* `DeviceSpec.pinned_call`: what one stream call whose window is pinned costs the
  step beyond its kernels (events, waits, the command buffer split around it,
  host gaps). Measured: ~100 us on an H100, ~77 us on an H200 (jax 0.11.2);
* `DeviceSpec.sync`: the same for a call left to XLA's scheduler (~10-40 us H100,
  ~9 us H200);
* the concurrency gain of running a dW unit beside the dX work of its window,
  from how much of the GPU each fills (`Unit.util`, the cost model's share of the
  SMs: `passes.cost`): two kernels with fills u_x, u_w and times t_x, t_w take
  max(t_x, t_w, u_x t_x + u_w t_w) together (the SMs are shared), so the pair
  saves t_x + t_w minus that, and G = (t_x + t_w) / that. Kernels that fill the
  GPU (u = 1, as Hopper's persistent cuDNN/cuBLAS kernels do at batch 32) gain
  nothing.

A call stays only if its units' saving exceeds `pinned_call`; the plan stays only
if its predicted step (simulated makespan plus the calls' cost) beats in-order by
`min_speedup` (1.0 for `mode="single_gpu"`, 1.03 for `mode="auto"`). Without a
calibration (`pinned_call` None, the presets) nothing here applies.

>>> round(pair_seconds(1.0, 1.0, 1.0, 1.0), 3), round(pair_seconds(1.0, 0.5, 1.0, 0.5), 3)
(2.0, 1.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ooojax.passes.ir import Call, Unit, UnitKind

# Why a dW cluster stays on stream 0 of a calibrated GPU plan (`Schedule.kept`).
FILLS = "both kernels fill the GPU: running it beside the dX chain gains nothing (G = 1.00)"


def too_dear(pinned: float) -> str:
  return (
    f"gains less beside its dX work than a pinned stream call costs on this GPU "
    f"({pinned * 1e6:.0f} us, calibrated)"
  )


def below(speedup: float, need: float) -> str:
  return (
    f"the plan's predicted speedup, calls priced, is {speedup:.3f}x, under the "
    f"{need:.2f}x asked for"
  )


NOTHING_LEFT = "no dX work is left to run beside it"


def pair_seconds(t_x: float, u_x: float, t_w: float, u_w: float) -> float:
  """Time of dX work (t_x, fill u_x) and dW work (t_w, u_w) run on two streams."""
  return max(t_x, t_w, u_x * t_x + u_w * t_w)


def pair_saving(t_x: float, u_x: float, t_w: float, u_w: float) -> float:
  return t_x + t_w - pair_seconds(t_x, u_x, t_w, u_w)


@dataclasses.dataclass(frozen=True)
class Gain:
  """One call's predicted concurrency gain."""

  saving: float  # seconds
  t_x: float  # dX work beside it
  u_x: float
  t_w: float  # its dW work
  u_w: float

  @property
  def pair_gain(self) -> float:
    both = pair_seconds(self.t_x, self.u_x, self.t_w, self.u_w)
    return (self.t_x + self.t_w) / both if both > 0 else 1.0

  @property
  def fills(self) -> bool:
    return self.u_x >= 0.99 and self.u_w >= 0.99


def call_gain(call: Call, main: Sequence[str], by: dict[str, Unit]) -> Gain:
  """The call's dW units beside the stream-0 work that follows its issue point,
  as much of it as the dW work lasts (its window)."""
  ws = [by[n] for n in call.units]
  t_w = sum(w.cost for w in ws)
  u_w = sum(w.cost * w.util for w in ws) / t_w if t_w > 0 else 1.0
  start = main.index(call.after) + 1 if call.after in main else len(main)
  t_x = busy = 0.0
  for name in main[start:]:
    u = by[name]
    if u.kind is not UnitKind.DX:
      continue
    take = min(u.cost, t_w - t_x)
    t_x += take
    busy += take * u.util
    if t_x >= t_w:
      break
  u_x = busy / t_x if t_x > 0 else 1.0
  return Gain(pair_saving(t_x, u_x, t_w, u_w), t_x, u_x, t_w, u_w)


@dataclasses.dataclass(frozen=True)
class Priced:
  keep: frozenset[str]  # side units whose calls pay
  kept: tuple[tuple[str, str], ...]  # (dW unit, why on stream 0) for the others
  gains: tuple[tuple[Call, Gain], ...]


def price(
  calls: Sequence[Call], main: Sequence[str], units: Sequence[Unit], pinned: float
) -> Priced:
  """Which `calls` pay for a pinned call each (see the module doc)."""
  by = {u.name: u for u in units}
  keep: set[str] = set()
  kept: list[tuple[str, str]] = []
  gains = []
  for c in calls:
    g = call_gain(c, main, by)
    gains.append((c, g))
    if g.saving > pinned:
      keep.update(c.units)
    else:
      why = FILLS if g.fills else too_dear(pinned)
      kept += [(n, why) for n in c.units]
  return Priced(frozenset(keep), tuple(kept), tuple(gains))


def why_main(
  units: Sequence[Unit], main: Sequence[str], side: set[str], kept, pinned: float
) -> tuple[tuple[str, str], ...]:
  """(dW unit, why on stream 0) for each one on stream 0 that `kept` does not
  explain yet: what it would gain alone in a call of its own."""
  by = {u.name: u for u in units}
  known = {n for n, _ in kept} | set(side)
  out = []
  for u in units:
    if u.kind is not UnitKind.DW or u.name in known:
      continue
    g = call_gain(Call((u.name,), 1, u.deps[0]), main, by)
    why = NOTHING_LEFT if g.t_x == 0 else FILLS if g.fills else too_dear(pinned)
    out.append((u.name, why))
  return tuple(out)


def predict_step(
  t_grad: float,
  calls: int = 0,
  call_seconds: float = 0.0,
  extra_kernels: int = 0,
  extra_bytes: float = 0.0,
  bandwidth: float = 1.0,
  kernel_seconds: float = 1e-6,
  saving: float = 0.0,
) -> float:
  """A variant's step from jax.grad's measured `t_grad`: its calls at
  `call_seconds` each, the kernels and bytes it runs beyond jax.grad's (a kernel
  in a command buffer: `kernel_seconds`), less the concurrency `saving`."""
  return (
    t_grad
    + calls * call_seconds
    + extra_kernels * kernel_seconds
    + extra_bytes / bandwidth
    - saving
  )
