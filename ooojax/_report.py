"""`ooo.explain`'s `Report`: the split and schedule of one `ooo.grad` call.

Below `_explain` (which builds it) and `_explain_dp` (which holds one), so
neither imports the other back.
"""

from __future__ import annotations

import dataclasses
import html
from collections import Counter
from typing import Any

from ooojax.passes.cost import LOOP_RULES, CostModel, get_spec
from ooojax.passes.ir import Kind, Schedule, Split, UnitKind
from ooojax.passes.simulate import Timeline, simulate


@dataclasses.dataclass(frozen=True)
class LoopRow:
  """One loop equation (scan / while / cond) of the split, priced from its body."""

  eqn: int  # index in the split jaxpr
  primitive: str
  kind: str  # "FORWARD" / "DX" / "DW" / "DEAD"
  param: str  # the parameter a dW loop feeds, else ""
  trips: float  # body runs (scan length, while trip count; 1 for cond)
  seconds: float  # whole loop, cost-model estimate
  flops: float

  @property
  def per_trip(self) -> float:
    return self.seconds / self.trips if self.trips else self.seconds


@dataclasses.dataclass(frozen=True)
class Report:
  """The split and schedule of one `ooo.grad` call. Times are cost-model estimates.

  `carried`: with `explain(..., defer=...)`, the `ooojax.single_gpu.Plan` of
  the deferred train step (`ooojax.single_gpu._defer_plan`: which dW clusters run in the next step, the bytes
  carried in `Pending`, the simulated step with and without deferral).
  """

  split: Split
  schedule: Schedule
  mode: str
  call: Any = dataclasses.field(default=None, compare=False, repr=False)  # for compiled()
  carried: Any = None
  notes: tuple[str, ...] = ()  # how explain traced the loss (an axis it bound, ...)

  @property
  def counts(self) -> dict[str, int]:
    c = Counter(k.name for k in self.split.kinds)
    return {k.name: c.get(k.name, 0) for k in Kind}

  @property
  def clusters(self) -> dict[str, int]:
    """Parameter path -> number of dW equations in its cluster."""
    return {c.param: len(c.eqns) for c in self.split.clusters}

  @property
  def loops(self) -> tuple[LoopRow, ...]:
    """Every loop equation with its kind and cost (per layer = `per_trip`)."""
    from ooojax.passes.cost import estimate

    cm = CostModel(self.schedule.device or None)
    eqns = self.split.jaxpr.jaxpr.eqns
    rows = []
    for k, e in enumerate(eqns):
      if e.primitive.name not in LOOP_RULES:
        continue
      ci = self.split.cluster_of[k]
      rows.append(
        LoopRow(
          k,
          e.primitive.name,
          self.split.kinds[k].name,
          self.split.clusters[ci].param if ci >= 0 else "",
          cm.loop_trips(e),
          cm.unit_cost([e]).seconds,
          estimate(e).flops,
        )
      )
    return tuple(rows)

  def _loop_lines(self) -> list[str]:
    rows = self.loops
    if not rows:
      return []
    by_trips: dict[float, dict[str, list[LoopRow]]] = {}
    for r in rows:
      by_trips.setdefault(r.trips, {}).setdefault(r.kind, []).append(r)
    lines = [
      f"  loops: {len(rows)} ({self.split.loops_split} backward scans split into B-scan + W-scans)"
    ]
    for trips, kinds in sorted(by_trips.items()):
      parts = [
        f"{k} {sum(r.per_trip for r in rs) * 1e3:.4f} ms ({len(rs)} loops)"
        for k, rs in sorted(kinds.items())
      ]
      lines.append(f"    x{trips:g} per trip (per layer): " + ", ".join(parts))
    from ooojax.passes.scan.skew import predict

    io, sk = predict(self.split, CostModel(self.schedule.device or None))
    if sk:
      lines.append(
        f"    skewed scan (single_gpu emits B(i) beside W(i-1)): split backward "
        f"scans {io * 1e3:.3f} -> {sk * 1e3:.3f} ms (cost model, not in the "
        "predicted step above)"
      )
    return lines

  def on_stream(self, stream: int) -> list[str]:
    if stream >= len(self.schedule.streams):
      return []
    return [a.unit for a in self.schedule.streams[stream]]

  def timeline(self) -> Timeline:
    """The simulated per-stream spans (what `plot` draws), cost-model estimates."""
    sync = get_spec(self.schedule.device).sync if self.schedule.device else 0.0
    return simulate(self.schedule.streams, self.schedule.units, sync)

  def summary(self) -> str:
    s, c = self.schedule, self.counts
    side = self.on_stream(1)
    lines = [
      f"ooojax schedule (mode={self.mode}, device spec={s.device})",
      f"  equations: {c['FORWARD']} forward, {c['DX']} dX, {c['DW']} dW, {c['DEAD']} dead",
      f"  nested calls: {self.split.inlined} opened (jit / checkpoint / custom_vjp bodies "
      f"on the backward, scheduled equation by equation); {len(self.split.opaque)} "
      f"loops or branches kept whole (each scheduled as one unit)"
      + (f": {', '.join(sorted(set(self.split.opaque)))}" if self.split.opaque else ""),
      f"  dW clusters: {len(self.split.clusters)} "
      f"({len(side)} on stream 1, {len(self.split.clusters) - len(side)} on stream 0)",
      f"  units: {sum(u.kind is UnitKind.DX for u in s.units)} dX segments",
      f"  predicted step (cost model, not measured): in-order "
      f"{s.in_order_makespan * 1e3:.3f} ms, scheduled {s.makespan * 1e3:.3f} ms, "
      f"speedup {s.predicted_speedup:.3f}x",
    ]
    lines += self._loop_lines()
    if self.carried is not None:
      lines += [
        "  carried to the next step (single_gpu.make_train_step):",
        *(f"    {l}" for l in str(self.carried).splitlines()),
      ]
    for i, stream in enumerate(s.streams):
      text = " ".join(str(a) for a in stream)
      lines.append(f"  stream {i}: {text[:200]}{' ...' if len(text) > 200 else ''}")
    if s.calls:
      eqns = self.split.jaxpr.jaxpr.eqns
      shown = [
        f"{'+'.join(c.units)} after {c.after} until "
        + (eqns[c.anchor].primitive.name if 0 <= c.anchor < len(eqns) else "-")
        + f"@e{c.anchor}"
        for c in s.calls[:4]
      ]
      lines.append(
        f"  side-stream calls: {len(s.calls)} (window: issued after a dX segment, "
        f"done after a dX conv/matmul; at most two in flight, as XLA:GPU keeps): "
        f"{'; '.join(shown)}"
        f"{' ...' if len(s.calls) > 4 else ''}"
      )
    lines += [f"  note: {n}" for n in self.notes]
    if s.kept:
      by: dict[str, list[str]] = {}
      for name, why in s.kept:
        by.setdefault(why, []).append(s.unit(name).label)
      lines.append(f"  dW clusters kept on stream 0 for XLA:GPU ({len(s.kept)}):")
      lines += [
        f"    {len(v)} {why}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}"
        for why, v in by.items()
      ]
    return "\n".join(lines)

  def __repr__(self) -> str:
    return self.summary()

  def _repr_html_(self) -> str:
    return f"<pre>{html.escape(self.summary())}</pre>"

  def compiled(self, gpu: str = "H100", *, devices: int = 1, compiler_options=None):
    """Compiles the same gradient for a compile-only `gpu` (`ooojax.gpu_hlo`):
    per dW unit, the predicted stream and overlap beside what XLA scheduled.

    Returns a `passes.hlo.compare.Comparison` (`.units`, `.summary()`,
    `.mismatches()`, `.hlo`). Needs the `gpu-hlo` extra; see
    `gpu_hlo.unavailable_reason()`.
    """
    from ooojax._compiled import compile_report

    return compile_report(self, gpu, devices=devices, compiler_options=compiler_options)

  def plot(self, ax=None, compiled=None):
    """Gantt chart of the (simulated) schedule; returns the matplotlib Axes.

    With `compiled=` (from `compiled()`) a second panel shows what XLA
    actually scheduled; `ax` is then a pair of Axes (or None) and the pair
    is returned.
    """
    import matplotlib.pyplot as plt

    tl = self.timeline()
    if compiled is not None:
      from ooojax._compiled import plot_compiled

      if ax is None:
        fig, ax = plt.subplots(2, 1, figsize=(10, 3.4 + 0.6 * len(self.schedule.streams)))
        fig.subplots_adjust(hspace=0.7)
      self.plot(ax[0])
      plot_compiled(compiled, ax[1])
      return ax
    if ax is None:
      _, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(self.schedule.streams)))
    colors = {"F": "#9e9e9e", "X": "#d62728", "W": "#1f77b4"}
    for span in tl.spans:
      ax.barh(
        span.stream,
        (span.end - span.start) * 1e3,
        left=span.start * 1e3,
        color=colors[span.unit[0]],
        edgecolor="white",
        linewidth=0.3,
      )
    ax.set_yticks(range(len(self.schedule.streams)))
    ax.set_yticklabels([f"stream {i}" for i in range(len(self.schedule.streams))])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms (simulated, {self.schedule.device} cost model)")
    ax.set_title("F forward (grey) / dX (red) / dW (blue)")
    return ax

  def plot_carried(self, ax=None):
    """With `explain(..., defer=...)`: the simulated steady-state step without
    and with the deferral (`single_gpu.Plan.plot`); returns the Axes."""
    if self.carried is None:
      raise ValueError(
        "nothing is carried: call ooo.explain(..., defer='auto' | paths | "
        "predicate) for the deferred train step's plan"
      )
    return self.carried.plot(ax)
