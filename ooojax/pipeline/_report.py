"""The report `ooo.pipeline.explain` returns: `PipelineReport`, `AutoCut`, `StageMemory`.

Plain frozen dataclasses: the table, the cost-model phase costs, the bytes per
device and (with a compile-only GPU) the collective-permute windows, with the
summaries, the plot and the HTML a notebook shows; `compile_windows` compiles the
report's step for compile-only GPUs (`PipelineReport.compiled`). `_explain` builds them.
Bubble and times are simulated (cost model), never measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
from collections.abc import Mapping
from typing import Any

import jax

from ooojax.passes.hlo.windows import Window
from ooojax.passes.pipeline.program import Memory
from ooojax.passes.pipeline.schedule import PipelineSchedule

__all__ = ["AutoCut", "PipelineReport", "StageFsdp", "StageMemory"]


@dataclasses.dataclass(frozen=True)
class StageMemory:
  """Bytes of one device (stage) of the pipelined step."""

  stage: int
  peak: int  # most (microbatch, chunk) activations it holds at once
  bound: int  # weights + gradients + peak x (F and B records): what its table needs
  allocated: int  # what the executor's buffers hold (one SPMD program: every stage alike)


@dataclasses.dataclass(frozen=True)
class AutoCut:
  """Where the automatic form cut a plain loss (`passes.pipeline.cut.Cut`), by name."""

  layers: int
  scanned: bool  # one scan over stacked leaves, else a loop of blocks
  reverse: bool
  stacked: tuple[str, ...]  # the stack's leaves (layer 0's for a loop)
  first: tuple[str, ...]  # shared leaves only the prologue reads (embedding)
  last: tuple[str, ...]  # ... only the epilogue reads (final norm, untied head)
  tied: tuple[str, ...]  # ... both read (tied embeddings): gradient reduced once
  side: tuple[str, ...]  # batch leaves every stage reads (a padding mask's tokens)

  def summary(self) -> str:
    def names(xs):
      text = ", ".join(xs) if xs else "-"
      return text if len(text) <= 160 else f"{len(xs)} leaves: {text[:140]} ..."

    how = "one scan over stacked leaves" if self.scanned else "a loop of identical blocks"
    return "\n".join(
      [
        f"  cut (automatic): {self.layers} layers, {how}" + (" (reversed)" if self.reverse else ""),
        f"    stack leaves: {names(self.stacked)}",
        f"    shared: first stage {names(self.first)}; last stage {names(self.last)}; "
        f"tied (both ends, replicated) {names(self.tied)}",
        f"    side inputs (every stage reads): {names(self.side)}",
      ]
    )


@dataclasses.dataclass(frozen=True)
class StageFsdp:
  """Stack weights split over the data axis within their stage (FSDP, read from the
  parameters' shardings) and what the step gathers of them."""

  mode: str  # "regather": gathered by each action; "keep": once, before the tick loop
  axis: str
  size: int  # data replicas
  leaves: tuple[str, ...]  # the stack's leaves split (layer 0's for a loop)
  whole: int  # bytes per device of those leaves whole (its stages')
  chunks: int = 1
  asked: str = ""  # the option ("auto": `mode` chosen by `passes.pipeline.fsdp.choose`)
  reason: str = ""  # why that mode (`FsdpChoice.reason`)

  @property
  def held(self) -> int:
    """Bytes per device of those leaves as the step holds them between actions."""
    return self.whole // self.size if self.mode == "regather" else self.whole

  def summary(self) -> str:
    mb = _bytes
    names = ", ".join(self.leaves)
    names = names if len(names) <= 160 else f"{names[:140]} ..."
    head = (
      f"  FSDP within the stages (fsdp={self.mode!r}): {len(self.leaves)} stack "
      f"{'leaf' if len(self.leaves) == 1 else 'leaves'} split over {self.axis!r} "
      f"(x{self.size}): {names}"
    )
    if self.asked == "auto":
      head += f"\n    fsdp='auto' runs {self.mode!r}: {self.reason}"
    if self.mode == "keep":
      return (
        f"{head}\n    gathered: every stage's whole, once before the tick loop, held for the "
        f"step: {mb(self.whole)} per device of weights and as much of gradients, "
        "reduce-scattered once after the loop "
        f"(fsdp='regather': {mb(self.whole // self.size)} each)"
      )
    return (
      f"{head}\n    held per device: {mb(self.held)} of those weights and {mb(self.held)} "
      f"of their gradients ({mb(self.whole)} each whole); gathered: each F, B and W "
      f"all-gathers its chunk's split weights ({mb(self.whole // self.chunks)} whole, "
      "for that action only); each W reduce-scatters its gradient of them"
    )


@dataclasses.dataclass(frozen=True)
class PipelineReport:
  """A pipeline schedule for one model: table, simulated bubble, memory, compiled windows.

  `costs` are seconds per whole stage and phase (`{"F", "B", "W"}`, the
  slowest stage kind; an interleaved chunk costs `1 / chunks` of them),
  priced by the cost model for `device`; `comm` the seconds one activation
  takes over `link` (0 without one). `windows` is None until compiled
  (`explain(..., gpu="H100")` or `compiled()`). With `steps >= 2` the report
  also simulates the table tiled over `steps` training steps
  (`steady_state`, `carried_actions`).
  """

  schedule: PipelineSchedule
  costs: Mapping[str, float]
  comm: float
  memory: Memory
  device: str
  link: str = ""
  phases: tuple[tuple[str, float, float, float], ...] = ()  # (stage kind, F, B, W) per chunk
  gpu: str | None = None
  windows: tuple[Window, ...] | None = None
  call: Any = dataclasses.field(default=None, compare=False, repr=False)  # for compiled()
  steps: int = 1
  cut: AutoCut | None = None  # the automatic form's cut (`explain(loss_fn, params, ...)`)
  balance: Any = None  # ... and its `passes.pipeline.balance.Balance`
  depth: Any = None  # `passes.pipeline.depth.DepthChoice`: ooo planned on the link
  # GEMM operands that are rows of a stacked stage parameter (`p["w"][j]`), in the
  # stage kind with the most (`passes.pipeline.sliced`)
  sliced_weights: int = 0
  notes: tuple[str, ...] = ()  # how explain traced the loss (an axis it bound, ...)
  fsdp: StageFsdp | None = None  # stack weights split over the data axis (`data_axis`)

  # --- simulated from the table and the costs ------------------------------
  def timeline(self):
    """`passes.pipeline.simulate.PipelineTimeline` with the model's costs (simulated)."""
    return self.schedule.simulate(self.costs, self.comm)

  @property
  def bubble_fraction(self) -> float:
    """Idle share of stages x step, simulated with the cost-model phase costs."""
    return self.timeline().bubble_fraction

  @property
  def unit_bubble_fraction(self) -> float:
    """The same with F = B = W = 1 and free transfers (the table alone)."""
    return self.schedule.bubble_fraction()

  @property
  def step_seconds(self) -> float:
    return self.timeline().makespan

  def select_cost(self):
    """`passes.pipeline.lowering.SelectCost`: the `select` tick loop (every
    action on every tick, no conditional) with the model's costs (simulated)."""
    from ooojax.passes.pipeline.lowering import select_cost

    return select_cost(self.schedule, self.costs, self.comm)

  @property
  def lowering(self) -> str:
    """The tick loop a GPU runs for this model (`passes.pipeline.lowering`):
    `select` where its masked work costs less than the `switch` ticks' host
    round trips, else `switch`; on a CPU device, `switch`. `OOOJAX_TICKS` is
    not read here."""
    from ooojax.passes.pipeline.lowering import select_pays

    if self.device.upper() == "CPU":
      return "switch"
    return "select" if select_pays(self.schedule, self.costs, self.comm) else "switch"

  def _lowering_lines(self) -> list[str]:
    from ooojax.passes.pipeline.generate import unfuse
    from ooojax.passes.pipeline.lowering import HOST_SYNC

    ms = lambda t: f"{t * 1e3:.3f}"  # noqa: E731
    c = self.select_cost()
    switch = self.step_seconds + unfuse(self.schedule).ticks * HOST_SYNC
    wasted = c.wasted_fraction * c.stages * c.ticks * (c.tick - c.comm)
    sel = (
      f"select: every tick runs all {len(c.actions)} actions, {c.wasted_fraction:.0%} of "
      f"its work masked ({ms(wasted)} ms per step, summed over the stages), step "
      f"{ms(c.makespan)} ms"
    )
    if self.device.upper() == "CPU":
      return [f"  tick loop on CPU: switch (a conditional is a branch; simulated {sel})"]
    return [
      f"  tick loop on {self.device}: {self.lowering} (simulated). {sel}; switch: the "
      f"table's {ms(self.step_seconds)} ms + {ms(HOST_SYNC)} ms a tick x {c.ticks} ticks = "
      f"{ms(switch)} ms (OOOJAX_TICKS=switch|select forces one). {ms(HOST_SYNC)} ms: the "
      "switch ticks' measured overhead beyond their work on one H100 (3 conditionals a "
      "tick, read back on the host); one H200: 0.088 ms with 3, 0.054 ms with the 1 a GPU "
      "runs now, the same as one CUDA graph: the tick's extra kernels, not the host "
      "(RESULTS, issue 48)"
    ]

  def steady_state(self):
    """`passes.pipeline.steps.SteadyState` of the table tiled over `steps` steps with
    the model's costs (simulated; per-step bubble beside the one-step bubble), or
    None with `steps=1`."""
    if self.steps < 2:
      return None
    from ooojax.passes.pipeline.steps import steady_state

    return steady_state(self.schedule, self.steps, self.costs, self.comm)

  @property
  def carried_actions(self) -> tuple[tuple[str, ...], ...]:
    """Per stage, the actions of step t (t = steps - 2) still running when step
    t + 1 starts (its first forward on stage 0): the drain that overlaps the
    next step's warm-up, simulated with the model's costs. Empty with `steps=1`."""
    if self.steps < 2:
      return ()
    from ooojax.passes.pipeline.steps import tile

    tl = tile(self.schedule, self.steps).simulate(self.costs, self.comm)
    t = self.steps - 2
    start = min(b for a, b, _ in tl.spans if a.step == t + 1)
    out: list[list[str]] = [[] for _ in range(self.schedule.stages)]
    for a, b, e in sorted(tl.spans, key=lambda x: x[1]):
      if a.step == t and e > start + 1e-12:
        out[a.stage].append(str(dataclasses.replace(a, step=0)))
    return tuple(tuple(r) for r in out)

  @property
  def peak_activations(self) -> tuple[int, ...]:
    return self.schedule.peak_activations()

  @property
  def stages(self) -> tuple[StageMemory, ...]:
    m = self.memory
    per = m.fres + m.bres
    return tuple(
      StageMemory(s, p, m.weights + m.grads + p * per, m.allocated)
      for s, p in enumerate(self.peak_activations)
    )

  def to_text(self) -> str:
    """The table's text form (`PipelineSchedule.parse` reads it back)."""
    return self.schedule.to_text()

  def summary(self) -> str:
    s, m = self.schedule, self.memory
    mb = _bytes
    ms = lambda t: f"{t * 1e3:.3f}"  # noqa: E731
    lines = [
      f"ooojax pipeline plan: {s.name}, {s.stages} stages x {s.chunks} chunk(s), "
      f"{s.microbatches} microbatches, {s.ticks} ticks" + (f", lag {s.lag}" if s.lag else ""),
      str(s),
    ]
    lines.append(
      f"  phase costs per stage (cost model, {self.device}, not measured): "
      + ", ".join(f"{k} {ms(v)} ms" for k, v in self.costs.items())
      + (
        f"; transfer {ms(self.comm)} ms per hop over {self.link}"
        if self.link
        else "; transfers free (no link given)"
      )
    )
    for kind, f, b, w in self.phases:
      lines.append(f"    {kind} stage, one microbatch: F {ms(f)}, B {ms(b)}, W {ms(w)} ms")
    lines.append(
      f"  bubble (simulated): {self.bubble_fraction:.1%} with these costs, "
      f"{self.unit_bubble_fraction:.1%} with F = B = W = 1; step "
      f"{ms(self.step_seconds)} ms (simulated)"
    )
    lines += self._lowering_lines()
    lines.append(
      f"  memory per device: weights {mb(m.weights)}, gradients {mb(m.grads)}, "
      f"one microbatch's records {mb(m.fres + m.bres)}, one activation "
      f"{mb(m.activation)}; executor buffers {mb(m.allocated)} (slots {m.slots})"
    )
    for st in self.stages:
      lines.append(f"    stage {st.stage}: peak activations {st.peak}, bound {mb(st.bound)}")
    if self.cut is not None:
      lines.append(self.cut.summary())
    if self.balance is not None:
      lines.append(f"  balance: {self.balance.summary()}")
    if self.fsdp is not None:
      lines.append(self.fsdp.summary())
    if self.depth is not None:
      lines.append("  " + self.depth.summary())
    if self.sliced_weights:
      lines += [
        f"  weights sliced from a stack: {self.sliced_weights} GEMM operands of a stage "
        "are rows of a stacked parameter (p[...][j]), which XLA:CPU, and XLA:GPU before "
        "a Triton GEMM, copy out before each GEMM, in F and again in B;",
        "    hold each layer's weights as an array of its own: {'w': [w_0, w_1, ...]}, "
        "each w_j (stages, ...) (docs/pipeline.md)",
      ]
    lines += self._steps_lines()
    lines += [f"  note: {n}" for n in self.notes]
    if self.windows is not None:
      lines.append(_windows_text(self.windows, self.gpu))
    return "\n".join(lines)

  def _steps_lines(self) -> list[str]:
    st = self.steady_state()
    if st is None:
      return []
    ms = lambda t: f"{t * 1e3:.3f}"  # noqa: E731
    lines = [
      f"  over {st.steps} steps (tiled, per-stage updates, simulated): bubble "
      f"{st.one_step_bubble:.1%} for one synchronous step, {st.steady_bubble:.1%} in "
      f"the steady state (step {st.steps}); per step "
      + ", ".join(f"{b:.1%}" for b in st.step_bubbles)
      + f"; step time {ms(st.step_times[0])} ms first, {ms(st.step_times[-1])} ms "
      "steady",
      "  carried into the next step's warm-up (step t's actions still running when "
      "step t+1 starts, simulated):",
    ]
    rows = self.carried_actions
    for s, row in enumerate(rows):
      text = " ".join(row) if row else "-"
      lines.append(f"    stage {s}: {text[:160]}{' ...' if len(text) > 160 else ''}")
    return lines

  def __repr__(self) -> str:
    return self.summary()

  def _repr_html_(self) -> str:
    return f"<pre>{html.escape(self.summary())}</pre>"

  def plot(self, ax=None):
    """Stages x time with the model's costs (simulated, ms); returns the Axes."""
    ms = {k: v * 1e3 for k, v in self.costs.items()}
    ax = self.schedule.plot(ms, ax=ax, comm=self.comm * 1e3)
    ax.set_xlabel(f"ms (simulated, {self.device} cost model)")
    ax.set_title(
      f"{self.schedule.name}: bubble {self.bubble_fraction:.1%} (simulated), peak "
      f"activations {max(self.peak_activations)}",
      fontsize=9,
    )
    return ax

  def compiled(self, gpu: str = "H100", *, compiler_options=None) -> PipelineReport:
    """This report with `windows`: the step compiled for `schedule.stages`
    compile-only `gpu`s and each collective-permute's window read back. It
    compiles with `ooo.pipeline.compiler_options(schedule)`, updated by
    `compiler_options` (pass `{"xla_gpu_experimental_parallel_collective_overlap_limit":
    1}` to see XLA's default)."""
    return dataclasses.replace(self, gpu=gpu, windows=compile_windows(self, gpu, compiler_options))


def _bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB"):
    if n < 1024:
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.2f} GiB"


def _windows_text(windows, gpu) -> str:
  busy = sum(w.overlapped for w in windows)
  lines = [
    f"  compiled for {gpu} (compile-only): {len(windows)} collective-permutes, "
    f"{sum(w.in_loop for w in windows)} in the tick loop, {busy} with the tick's "
    "compute (F/B/W GEMMs) inside their window"
  ]
  lines += [f"    {w.summary()}" for w in windows]
  return "\n".join(lines)


def compile_windows(report: PipelineReport, gpu: str, compiler_options=None) -> tuple[Window, ...]:
  from ooojax import gpu_hlo
  from ooojax.passes.hlo.windows import windows
  from ooojax.passes.pipeline.execute import lower, xla_options

  c = report.call
  if c is None:
    raise ValueError(
      "this PipelineReport was not made by ooo.pipeline.explain, so there is no step to compile"
    )
  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    raise RuntimeError(f"cannot compile for a GPU here: {reason}")
  sched = report.schedule
  data = getattr(c, "data", None)
  if data is None:
    mesh = gpu_hlo.mesh(gpu, sched.stages, ("stage",))
  else:  # a (data, stage) mesh of compile-only GPUs, the user's axis types kept
    name, size, types = data
    mesh = gpu_hlo.mesh(gpu, (size, sched.stages), (name, "stage"))
    if types:
      kinds = (types.get(name), types.get(next(a for a in types if a != name), None))
      if all(k is not None for k in kinds):
        mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=kinds)
  dims = getattr(c, "fsdp", None)  # the stack's split dimensions (FSDP within the stages)
  step = lower(
    c.stage_fn,
    c.loss_fn,
    sched,
    mesh,
    "stage",
    c.input_fn,
    data_axis=data and data[0],
    fsdp=dims or "keep",
  )
  args = (c.stage_params, c.batch) + (() if c.shared is None else (c.shared,))
  # what a user's step compiles with (`ooo.pipeline.compiler_options`), theirs winning
  opts = {**xla_options(sched), **(compiler_options or {})}
  # a loss traced under the user's `jax.set_mesh` compiles under this mesh set the same way
  ctx = jax.sharding.get_abstract_mesh()
  with jax.set_mesh(mesh) if not ctx.empty else contextlib.nullcontext():
    hlo = gpu_hlo.schedule(jax.jit(step), *args, mesh=mesh, compiler_options=opts)
  return windows(hlo, "collective-permute")
