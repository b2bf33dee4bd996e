"""hlo.compare: the simulated schedule beside what XLA really scheduled.

Contract: `compare(schedule, timeline, hlo) -> Comparison`.

`passes.emit` wraps each unit's equations in `jax.named_scope("ooo_<unit>")`,
so every compiled instruction's `op_name` metadata names the unit it came
from (`jit(f)/ooo_W3/compute_on`). For each dW unit this pass puts side by
side what the schedule predicted (stream, and whether the simulated span
overlaps dX work) and what the compiled module shows (a stream-annotated
async call? which kernels are scheduled between its start and done?).

>>> from ooojax.passes.ir import Action, Schedule, Unit, UnitKind
>>> from ooojax.passes.simulate import simulate
>>> from ooojax.passes.hlo.schedule import parse
>>> units = (Unit(UnitKind.DX, 0, (), (), cost=1.0, util=0.5),
...          Unit(UnitKind.DW, 0, (), ("X0",), cost=1.0, util=0.5))
>>> sched = Schedule(((Action("X", 0, 0),), (Action("W", 0, 1),)), (), units)
>>> hlo = parse('''ENTRY %e (p: f32[4]) -> f32[4] {
...   %p = f32[4]{0} parameter(0)
...   %s = ((f32[4]{0}), f32[4]{0}) call-start(%p), to_apply=%w, frontend_attributes={_xla_stream_annotation="1"}, metadata={op_name="jit(f)/ooo_W0/compute_on"}
...   ROOT %d = f32[4]{0} call-done(%s)
... }''')
>>> c = compare(sched, simulate(sched.streams, units), hlo)
>>> [(u.unit, u.predicted_stream, u.xla_call, u.xla_overlapped) for u in c.units]
[('W0', 1, 's', False)]
"""

from __future__ import annotations

import dataclasses
import html

from ooojax.passes.hlo.schedule import AsyncPair, HloSchedule, Instr
from ooojax.passes.ir import Schedule
from ooojax.passes.simulate import Timeline

SCOPE = "ooo_"


def unit_of(instr: Instr) -> str | None:
  """The ooojax unit ("W3", "X2", "F0") named in `instr`'s op_name, or None.

  A call holding several units is named by their labels joined with "+"
  (`ooo_W3+W4`); see `units_of`.
  """
  for part in instr.op_name.split("/"):
    if part.startswith(SCOPE) and part[len(SCOPE) :][:1] in ("F", "X", "W", "S"):
      return part[len(SCOPE) :]
  return None


def units_of(instr: Instr) -> tuple[str, ...]:
  """Every unit named in `instr`'s op_name (a merged call names several)."""
  u = unit_of(instr)
  return tuple(u.split("+")) if u else ()


@dataclasses.dataclass(frozen=True)
class UnitCompiled:
  """One dW unit: predicted (simulator) vs compiled (XLA)."""

  unit: str
  label: str  # the parameter path
  predicted_stream: int
  predicted_overlap: bool  # its simulated span overlaps a dX span
  xla_call: str | None  # the call-start carrying it, if any
  xla_stream: str | None  # that call's stream annotation
  heavy: bool  # its kernels include a conv / GEMM
  kernels_between: tuple[str, ...] = ()  # main-stream kernels between start and done
  heavy_between: tuple[str, ...] = ()  # conv / GEMM kernels among them

  @property
  def xla_overlapped(self) -> bool:
    """XLA scheduled main-stream work while the call is in flight (for a heavy
    unit: a conv / GEMM kernel)."""
    return bool(self.heavy_between if self.heavy else self.kernels_between)

  @property
  def agrees(self) -> bool:
    return self.predicted_overlap == self.xla_overlapped


@dataclasses.dataclass(frozen=True)
class Comparison:
  """Per dW unit, the predicted and the compiled schedule. `hlo` is the parsed module."""

  units: tuple[UnitCompiled, ...]
  hlo: HloSchedule = dataclasses.field(compare=False, repr=False)
  gpu: str = ""

  def unit(self, name: str) -> UnitCompiled:
    return {u.unit: u for u in self.units}[name]

  @property
  def heavy_overlap(self) -> tuple[int, int]:
    """(k, n): stream calls holding a conv/GEMM, k with one between start and done.

    Counted per call: units merged into one call share it.
    """
    heavy = {u.xla_call: u for u in self.units if u.heavy and u.xla_call}
    return sum(bool(u.heavy_between) for u in heavy.values()), len(heavy)

  def mismatches(self) -> tuple[UnitCompiled, ...]:
    """Units predicted to overlap that XLA did not overlap, or the reverse."""
    return tuple(u for u in self.units if not u.agrees)

  def summary(self) -> str:
    k, n = self.heavy_overlap
    pred = sum(u.predicted_overlap for u in self.units)
    real = sum(u.xla_overlapped for u in self.units)
    lines = [
      f"compiled for {self.gpu or 'GPU'} (compile-only; order, not timings): "
      f"{pred} dW units predicted to overlap (simulated), {real} overlapped in "
      f"XLA's schedule; heavy dW calls overlapped: {k} / {n}",
      f"  {'unit':<5} {'pred':>4} {'sim':>3} {'xla call':<16} {'heavy':>5} {'between':>7}  param",
    ]
    for u in self.units:
      between = f"{len(u.heavy_between)}h/{len(u.kernels_between)}" if u.xla_call else "-"
      flag = "" if u.agrees else "  <- differs"
      lines.append(
        f"  {u.unit:<5} {'s' + str(u.predicted_stream):>4} "
        f"{'yes' if u.predicted_overlap else 'no':>3} {u.xla_call or '(inline)':<16} "
        f"{'yes' if u.heavy else 'no':>5} {between:>7}  {u.label}{flag}"
      )
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.summary()

  def _repr_html_(self) -> str:
    return f"<pre>{html.escape(self.summary())}</pre>"


def _overlaps_dx(span, spans) -> bool:
  return any(s.unit.startswith("X") and s.start < span.end and span.start < s.end for s in spans)


def compare(schedule: Schedule, timeline: Timeline, hlo: HloSchedule, gpu: str = "") -> Comparison:
  """Matches each dW unit to its compiled stream call (via `ooo_<unit>` op names).

  Args:
    schedule: the predicted schedule (`Report.schedule`).
    timeline: its simulation (`Report.timeline()`).
    hlo: the parsed compiled module of the same function (`gpu_hlo.schedule`).
    gpu: the GPU name, for the text.

  Returns:
    A `Comparison`, one `UnitCompiled` per dW unit in schedule order.
  """
  calls: dict[str, AsyncPair] = {}
  for p in hlo.pairs:
    if p.kind == "call":
      for u in units_of(p.start):
        calls.setdefault(u, p)
  heavy_inline: set[str] = set()
  for seq in hlo.computations.values():
    for i in seq:
      if i.is_heavy:
        heavy_inline.update(units_of(i))
  spans = {s.unit: s for s in timeline.spans}
  units = {u.name: u for u in schedule.units}
  out = []
  for stream, actions in enumerate(schedule.streams):
    for a in actions:
      if a.kind != "W":
        continue
      span = spans.get(a.unit)
      p = calls.get(a.unit)
      heavy = p.heavy_callee if p is not None else a.unit in heavy_inline
      work = tuple(i.name for i in p.between if i.kind not in ("start", "done")) if p else ()
      out.append(
        UnitCompiled(
          a.unit,
          units[a.unit].label if a.unit in units else "",
          a.stream,
          bool(span is not None and a.stream != 0 and _overlaps_dx(span, timeline.spans)),
          p.start.name if p else None,
          p.stream if p else None,
          heavy,
          work,
          tuple(i.name for i in p.overlapped_heavy) if p else (),
        )
      )
  order = {
    a.unit: k
    for k, a in enumerate(
      sorted((a for s in schedule.streams for a in s if a.kind == "W"), key=lambda a: a.index)
    )
  }
  out.sort(key=lambda u: order.get(u.unit, 0))
  return Comparison(tuple(out), hlo, gpu)
