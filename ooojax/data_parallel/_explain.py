"""`ooo.explain(..., mode="data_parallel")`: buckets, reverse first-k and the link schedule.

The plan is the one `ooo.grad(mode="data_parallel")` emits
(`passes.collectives.plan` over one device's in-order compute schedule); the
report adds what people ask of it: which parameters each all-reduce carries,
how long the link is busy, and how much of that the backward hides. Every
time is a cost-model (and link-model) estimate, never a measurement.
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any

import jax

from ooojax.data_parallel import _link_bound
from ooojax.passes.collectives import plan as collectives
from ooojax.passes.simulate import Timeline

# `explain` keywords that only the data-parallel report takes (not `ooo.grad` options).
EXPLAIN_ONLY = ("axis_size", "cross_step")
# The plan must beat one all-reduce after the backward by this share to be worth its buckets.
STEP_ASIDE = 0.02


@dataclasses.dataclass(frozen=True)
class BucketRow:
  """One all-reduce: what it carries and when the link runs it (simulated)."""

  index: int
  paths: tuple[str, ...]  # parameter paths of its gradient leaves
  nbytes: int
  after: str  # compute unit it is issued after ("" = after the backward)
  start: float  # seconds, on the link
  end: float
  deferred: bool  # every leaf in the first k layers (reduced next step, cross-step)

  @property
  def seconds(self) -> float:
    return self.end - self.start


@dataclasses.dataclass(frozen=True)
class DataParallelReport:
  """The data-parallel plan of one `ooo.grad(mode="data_parallel")` call.

  `compute` is the one-device split and in-order schedule (an `ooo.Report`),
  `plan` the `passes.collectives.plan.CollectivePlan` emitted from it.
  """

  compute: Any  # ooojax.Report (in_order, one device)
  plan: collectives.CollectivePlan
  axis_name: Any
  param_names: tuple[str, ...]  # per gradient leaf
  baseline: float  # one all-reduce after the backward, simulated
  chosen: tuple[str, ...] = ()  # which of "bucket_bytes", "first_k" the model chose
  call: Any = dataclasses.field(default=None, compare=False, repr=False)  # for compiled()
  # predicted per-device memory beside plain GSPMD's (`data_parallel._memory`)
  memory: Any = None
  # the same plan with `reduce_dtype=jnp.bfloat16` (where it would halve the bytes)
  bf16_plan: collectives.CollectivePlan | None = None
  # a link-bound step (`_link_bound.bound`) planned for `dp.make_train_step(cross_step=True)`
  carried: Any = None

  mode = "data_parallel"

  # --- what the plan says ----------------------------------------------------
  @property
  def first_k(self) -> int:
    return self.plan.first_k

  @property
  def first_k_layers(self) -> tuple[str, ...]:
    """The layers whose dW runs after the dX chain, in forward order."""
    return tuple(collectives.layers_forward(self.compute.split)[: self.first_k])

  @property
  def first_k_main_layers(self) -> tuple[str, ...]:
    """`first_k_layers` that hold a conv or matmul weight gradient (the leading
    conv/dense layers first-k is about); the others (BatchNorm scales, biases
    of their own module) go along with them."""
    heavy = _heavy_layers(self.compute.split)
    return tuple(l for l in self.first_k_layers if l in heavy)

  def timeline(self) -> Timeline:
    """Compute (stream 0) next to the link (stream 1), simulated."""
    return self.plan.timeline()

  @property
  def buckets(self) -> tuple[BucketRow, ...]:
    spans = {s.unit: s for s in self.timeline().spans}
    deferred = self._carried_leaves()
    return tuple(
      BucketRow(
        b.index,
        tuple(self.param_names[i] for i in b.grads),
        b.nbytes,
        b.after,
        spans[f"S{b.index}"].start,
        spans[f"S{b.index}"].end,
        bool(b.grads) and set(b.grads) <= deferred,
      )
      for b in self.plan.buckets
    )

  @property
  def carried_paths(self) -> tuple[str, ...]:
    """Gradient leaves whose all-reduce and update `dp.make_train_step(cross_step=True)`
    carries into the next step (the first k layers', or the last layers the forward
    reads: `plan.carried`), in leaf order."""
    return tuple(self.param_names[i] for i in sorted(self._carried_leaves()))

  def _carried_leaves(self) -> frozenset[int]:
    return collectives.first_k_leaves(self.compute.split, self.first_k) | self.plan.carried

  @property
  def carried_bytes(self) -> int:
    """Bytes of those gradients: what `Pending.local` holds per device between steps."""
    sp = self.compute.split
    outs = sp.jaxpr.jaxpr.outvars[sp.grad_out_start :]
    return sum(int(outs[i].aval.size) * outs[i].aval.dtype.itemsize for i in self._carried_leaves())

  @property
  def hidden_seconds(self) -> float:
    """Simulated step time saved by finishing the carried all-reduces under the
    next step's forward (`plan.makespan - plan.cross_step`; 0 when k = 0)."""
    c = self.plan.cross_step
    return max(self.plan.makespan - c, 0.0) if self.first_k and c == c else 0.0

  @property
  def compute_seconds(self) -> float:
    """The compute stream's kernel seconds (the backward alone), its stalls at the
    collectives' dones left out (those are exposed communication, as in the replay)."""
    return sum(s.end - s.start for s in self.timeline().spans if s.stream == 0)

  @property
  def comm_seconds(self) -> float:
    """Link busy time: every all-reduce, buckets and in-loop reductions."""
    return sum(
      s.end - s.start for s in self.timeline().spans if s.stream == collectives.LINK_STREAM
    )

  @property
  def exposed_seconds(self) -> float:
    """Communication left after the compute ends."""
    return max(self.plan.makespan - self.compute_seconds, 0.0)

  @property
  def link_floor(self) -> float:
    """Exposed time no schedule reducing within the step avoids (simulated; see
    `data_parallel._link_bound`)."""
    return _link_bound.floor(self.plan)

  @property
  def link_bound(self) -> bool:
    return _link_bound.bound(self.plan)

  @property
  def overlap(self) -> float:
    """Share of the communication hidden under compute (1.0 = all of it)."""
    c = self.comm_seconds
    return 1.0 - self.exposed_seconds / c if c else 1.0

  def summary(self) -> str:
    p, split = self.plan, self.compute.split
    total = sum(b.nbytes for b in p.buckets) + sum(l.nbytes for l in p.loops)
    how = lambda name: "chosen by the cost model" if name in self.chosen else "given"  # noqa: E731
    n_heavy = len(_heavy_layers(split))
    lines = [
      f"ooojax data-parallel plan (axis {self.axis_name!r} x {p.n_devices} devices, link "
      f"{p.link.name}, device spec={self.compute.schedule.device})",
      f"  gradients: {len(self.param_names)} leaves in {p.n_layers} layers ({n_heavy} with a "
      f"conv/matmul weight), {total} bytes on the link"
      + (f" (reduced in {jax.numpy.dtype(p.reduce_dtype).name})" if p.reduce_dtype else "")
      + f"; dW clusters (one per leaf): {len(split.clusters)}",
      "  what the plan does: each device computes the gradient of its shard; a bucket is a "
      "group of gradient leaves reduced over the devices by one all-reduce, issued as soon "
      "as the backward has produced all of them, so it runs while the rest of the backward "
      "computes (bucket_bytes caps its size). Reverse first-k computes the weight "
      "gradients of the model's first k layers after the whole dX chain, first layer "
      "first: the next step's forward needs those layers first, and their all-reduces "
      "then finish in that order.",
      f"  reverse first-k: k={p.first_k} of {p.n_layers} layers ({how('first_k')})"
      + (
        f": {self._first_k_text()} run their dW after the dX chain, in forward order"
        if p.first_k
        else ": every layer's dW runs as soon as the backward reaches it"
      ),
      f"  buckets: {len(p.buckets)} (one all-reduce each), bucket_bytes={p.bucket_bytes} "
      f"({how('bucket_bytes')}); on the link (simulated):",
    ]
    for b in self.buckets:
      names = ", ".join(b.paths[:3]) + (f" +{len(b.paths) - 3}" if len(b.paths) > 3 else "")
      lines.append(
        f"    S{b.index}: {len(b.paths)} leaves, {b.nbytes} B, after "
        f"{b.after or 'the backward'}, {b.start * 1e3:.3f}-{b.end * 1e3:.3f} ms"
        f"{' (first-k)' if b.deferred else ''}: {names}"
      )
    for l in p.loops:
      lines.append(
        f"    loop {l.index}: {len(l.grads)} stacked leaves, {l.nbytes} B, reduced "
        f"one layer per trip inside the scan ({l.trips} trips)"
      )
    for name, stream in (("compute", p.streams[0]), ("link", p.streams[1])):
      text = " ".join(a.unit for a in stream)
      lines.append(f"  {name + ':':<8} {text[:200]}{' ...' if len(text) > 200 else ''}")
    # the carried plan's (below) where one was priced: this plan's k carries less
    c_step = self.carried.cross_step if self.carried is not None else p.cross_step
    cross = (
      f"; with cross-step overlap (dp.make_train_step) {c_step * 1e3:.3f} ms"
      if c_step == c_step
      else ""
    )
    lines.append(
      f"  predicted step (cost + link model, not measured): compute "
      f"{self.compute_seconds * 1e3:.3f} ms, all-reduce {self.comm_seconds * 1e3:.3f} ms, "
      f"step {p.makespan * 1e3:.3f} ms ({self.exposed_seconds * 1e3:.3f} ms exposed, "
      f"{self.overlap:.0%} of the communication hidden); one all-reduce after the "
      f"backward {self.baseline * 1e3:.3f} ms ({self.baseline / p.makespan:.2f}x){cross}"
    )
    lines.append(self._carried_line())
    if self.link_bound:
      lines.append(_link_bound.line(self))
    if self.carried is not None:
      c = self.carried
      what = (
        f"the last {len(c.carried)} leaves the forward reads"
        if c.carried
        else f"the first {c.first_k} layers"
        if c.first_k
        else "nothing"
      )
      lines.append(
        "  or exact, with the link busy under the next forward too: carried into it "
        f"(dp.make_train_step(cross_step=True), {what}, bucket_bytes={c.bucket_bytes}) "
        f"the step simulates at {c.cross_step * 1e3:.3f} ms against {p.makespan * 1e3:.3f}; "
        "compile it with the link's profile (ooojax.gpu_hlo.pgle_options) so that XLA "
        "starts the carried all-reduces as the step starts"
      )
    if p.makespan >= self.baseline * (1 - STEP_ASIDE):
      lines.append(
        "  nothing to gain on this link: early buckets do not beat one all-reduce after the "
        "backward (simulated), which is what plain GSPMD does; step aside: plain jax.grad "
        "under jax.jit is as good here"
      )
    lines.append(
      "  XLA's own data parallel (plain jax.jit of jax.grad) next to this plan, compiled and "
      "replayed per link: .versus_xla()"
    )
    if self.memory is not None:  # the memory section (`data_parallel._memory`)
      lines += self.memory.lines()
    return "\n".join(lines)

  def _first_k_text(self) -> str:
    """The first-k layers named by their conv/dense layers; the rest counted."""
    layers, main = self.first_k_layers, self.first_k_main_layers
    if not main or len(main) == len(layers):
      return _names(layers)
    return (
      f"{_names(main)} (with {len(layers) - len(main)} parameter groups of their own "
      f"without a conv/matmul weight, e.g. {layers[[l in main for l in layers].index(False)]}"
      ": normalisation scales and biases)"
    )

  def _carried_line(self) -> str:
    p = self.plan
    if p.carried:
      paths = self.carried_paths
      names = ", ".join(paths[:4]) + (f" +{len(paths) - 4}" if len(paths) > 4 else "")
      return (
        "  carried to the next step (dp.make_train_step, cross_step=True): the all-reduce "
        f"and optimizer update of the last layers the forward reads ({len(paths)} leaves, "
        f"{self.carried_bytes} B per device in Pending: {names}), run under step t+1's "
        f"earlier layers; simulated step {p.makespan * 1e3:.3f} -> "
        f"{p.cross_step * 1e3:.3f} ms ({self.hidden_seconds * 1e3:.3f} ms hidden)"
      )
    if not self.first_k:
      return (
        "  carried to the next step (dp.make_train_step, cross_step=True): nothing "
        "(k=0: every all-reduce and update finishes in its own step)"
      )
    paths = self.carried_paths
    names = ", ".join(paths[:4]) + (f" +{len(paths) - 4}" if len(paths) > 4 else "")
    return (
      f"  carried to the next step (dp.make_train_step, cross_step=True): the all-reduce "
      f"and optimizer update of layers {self._first_k_text()} ({len(paths)} "
      f"leaves, {self.carried_bytes} B per device in Pending: {names}), run under "
      f"step t+1's forward; simulated step {p.makespan * 1e3:.3f} -> "
      f"{p.cross_step * 1e3:.3f} ms ({self.hidden_seconds * 1e3:.3f} ms hidden)"
    )

  def __repr__(self) -> str:
    return self.summary()

  def _repr_html_(self) -> str:
    return f"<pre>{html.escape(self.summary())}</pre>"

  def plot(self, ax=None):
    """Gantt chart: compute next to the link, simulated; returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
      _, ax = plt.subplots(figsize=(10, 1.8))
    colors = {"F": "#9e9e9e", "X": "#d62728", "W": "#1f77b4", "S": "#2ca02c"}
    for s in self.timeline().spans:
      ax.barh(
        s.stream,
        (s.end - s.start) * 1e3,
        left=s.start * 1e3,
        color=colors[s.unit[0]],
        edgecolor="white",
        linewidth=0.3,
      )
      if s.unit[0] == "S" and (s.end - s.start) > 0.04 * self.plan.makespan:
        ax.text(
          (s.start + s.end) / 2 * 1e3,
          s.stream,
          s.unit,
          ha="center",
          va="center",
          fontsize=7,
          color="white",
        )
    ax.set_yticks([0, 1], ["compute", f"link ({self.plan.link.name})"])
    ax.invert_yaxis()
    ax.set_xlabel(
      f"ms (simulated, {self.compute.schedule.device} cost model, {self.plan.n_devices} devices)"
    )
    ax.set_title(
      f"F forward / dX (red) / dW (blue) / all-reduce (green): k={self.first_k}, "
      f"{len(self.plan.buckets)} buckets, {self.overlap:.0%} hidden",
      fontsize=9,
    )
    return ax

  def compiled(self, gpu: str = "H100", *, batch_argnums=None, compiler_options=None, pgle=None):
    """Compiles the same data-parallel gradient for `plan.n_devices` compile-only
    `gpu`s (`jax.shard_map` over them) and reads each all-reduce's window.

    Args:
      gpu: "H100", "H200" or "A100" (`ooojax.gpu_hlo`).
      batch_argnums: positional arguments split over the devices (their leading
        axis grows `n_devices`-fold: the explained arguments are one device's
        shard); default every argument that is not differentiated.
      compiler_options: XLA options for the compile.
      pgle: opt-in. True (the plan's link) or a `passes.hlo.replay.REPLAY_LINKS`
        name / `Link`: compile once, write each collective's cost on that link as
        an XLA latency profile (`passes.hlo.pgle`), and compile again with it, so
        XLA's scheduler opens each window for the link's transfer time instead of
        its own NVLink-fast estimate. The same profile serves a real GPU's compile
        (`ooojax.gpu_hlo.pgle_options`).

    Returns:
      A `CompiledDataParallel`: `.windows` (`passes.hlo.windows.Window`, one per
      all-reduce), `.summary()`, `.hlo`.
    """
    from ooojax.data_parallel._compile import compile_dp

    return compile_dp(self, gpu, batch_argnums, compiler_options, pgle=pgle)

  def versus_xla(
    self,
    gpu: str = "H100",
    *,
    links=None,
    buckets=(),
    batch_argnums=None,
    compiler_options=None,
  ):
    """ooojax's compiled step next to XLA's own (plain `jax.jit(jax.grad)`, GSPMD), per link.

    Both programs are compiled for `plan.n_devices` compile-only `gpu`s and
    replayed (`passes.hlo.replay`) on each link of `links` (default: the plan's
    link, NVLink, 400 / 100 Gb InfiniBand, 25GbE): step, exposed communication,
    reductions, and the compiled temp memory; where XLA's step is shorter the
    report says to step aside. `buckets`: more bucket sizes (bytes) to compile and
    replay beside the plan's; each link keeps the fastest (the bucket size chosen on
    the compiled program). A `data_parallel._versus.VersusXla`.
    """
    from ooojax.data_parallel._versus import versus_xla

    return versus_xla(self, gpu, links, batch_argnums, compiler_options, buckets)


def _names(layers, most: int = 12) -> str:
  text = ", ".join(layers[:most])
  return text + (f" +{len(layers) - most} more" if len(layers) > most else "")


def _heavy_layers(split) -> frozenset[str]:
  """Layers with a dW cluster holding a conv or matmul (a conv/dense weight)."""
  eqns = split.jaxpr.jaxpr.eqns
  heavy = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general")
  return frozenset(
    collectives.layer_of(c.param)
    for c in split.clusters
    if any(eqns[k].primitive.name in heavy for k in c.eqns)
  )


def _axis_size(axis_name, axis_size) -> int:
  if axis_size is None:
    try:
      return int(jax.lax.axis_size(axis_name))
    except NameError:
      raise ValueError(
        f"explain(mode='data_parallel') outside jax.pmap / jax.shard_map cannot read the "
        f"size of axis {axis_name!r}: pass axis_size=N (the number of devices the batch "
        "is split over), e.g. ooo.explain(loss, params, batch, mode='data_parallel', "
        f"axis_name={axis_name!r}, axis_size=8)"
      ) from None
  if not isinstance(axis_size, int) or isinstance(axis_size, bool) or axis_size < 1:
    raise ValueError(
      f"axis_size must be a positive int (devices on axis {axis_name!r}), got {axis_size!r}"
    )
  return axis_size


def _param_names(args, argnums, idx, g_parts) -> tuple[str, ...]:
  """Key paths of the traced gradient leaves, named as the clusters are (`_api`)."""
  tree = args[idx[0]] if isinstance(argnums, int) else tuple(args[i] for i in idx)
  paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  return tuple(jax.tree_util.keystr(p) for (p, _), part in zip(paths, g_parts) if part is None)


def explain_dp(
  fun,
  args,
  argnums,
  has_aux,
  options: dict,
  kwargs: dict,
  *,
  axis_size=None,
  cross_step: bool = False,
) -> DataParallelReport:
  """`ooo.explain` for mode="data_parallel"; `args` are one device's shard."""
  from ooojax._api import _check_argnums, _make_options, _resolve_argnums, value_and_grad
  from ooojax._compiled import Call
  from ooojax._report import Report
  from ooojax.passes.cost import CostModel

  opts = _make_options(options)  # TypeError / ValueError as ooo.grad raises them
  if opts.axis_name is None:
    raise ValueError(
      "explain(mode='data_parallel') needs axis_name, the mapped axis the "
      "batch is split over, and axis_size=N"
    )
  n = _axis_size(opts.axis_name, axis_size)
  argnums = _check_argnums(argnums)
  idx = _resolve_argnums(argnums, len(args))
  # One device's gradient, traced and scheduled in order as the data-parallel
  # mode (and `dp.make_train_step`) traces it; shapes are enough.
  vg = value_and_grad(
    fun, argnums, has_aux, mode="in_order", device=opts.device, measured=opts.measured
  )
  plan, _ = vg.plan(args, kwargs)
  split, sched = plan.split, plan.schedule
  cm = CostModel(opts.device, opts.measured)
  plan_with = lambda rd: collectives.plan(  # noqa: E731
    split,
    sched,
    cm,
    n,
    opts.link,
    opts.bucket_bytes,
    opts.first_k,
    cross_step=bool(cross_step),
    reduce_dtype=rd,
  )
  cp = plan_with(opts.reduce_dtype)
  # what bf16 on the link would predict, shown where the plan is link-bound
  low = None
  if n > 1 and _link_bound.bf16_cuts_bytes(opts.reduce_dtype, split):
    low = plan_with(jax.numpy.bfloat16)
  base = collectives.build_plan(
    split,
    sched,
    0,
    1 << 62,
    cp.link,
    n,
    in_loop=False,
    cross=False,
    costs=collectives.BucketCosts.of(cm.spec) if n > 1 else None,
    reduce_dtype=opts.reduce_dtype,
  ).makespan
  names = _param_names(args, argnums, idx, plan.out_tree[3])
  chosen = tuple(k for k in ("bucket_bytes", "first_k") if getattr(opts, k) is None)
  call = Call(fun, tuple(args), argnums, has_aux, dict(options), dict(kwargs))
  memory = _predict_memory(
    args, argnums, idx, plan.out_tree[3], split, cp, names, opts, n, cm.spec.name
  )
  report = DataParallelReport(
    Report(split, sched, "in_order"), cp, opts.axis_name, names, base, chosen, call, memory, low
  )
  if not cross_step and report.link_bound:
    carried = collectives.plan(
      split,
      sched,
      cm,
      n,
      cp.link,
      opts.bucket_bytes,
      opts.first_k,
      cross_step=True,
      reduce_dtype=opts.reduce_dtype,
    )
    if carried.cross_step < cp.makespan * (1 - 1e-9):
      report = dataclasses.replace(report, carried=carried)
  return report


def _predict_memory(args, argnums, idx, g_parts, split, cp, names, opts, n, device):
  """The report's memory section: parameters' layouts from their shardings, and the
  FSDP mode the call runs (`device`: the device spec's name)."""
  from ooojax import _dp_gspmd
  from ooojax.data_parallel import _memory
  from ooojax.passes.collectives import fsdp_mode

  tree = args[idx[0]] if isinstance(argnums, int) else tuple(args[i] for i in idx)
  leaves = [x for x, part in zip(jax.tree_util.tree_leaves(tree), g_parts) if part is None]
  layouts = _memory.leaf_layouts(leaves, _dp_gspmd._boxed_specs(args, idx), opts.axis_name, n)
  fsdp = [l for l in layouts if l.fsdp]
  choice = fsdp_mode.choose(opts.fsdp, sum(l.nbytes for l in fsdp), n, cp.link, device, len(fsdp))
  return _memory.predict(split, cp, names, layouts, n, choice)
