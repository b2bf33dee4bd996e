"""`ooo.explain`: what was split and how it was scheduled, for people."""

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
  the deferred train step (`ooojax._defer_plan`: which dW clusters run in the next step, the bytes
  carried in `Pending`, the simulated step with and without deferral).
  """

  split: Split
  schedule: Schedule
  mode: str
  call: Any = dataclasses.field(default=None, compare=False, repr=False)  # for compiled()
  carried: Any = None

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


def explain(fun, *args, argnums=0, has_aux=False, **options):
  """Splits and schedules `fun` at `args` without running it.

  Takes `ooo.grad`'s arguments and options (`kwargs={...}` for `fun`'s keyword
  arguments) and returns a `Report`. With `mode="data_parallel"` (and
  `axis_name`) it returns a `DataParallelReport` instead: `args` are one
  device's shard, `axis_size=N` gives the number of devices outside
  `pmap` / `shard_map`, `cross_step=True` chooses k as
  `ooojax.data_parallel.make_train_step` does. Pipelines:
  `ooo.pipeline.explain`. With `defer="auto" | paths | predicate` (as
  `ooojax.single_gpu.make_train_step` takes it; `fun(params, batch)`) the
  report also says what the deferred train step carries to the next step
  (`Report.carried`).

  >>> import jax.numpy as jnp, ooojax as ooo
  >>> r = ooo.explain(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((3, 2)), jnp.ones((4, 3)))
  >>> r.counts["DW"] > 0
  True
  >>> d = ooo.explain(lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]) * p["s"]),
  ...                 {"w": jnp.ones((3, 2)), "s": jnp.ones(2)}, jnp.ones((4, 3)),
  ...                 mode="data_parallel", axis_name="batch", axis_size=8, bucket_bytes=1)
  >>> [b.paths for b in d.buckets]
  [("['w']",), ("['s']",)]
  >>> c = ooo.explain(lambda p, x: jnp.mean((jnp.tanh(x @ p["a"]) @ p["b"]) ** 2),
  ...                 {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 2))}, jnp.ones((8, 3)),
  ...                 defer=("b",)).carried
  >>> c.deferred_paths, c.carried_bytes        # b's input activation and output cotangent
  (("['b']",), 192)

  What users hold is taken as it is: an nnx module or a `(graphdef, state)`
  pair as the differentiated argument (its non-float leaves, such as RNG keys,
  are not differentiated), and a loss that names a mesh axis (synchronised
  BatchNorm outside `pmap`) with `mesh=` (a `Mesh`, `AbstractMesh` or
  `{name: size}`) and `axis_name=`: the loss is traced with the axis bound,
  shapes only. In data-parallel mode `axis_name` and `axis_size` bind it.

  Data parallel as a sharded-jit (GSPMD) user holds it: `mode="data_parallel",
  mesh=mesh` takes the axis size from the mesh and the data axis from
  `axis_name=` or else from the batch's own sharding (the mesh axis its
  leading dimension is split over); such a batch is the global one, explained
  as one device's shard of it.
  """
  from ooojax import _explain_inputs as inputs

  kwargs = options.pop("kwargs", {})
  mesh = options.pop("mesh", None)
  mode = options.get("mode", "auto")
  axes = inputs.mesh_axes(mesh) if mesh is not None else {}
  bound = None
  if mode == "data_parallel" and mesh is not None and "axis_size" not in options:
    # as a GSPMD user holds it: the data axis named, or found from the batch's sharding
    from ooojax._api import _check_argnums, _resolve_argnums

    idx = _resolve_argnums(_check_argnums(argnums), len(args))
    name = options["axis_name"] = inputs.data_axis(args, idx, axes, options.get("axis_name"))
    options["axis_size"] = axes[name]
    args = inputs.local_args(tuple(args), idx, name, axes[name])
  elif mode == "data_parallel":
    name = options.get("axis_name")
    if name is not None and name in axes and "axis_size" not in options:
      options["axis_size"] = axes[name]
    elif name is not None and _explain_dp_size_ok(options.get("axis_size")):
      axes.setdefault(name, options["axis_size"])  # bound while tracing (sync BatchNorm)
  elif "axis_name" in options:
    # outside data_parallel, axis_name= names the axis the loss reads (bound from mesh=)
    bound = options.pop("axis_name")
    if bound not in axes:
      raise ValueError(
        f"axis_name={bound!r} outside mode='data_parallel' names the mesh axis the loss "
        f"reads; pass mesh= with that axis too, e.g. ooo.explain(loss, params, batch, "
        f"mesh=jax.make_mesh((8,), ({bound!r},)), axis_name={bound!r})"
        if mesh is None
        else f"axis_name={bound!r} is not an axis of mesh= ({list(axes)})"
      )
  from ooojax._api import _check_argnums, _resolve_argnums

  idx = _resolve_argnums(_check_argnums(argnums), len(args))
  moved = inputs.float_only(fun, tuple(args), idx, options.get("allow_int", False))
  if moved is not None:
    fun, args = moved.fun, moved.args

  def run():
    try:
      return _explain(fun, args, argnums, has_aux, options, kwargs)
    except NameError as e:
      if "axis name" in str(e):
        raise inputs.unbound_axis_note(e, mode)  # noqa: B904 - the same error, a note added
      raise

  return inputs.run_bound(run, axes) if axes else run()


def _explain_dp_size_ok(n) -> bool:
  # a bad axis_size is left to explain_dp's own error
  return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _explain(fun, args, argnums, has_aux, options, kwargs):
  from ooojax import _explain_dp
  from ooojax._api import value_and_grad
  from ooojax._compiled import Call

  defer = options.pop("defer", None)
  only = {k: options.pop(k) for k in _explain_dp.EXPLAIN_ONLY if k in options}
  if options.get("mode") == "data_parallel":
    if defer is not None:
      raise ValueError(
        "defer= explains the single-GPU deferred step; with mode="
        "'data_parallel' pass cross_step=True (the first-k layers' "
        "all-reduce and update carried to the next step) instead"
      )
    return _explain_dp.explain_dp(fun, args, argnums, has_aux, options, kwargs, **only)
  if only:
    raise ValueError(
      f"{sorted(only)} apply to mode='data_parallel' only (got mode="
      f"{options.get('mode', 'auto')!r})"
    )
  vg = value_and_grad(fun, argnums, has_aux, **options)
  plan, _ = vg.plan(args, kwargs)
  carried = None
  if defer is not None:
    from ooojax._defer_plan import plan_deferral

    if argnums != 0 or not args:
      raise ValueError(
        f"defer= explains single_gpu.make_train_step, which differentiates "
        f"the first argument (params): use argnums=0, got {argnums!r}"
      )
    carried = plan_deferral(
      plan, args[0], defer, CostModel(vg.options.device, vg.options.measured), has_aux
    )
  return Report(
    plan.split,
    plan.schedule,
    vg.options.resolved_mode(),
    Call(fun, args, argnums, has_aux, dict(options), dict(kwargs)),
    carried,
  )
