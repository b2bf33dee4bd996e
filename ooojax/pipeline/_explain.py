"""`ooo.pipeline.explain`: a pipeline schedule priced on the model it would run.

The table (`passes.pipeline.schedule`) says what runs where; the stage cut
(`passes.pipeline.program.program`: F / B / W phases of the user's stage
function, by the split pass) gives each phase a cost-model price, with which
the table's simulator (`passes.pipeline.simulate`) gives the bubble; the
same cut gives the bytes per device (`memory`). With a compile-only GPU the
report also reads, from the compiled tick loop, which collective-permutes
have the tick's compute inside their start..done window. Bubble and times
are simulated (cost model), never measured.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Callable, Mapping
from typing import Any

import jax

from ooojax.passes.hlo.windows import Window
from ooojax.passes.pipeline.program import Memory
from ooojax.passes.pipeline.schedule import PipelineSchedule


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
    compile-only `gpu`s and each collective-permute's window read back."""
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


@dataclasses.dataclass(frozen=True)
class _Call:
  stage_fn: Callable
  loss_fn: Callable
  stage_params: Any
  batch: Any
  shared: Any
  input_fn: Callable | None


def _phase_costs(prog, device) -> tuple[tuple[str, float, float, float], ...]:
  from ooojax.passes.cost import CostModel

  cm = CostModel(device)
  out = []
  for fl in prog.flavors:
    price = lambda ids, fl=fl: cm.unit_cost([fl.jaxpr.eqns[k] for k in ids]).seconds  # noqa: E731
    kind = (
      "first and last"
      if fl.first and fl.last
      else ("first" if fl.first else "last" if fl.last else "middle")
    )
    out.append((kind, price(fl.f_eqns), price(fl.b_eqns), price(fl.w_eqns)))
  return tuple(out)


def _schedule(schedule, stage_params, microbatches, chunks) -> PipelineSchedule:
  from ooojax.passes.pipeline.generate import SCHEDULES, generate
  from ooojax.pipeline._automatic import _table

  if not isinstance(schedule, str):  # a table (validated), or the TypeError
    return _table(schedule, 0, microbatches, chunks)
  if schedule not in SCHEDULES:
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
  leaves = jax.tree.leaves(stage_params)
  if not leaves or any(len(getattr(x, "shape", ())) < 1 for x in leaves):
    raise ValueError(
      "stage_params leaves must be arrays stacked on a leading axis of (virtual) stages"
    )
  v = leaves[0].shape[0]
  c = chunks or (2 if schedule in ("interleaved", "zb-v") else 1)
  if v % c:
    raise ValueError(f"stage_params hold {v} virtual stages, not a multiple of chunks={c}")
  return generate(schedule, v // c, microbatches or 2 * (v // c), chunks)


def explain(
  fn: Callable,
  *args,
  schedule: str | PipelineSchedule | None = None,
  shared=None,
  input_fn: Callable | None = None,
  stages: int | None = None,
  mesh=None,
  axis_name: str | None = None,
  layers=None,
  has_aux: bool = False,
  microbatches: int | None = None,
  chunks: int | None = None,
  device: str = "H100",
  link: str | None = None,
  gpu: str | None = None,
  compiler_options=None,
  steps: int = 1,
  budget: int | None = None,
  state_argnums=(),
) -> PipelineReport:
  """The schedule, its simulated bubble and the memory per stage for this model.

  Two forms, as `ooo.pipeline.value_and_grad`: `explain(stage_fn, loss_fn,
  schedule, stage_params, batch, shared=None, input_fn=None)` (a stack written
  by hand), or `explain(loss_fn, params, *batch, stages=N or mesh=...,
  axis_name=..., schedule="ooo", layers=None, has_aux=False)` (the plain loss,
  cut and balanced as the automatic `value_and_grad` does; the report adds
  `cut`, an `AutoCut`, and `balance`, a `Balance`).

  Args:
    stage_fn, loss_fn, stage_params, batch, shared, input_fn: as for
      `ooo.pipeline.memory` / `value_and_grad`; arrays or `jax.ShapeDtypeStruct`s.
    schedule: a `PipelineSchedule`, or a name (`SCHEDULES`): then the stages
      are the leading axis of `stage_params` over `chunks`, and `microbatches`
      defaults to 2 x stages.
    device: the cost-model spec the phases are priced with.
    link: a network preset ("nvlink", "100GbE", ...) whose transfer of one
      activation delays each cross-device dependency in the simulation. With
      the schedule named "ooo", its in-flight depth is planned on this link
      (`ooo.pipeline.plan_ooo`, the executor's replay with the link's
      bandwidth shared): `report.depth` and the summary give the chosen depth,
      its peak activations, and the simulated step beside GPipe's and 1F1B's.
    budget: activations a stage may hold when planning "ooo" on a link
      (default GPipe's: the microbatches).
    gpu: "H100" / "H200" / "A100": also compile the step for compile-only
      GPUs (`ooojax.gpu_hlo`) and read the collective-permute windows.
    stages, mesh, axis_name, layers, has_aux, state_argnums: (automatic form) the
      stage count (or the mesh axis that sets it) and `value_and_grad`'s
      `layers`, `has_aux`, `state_argnums`.
    steps: >= 2 also simulates the table tiled over that many training steps
      (`passes.pipeline.steps`): the per-step bubble beside the one-step
      bubble, and which actions of step t run during step t + 1's warm-up.

  Returns:
    A `PipelineReport`.

  >>> import jax.numpy as jnp, ooojax as ooo
  >>> from ooojax.models import mlp_stack
  >>> stage_fn, loss_fn, params, batch = mlp_stack.make(4, layers=4, dim=64, hidden=128)
  >>> r = ooo.pipeline.explain(stage_fn, loss_fn, "1f1b", params, batch, microbatches=8)
  >>> r.peak_activations, round(r.unit_bubble_fraction, 3)
  ((4, 3, 2, 1), 0.273)
  >>> z = ooo.pipeline.explain(stage_fn, loss_fn, "zb-h2", params, batch, microbatches=8,
  ...                          steps=3)
  >>> z.carried_actions        # this model's costs (B > F > W): stage 0 ends each step last
  ((), (), (), ())
  >>> import dataclasses       # F = B = W: the last stages drain under the next warm-up
  >>> unit = dataclasses.replace(z, costs={"F": 1.0, "B": 1.0, "W": 1.0})
  >>> unit.carried_actions[3], round(unit.steady_state().steady_bubble, 3)
  (('3W5', '3W6', '3W7', '3U'), 0.0)

  The automatic form, on a plain loss (shapes only):

  >>> def plain(w, x, t):
  ...   h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]
  ...   return jnp.mean((h - t) ** 2)
  >>> sd = jax.ShapeDtypeStruct((16, 64), jnp.float32)
  >>> a = ooo.pipeline.explain(plain, jax.ShapeDtypeStruct((8, 64, 64), jnp.float32), sd, sd,
  ...                          stages=4, schedule="1f1b", microbatches=8)
  >>> a.balance.counts, a.cut.layers, a.cut.scanned, a.peak_activations
  ((2, 2, 2, 2), 8, True, (4, 3, 2, 1))
  """
  plan = link is not None and schedule in ("ooo", None)
  kw = dict(
    microbatches=microbatches,
    chunks=chunks,
    device=device,
    link=link,
    gpu=gpu,
    compiler_options=compiler_options,
    steps=steps,
    budget=budget,
    plan=plan,
  )
  if args and callable(args[0]):  # explicit: (stage_fn, loss_fn, schedule, ...)
    auto = {
      k: v
      for k, v in dict(
        stages=stages,
        mesh=mesh,
        axis_name=axis_name,
        layers=layers,
        has_aux=has_aux,
        state_argnums=state_argnums,
      ).items()
      if v
    }
    if auto:
      raise TypeError(
        f"{', '.join(auto)} belong to the automatic form explain(loss_fn, "
        "params, *batch, stages=...); the explicit form's schedule and "
        "stage_params set the stages"
      )
    bound = _bind(
      *args,
      **({} if schedule is None else {"schedule": schedule}),
      **({} if shared is None else {"shared": shared}),
      **({} if input_fn is None else {"input_fn": input_fn}),
    )
    return _explain(fn, *bound, **kw)
  if shared is not None or input_fn is not None:
    raise TypeError(
      "shared and input_fn belong to the explicit form explain(stage_fn, "
      "loss_fn, schedule, stage_params, batch, ...); the automatic form "
      "explain(loss_fn, params, *batch, stages=...) finds them itself"
    )
  if not args:
    raise TypeError(
      "explain(loss_fn, params, *batch, stages=...) needs the params and "
      "the batch (arrays or jax.ShapeDtypeStructs)"
    )
  return _explain_auto(
    fn,
    args[0],
    args[1:],
    "ooo" if schedule is None else schedule,
    stages,
    mesh,
    axis_name,
    layers,
    has_aux,
    state_argnums=state_argnums,
    **kw,
  )


def _bind(loss_fn, schedule, stage_params, batch, shared=None, input_fn=None):
  return loss_fn, schedule, stage_params, batch, shared, input_fn


def _explain_auto(
  loss_fn,
  params,
  batch,
  schedule,
  stages,
  mesh,
  axis_name,
  layers,
  has_aux,
  *,
  microbatches,
  chunks,
  state_argnums=(),
  **kw,
) -> PipelineReport:
  """The automatic form: `loss_fn` cut and balanced by `ooojax.pipeline._automatic._auto_parts`
  (what the automatic `value_and_grad` runs), then the explicit form's report."""
  from ooojax.pipeline._automatic import _auto_parts, _table, state_leaves
  from ooojax.pipeline._tiled import _owners

  if (stages is None) == (mesh is None):
    raise TypeError("give the automatic form one of stages=N or mesh=... with axis_name=...")
  if mesh is not None:
    if axis_name not in mesh.shape:
      raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    stages = mesh.shape[axis_name]
  sched = _table(schedule, stages, microbatches, chunks)
  named, p_tree = jax.tree_util.tree_flatten_with_path(params)
  leaves = [x for _, x in named]
  sds = lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x))  # noqa: E731
  p_avals = [sds(x) for x in leaves]
  b_avals = jax.tree.map(sds, batch)
  parts = _auto_parts(
    loss_fn,
    has_aux,
    sched,
    1,
    p_avals,
    p_tree,
    b_avals,
    layers,
    state=state_leaves(batch, state_argnums),
  )
  c, counts, (stage_fn, lfn, ifn) = parts.cut, parts.balance.counts, parts.fns
  epi = lfn  # the loss and the aux (with has_aux): what the last stage reads
  if c.n_aux:  # the aux is a few values of the last stage's F: priced with the loss
    lfn = lambda y, tg, sh: epi(y, tg, sh)[0]  # noqa: E731
  stage_params = jax.eval_shape(  # with model state: its columns and probes after
    lambda ls, bs: c.stage_params(ls, counts) + c.stage_state(bs, counts),
    p_avals,
    jax.tree.leaves(b_avals),
  )
  rows = jax.eval_shape(lambda bs: parts.rowed(bs), jax.tree.leaves(b_avals))
  shared = tuple(p_avals[i] for i in c.shared)
  report = _explain(
    stage_fn, lfn, sched, stage_params, rows, shared, ifn, microbatches=None, chunks=None, **kw
  )
  # the ends as a stage runs them: on one microbatch (their equations were traced at
  # its shapes, so the whole batch would not broadcast against them)
  mb = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((x.shape[0] // sched.microbatches, *x.shape[1:]), x.dtype), rows
  )
  own = _owners(ifn, epi, mb[0], mb[1], shared, sched.virtual_stages) if shared else []
  name = lambda i: jax.tree_util.keystr(named[i][0]) or "params"  # noqa: E731
  b_named = jax.tree_util.tree_flatten_with_path(tuple(batch))[0]
  pick = lambda o: tuple(name(i) for i, w in zip(c.shared, own) if w == o)  # noqa: E731
  info = AutoCut(
    c.layers,
    c.scanned,
    c.reverse,
    tuple(name(i) for i in c.stacked[0]),
    pick(0),
    pick(sched.virtual_stages - 1),
    pick(None),
    tuple("batch" + jax.tree_util.keystr(b_named[i][0]) for i in c.side),
  )
  return dataclasses.replace(report, cut=info, balance=parts.balance)


def _explain(
  stage_fn,
  loss_fn,
  schedule,
  stage_params,
  batch,
  shared,
  input_fn,
  *,
  microbatches,
  chunks,
  device,
  link,
  gpu,
  compiler_options,
  steps,
  budget=None,
  plan=False,
) -> PipelineReport:
  from ooojax.passes.collectives.plan import get_link
  from ooojax.passes.cost import get_spec
  from ooojax.passes.pipeline.program import memory_of, program

  if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
    raise ValueError(f"steps must be an int >= 1, got {steps!r}")
  sched = _schedule(schedule, stage_params, microbatches, chunks)
  if sched.steps != 1:
    raise ValueError(
      f"explain a one-step table and pass steps={sched.steps} (the table "
      f"{sched.name!r} is already tiled over {sched.steps} steps)"
    )
  prog = program(stage_fn, loss_fn, sched, stage_params, batch, shared, input_fn)
  phases = _phase_costs(prog, device)
  # lock-step ticks: the slowest stage kind sets each phase's pace; per whole stage
  costs = {k: max(p[i] for p in phases) * sched.chunks for i, k in enumerate("FBW", 1)}
  x = prog.x_aval
  act = x.size * x.dtype.itemsize
  comm = get_link(link).seconds(act) if link is not None else 0.0
  depth = None
  if plan and sched.name == "ooo" and sched.chunks == 1:  # the depth, planned on the link
    from ooojax.passes.pipeline.depth import plan_ooo
    from ooojax.passes.pipeline.link import LinkModel

    sched, depth = plan_ooo(
      sched.stages, sched.microbatches, costs, LinkModel.of(link, act), budget, lag=sched.lag
    )
    prog = program(stage_fn, loss_fn, sched, stage_params, batch, shared, input_fn)
  name = get_spec(device).name  # a ValueError naming the specs for an unknown one
  from ooojax.passes.pipeline.sliced import sliced

  report = PipelineReport(
    sched,
    costs,
    comm,
    memory_of(prog, sched, stage_params),
    name,
    get_link(link).name if link is not None else "",
    phases,
    call=_Call(stage_fn, loss_fn, stage_params, batch, shared, input_fn),
    steps=steps,
    depth=depth,
    sliced_weights=max(sliced(fl) for fl in prog.flavors),
  )
  return report.compiled(gpu, compiler_options=compiler_options) if gpu else report


def compile_windows(report: PipelineReport, gpu: str, compiler_options=None) -> tuple[Window, ...]:
  from ooojax import gpu_hlo
  from ooojax.passes.hlo.windows import windows
  from ooojax.passes.pipeline.execute import lower

  c = report.call
  if c is None:
    raise ValueError(
      "this PipelineReport was not made by ooo.pipeline.explain, so there is no step to compile"
    )
  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    raise RuntimeError(f"cannot compile for a GPU here: {reason}")
  sched = report.schedule
  mesh = gpu_hlo.mesh(gpu, sched.stages, ("stage",))
  step = lower(c.stage_fn, c.loss_fn, sched, mesh, "stage", c.input_fn)
  args = (c.stage_params, c.batch) + (() if c.shared is None else (c.shared,))
  hlo = gpu_hlo.schedule(jax.jit(step), *args, mesh=mesh, compiler_options=compiler_options)
  return windows(hlo, "collective-permute")
