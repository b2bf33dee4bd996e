"""The pipeline's automatic form: a plain loss cut, balanced and lowered.

Shared by `ooojax.pipeline` (the façade), its train steps
(`_pipeline_train`, `_pipeline_tiled`) and `_explain_pipeline`; it sits below
all of them so that none imports back from the façade.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ooojax.passes import _compat
from ooojax.passes.pipeline.balance import Balance, balance as _balance, price as _price
from ooojax.passes.pipeline.cut import EXPLICIT as _EXPLICIT, Cut, CutError, cut
from ooojax.passes.pipeline.execute import device_order, lower
from ooojax.passes.pipeline.generate import SCHEDULES, generate
from ooojax.passes.pipeline.schedule import PipelineSchedule
from ooojax.pipeline import _example_keys


def _device_major(layout: str | None) -> bool:
  if layout not in (None, "virtual", "device"):
    raise ValueError(
      f"layout must be 'virtual' (rows in virtual-stage order) or 'device' "
      f"(device s's chunks at rows s * chunks + c), got {layout!r}"
    )
  return layout == "device"


def _table(schedule, stages: int, microbatches: int | None, chunks: int | None) -> PipelineSchedule:
  if isinstance(schedule, str):
    return generate(schedule, stages, microbatches or 2 * stages, chunks)
  if isinstance(schedule, PipelineSchedule):
    if microbatches not in (None, schedule.microbatches):
      raise ValueError(
        f"microbatches={microbatches} disagrees with the schedule's "
        f"{schedule.microbatches}; pass one or the other"
      )
    return schedule.validate()
  raise TypeError(
    f"schedule must be a name {SCHEDULES} or a PipelineSchedule, got {type(schedule).__name__}"
  )


def mean_aux(stacked):
  """The default reduction of a pipelined loss's aux over its microbatches: the
  mean of each floating leaf (a metric that is a mean over equal-sized
  microbatches comes out as on the whole batch), the others (counts, flags)
  stacked on a leading axis of microbatches, as given.

  >>> import jax.numpy as jnp
  >>> mean_aux({"acc": jnp.array([0.5, 1.0]), "n": jnp.array([3, 4])})
  {'acc': Array(0.75, dtype=float32), 'n': Array([3, 4], dtype=int32)}
  """
  return jax.tree.map(
    lambda x: jnp.mean(x, 0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
    stacked,
  )


@dataclasses.dataclass(frozen=True)
class _AutoProgram:
  """A plain loss cut for one batch: `run(cut.stage_params(leaves, balance.counts),
  batch, shared) -> (loss, (stage_grads, shared_grads))`, `batch = (inputs,
  targets[, side])` the batch leaves the prologue / epilogue / every stage read
  (scalars as a row per example)."""

  cut: Cut
  run: Callable
  batch: tuple
  balance: Balance  # layers per virtual stage (`cut.stage_params(leaves, counts)`)
  aux_tree: object = None  # the aux's treedef (`has_aux`); `run`'s loss is then (loss, aux)
  # model state (`state_argnums`): the stage columns after the parameters' (the
  # layers' state, then zero probes: `Cut.stage_state`), in the executor's row order
  state_cols: tuple = ()
  microbatches: int = 1
  lead: int = 1  # microbatches x data replicas: the aux leaves' leading size
  order: object = None  # the stage rows' order when not virtual-stage order
  whole: Callable = lambda g: g  # a stage-sharded array replicated (explicit meshes)

  def split(self, out, gp=None):
    """`(loss, aux leaves stacked over microbatches, the parameters' stage grads)` of
    `run`'s outputs (`gp`, its stage grads, give the updated state in the aux)."""
    c = self.cut
    loss, aux = out if c.n_aux else (out, ())
    if not c.emits:
      return loss, aux, gp
    n, n_st, _ = c.widths(self.balance.counts)
    probes = [self.whole(g) for g in gp[n + n_st :]]
    if self.order is not None:  # back to virtual-stage order
      probes = [g[np.argsort(self.order)] for g in probes]
    new = c.emitted(probes, self.balance.counts, self.microbatches)
    full = tuple(
      aux[k] if kind == "epilogue" else jnp.broadcast_to(new[i], (self.lead, *new[i].shape))
      for i, (kind, k) in enumerate(c.aux_at)
    )
    return loss, full, gp[:n]

  def aux(self, stacked, reduce=None):
    """The aux tree of `split`'s stacked leaves, reduced (default `mean_aux`)."""
    return (reduce or mean_aux)(self.aux_tree.unflatten(list(stacked)))


@dataclasses.dataclass(frozen=True)
class _AutoParts:
  """A plain loss cut for one batch, before lowering: the explicit form's
  `(stage_fn, loss_fn, input_fn)` (`stage_fn` one per virtual stage where the
  counts differ) and `rowed(b_leaves)`, the batch `(inputs, targets[, side])`."""

  cut: Cut
  fns: tuple
  balance: Balance
  rowed: Callable
  aux_tree: object = None


def is_key(x) -> bool:
  """A typed PRNG key (`jax.random.key`), which the pipeline folds per microbatch."""
  return jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)


def microbatch_keys(key, rows: int, microbatches: int):
  """`rows` copies of a batch's scalar key, those of microbatch m (the m-th run of
  `rows / microbatches`) being `fold_in(key, m)`: what each microbatch's loss reads.

  >>> import jax
  >>> k = jax.random.key(0)
  >>> ks = microbatch_keys(k, 4, 2)
  >>> bool((jax.random.key_data(ks[2]) == jax.random.key_data(jax.random.fold_in(k, 1))).all())
  True
  """
  keys = jax.vmap(lambda m: jax.random.fold_in(key, m))(jnp.arange(microbatches))
  return keys[jnp.arange(rows) // (rows // microbatches)]


def _auto_parts(
  loss_fn: Callable,
  has_aux: bool,
  sched: PipelineSchedule,
  D: int,
  p_avals,
  p_tree,
  batch,
  layers=None,
  data_axis=None,
  state=(),
) -> _AutoParts:
  """Traces `loss_fn` at one data replica's slice of one microbatch (what each device
  runs; `D` data replicas over `data_axis`, bound while tracing), cuts it
  (`passes.pipeline.cut`) and balances its layers; `batch` may hold
  `jax.ShapeDtypeStruct`s (shapes only)."""
  # traced as each device runs it: inside the shard_map, every mesh axis manual
  with (
    _compat.axis_env([(data_axis, D)] if data_axis else []),
    _compat.manual_context_mesh(),
    _constraints_hold(),
  ):
    return _auto_parts_bound(loss_fn, has_aux, sched, D, p_avals, p_tree, batch, layers, state)


@contextlib.contextmanager
def _constraints_hold():
  """`jax.lax.with_sharding_constraint` as the identity while the loss is traced per
  device: with every mesh axis manual, each device holds its own values and a layout
  has nothing to constrain, while naming a manual axis is an error. flax's
  partitioning boxes (`nn.with_partitioning`) constrain each parameter when a mesh
  is set (`jax.set_mesh`); the step keeps the arguments' layout itself."""
  orig = jax.lax.with_sharding_constraint
  jax.lax.with_sharding_constraint = lambda x, *a, **k: x
  try:
    yield
  finally:
    jax.lax.with_sharding_constraint = orig


def _auto_parts_bound(loss_fn, has_aux, sched, D, p_avals, p_tree, batch, layers, state):
  M, V = sched.microbatches, sched.virtual_stages
  b_leaves, b_tree = jax.tree.flatten(batch)
  # passed whole to every microbatch: scalars, and model state (`state_argnums`)
  scalar = [jnp.ndim(x) == 0 or i in state for i, x in enumerate(b_leaves)]
  rows = {jnp.shape(x)[0] for x, sc in zip(b_leaves, scalar) if not sc}
  if len(rows) != 1 or next(iter(rows)) % (M * D):
    per = f"microbatches={M}" + (f" x {D} data replicas" if D > 1 else "")
    raw = any(jnp.result_type(x) == jnp.uint32 and jnp.shape(x) == (2,) for x in b_leaves)
    raise ValueError(
      f"the batch's arrays need one leading size divisible by {per} (they "
      f"are split on it); got leading sizes {sorted(rows)}"
      + (
        "; a raw uint32[2] PRNG key is split like any array: pass a typed "
        "key (jax.random.key), which each microbatch gets folded with its "
        "index"
        if raw
        else "; model state passed in the batch (BatchNorm batch_stats, a "
        "mutable collection) is not split: name its argument with "
        "state_argnums (docs/guides/pipeline-real-losses.md)"
        if len(rows) > 1
        else ""
      )
    )
  B = next(iter(rows))
  sd = lambda x, s: jax.ShapeDtypeStruct(s, jnp.result_type(x))  # noqa: E731
  b_avals = [
    sd(x, jnp.shape(x) if sc else (jnp.shape(x)[0] // (M * D), *jnp.shape(x)[1:]))
    for x, sc in zip(b_leaves, scalar)
  ]
  n = len(p_avals)
  box = {"tree": None}
  # per-example keys: an extra batch leaf per scalar key, its whole batch's split
  nb, ex, mb_rows = len(b_leaves), _example_keys.key_leaves(b_leaves, scalar), B // (M * D)
  b_avals += _example_keys.avals(b_leaves, ex, mb_rows)
  scalar += [False] * len(ex)

  def flat(*xs):
    with _example_keys.tracing([xs[n + i] for i in ex], xs[n + nb :], mb_rows):
      out = loss_fn(p_tree.unflatten(xs[:n]), *b_tree.unflatten(xs[n : n + nb]))
    if not has_aux:
      return out
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
        f"with has_aux=True the loss must return (loss, aux); got {type(out).__name__}"
      )
    aux, box["tree"] = jax.tree.flatten(out[1])
    return (out[0], *aux)

  try:
    closed = jax.make_jaxpr(flat)(*_compat.manual_avals([*p_avals, *b_avals]))
    if ex and _example_keys.picked(closed.jaxpr, n + nb):
      # the split is read entry by entry (per-layer keys as many as the rows): as written
      ex, b_avals, scalar = (), b_avals[:nb], scalar[:nb]
      closed = jax.make_jaxpr(flat)(*_compat.manual_avals([*p_avals, *b_avals]))
  except (TypeError, ValueError) as e:
    m = jax.sharding.get_abstract_mesh()
    if not m.empty and m.are_all_axes_manual:  # under set_mesh with Explicit axes
      e.add_note(
        "ooojax traces a pipelined loss as each device runs it: inside a shard_map "
        "where every mesh axis is manual. A sharding that names a mesh axis "
        "(reshard(x, P('data')), out_sharding=P('data')) has no meaning there; "
        "use jax.typeof(x).sharding, or leave the layout to the pipeline"
      )
    if not state:
      e.add_note(
        "ooojax traced the loss at one microbatch, every batch leaf split on its "
        "leading axis; model state passed in the batch (BatchNorm batch_stats) "
        "is not: name its argument with state_argnums"
      )
    raise
  c = cut(closed, n, len(closed.jaxpr.outvars) - 1, state)
  if c.layers < V:
    raise CutError(
      f"the stack has {c.layers} layers, fewer than the {V} virtual stages "
      "(stages x chunks); use fewer stages or chunks, or cut by hand" + _EXPLICIT
    )
  bal = _balance(
    c.layers, _price(c, p_avals, b_avals), sched, "balanced" if layers is None else layers
  )
  # A scalar travels as a row per example (the executor splits every leaf), read at [0].
  whole = lambda ids, xs: tuple(
    x[0] if scalar[i] else x  # noqa: E731
    for i, x in zip(ids, xs)
  )

  starts = np.cumsum([0, *bal.counts])[:-1]  # each virtual stage's first layer

  def stage_fn(k):  # one function per layer count: equal counts share a flavor
    f = c.stage_fn(k)
    if not c.per_layer:
      return (lambda p, x, sd: f(p, x, whole(c.side, sd))) if c.side else f

    def indexed(p, x, *rest):  # ([side,] vstage): per-layer data from the stage's index
      sd = whole(c.side, rest[0]) if c.side else ()
      return f(p, x, sd, jnp.asarray(starts, jnp.int32)[rest[-1]])

    indexed.stage_index = True  # `passes.pipeline.program.trace` passes the index
    return indexed

  fns = {k: stage_fn(k) for k in sorted(set(bal.counts))}
  stage = fns[bal.counts[0]] if len(fns) == 1 else tuple(fns[k] for k in bal.counts)
  epi = c.epilogue if c.n_aux else c.loss_fn  # the aux: computed by the last stage's F
  fns = (
    stage,
    lambda y, tg, sh: epi(y, whole(c.targets, tg), sh),
    lambda ins, sh: c.input_fn(whole(c.inputs, ins), sh),
  )

  def rowed(b_leaves):
    b_leaves = [*b_leaves, *_example_keys.extra(b_leaves, ex, B)]
    row = lambda ids: tuple(  # noqa: E731
      microbatch_keys(b_leaves[i], B, M)
      if scalar[i] and is_key(b_leaves[i])
      else jnp.broadcast_to(b_leaves[i], (B, *jnp.shape(b_leaves[i])))
      if scalar[i]
      else b_leaves[i]
      for i in ids
    )
    # side: what every stage reads besides the activation (a mask's tokens), each
    # stage slicing its microbatch's rows from the batch it already holds
    side = (row(c.side),) if c.side else ()
    return (row(c.inputs), row(c.targets), *side)

  return _AutoParts(c, fns, bal, rowed, box["tree"])


def _auto_program(
  loss_fn: Callable,
  has_aux: bool,
  sched: PipelineSchedule,
  mesh,
  axis_name: str,
  data_axis: str | None,
  p_avals,
  p_tree,
  batch,
  device_major: bool = False,
  layers=None,
  lowering=None,
  state_argnums=(),
  fsdp: str = "auto",
  split_dims: tuple | None = None,
) -> _AutoProgram:
  """`_auto_parts` lowered (`execute.lower`, or `lowering(cut, stage_fn, loss_fn,
  input_fn)`: the tiled train step's); `split_dims`: `execute.lower`'s."""
  D = mesh.shape[data_axis] if data_axis in mesh.shape else 1
  parts = _auto_parts(
    loss_fn,
    has_aux,
    sched,
    D,
    p_avals,
    p_tree,
    batch,
    layers,
    data_axis if D > 1 or data_axis in mesh.shape else None,
    state_leaves(batch, state_argnums),
  )
  c, fns = parts.cut, parts.fns
  if lowering is not None:
    run = lowering(c, *fns)
  else:
    run = lower(
      fns[0],
      fns[1],
      sched,
      mesh,
      axis_name,
      fns[2],
      data_axis,
      device_major,
      has_aux=c.n_aux > 0,
      fsdp=fsdp,
      split_dims=split_dims,
    )
  b_leaves = jax.tree.leaves(batch)
  order = device_order(sched) if device_major and sched.chunks > 1 else None
  cols = c.stage_state(b_leaves, parts.balance.counts)
  if order is not None:
    cols = tuple(x[order] for x in cols)
  return _AutoProgram(
    c,
    run,
    parts.rowed(b_leaves),
    parts.balance,
    parts.aux_tree,
    cols,
    sched.microbatches,
    sched.microbatches * D,
    order,
    (lambda g: jax.reshard(g, NamedSharding(mesh, P()))) if _explicit(mesh) else (lambda g: g),
  )


def state_leaves(batch, state_argnums) -> tuple[int, ...]:
  """The batch leaves of the loss's arguments `state_argnums` (1: the first after the
  parameters), model state: passed whole, not differentiated, per layer."""
  nums = (state_argnums,) if isinstance(state_argnums, int) else tuple(state_argnums or ())
  bad = [a for a in nums if not (isinstance(a, int) and 1 <= a <= len(batch))]
  if bad:
    raise ValueError(
      f"state_argnums={state_argnums!r} must name the loss's arguments after the "
      f"parameters (1 to {len(batch)} here: argument 0 is the parameters)"
    )
  out, at = [], 0
  for i, b in enumerate(batch):
    n = len(jax.tree.leaves(b))
    if i + 1 in nums:
      out += range(at, at + n)
    at += n
  return tuple(out)


def _auto(
  loss_fn: Callable,
  sched: PipelineSchedule,
  mesh,
  axis_name: str,
  has_aux: bool,
  data_axis: str | None,
  layers=None,
  aux_reduce: Callable | None = None,
  state_argnums=(),
  fsdp: str = "auto",
) -> Callable:
  """`step(params, *batch)` of a plain loss (`_auto_program`). The loss is traced on
  every call of `step` (once per `jax.jit` trace): a cached trace would keep the
  constants it closes over, tracers of an outer trace included."""

  def program(params, batch) -> _AutoProgram:
    leaves, p_tree = jax.tree.flatten(params)
    p_avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]
    return _auto_program(
      loss_fn,
      has_aux,
      sched,
      mesh,
      axis_name,
      data_axis,
      p_avals,
      p_tree,
      batch,
      layers=layers,
      state_argnums=state_argnums,
      fsdp=fsdp,
    )

  def step(params, *batch, **kwargs):
    if kwargs:  # keyword arguments (rngs={"dropout": key}) are batch leaves too
      named = _auto(
        lambda p, *b: loss_fn(p, *b[:-1], **b[-1]),
        sched,
        mesh,
        axis_name,
        has_aux,
        data_axis,
        layers,
        aux_reduce,
        state_argnums,
        fsdp,
      )
      return named(params, *batch, kwargs)
    leaves, p_tree = jax.tree.flatten(params)
    prog = program(params, batch)
    c, counts = prog.cut, prog.balance.counts
    out, (gp, gsh) = prog.run(
      c.stage_params(leaves, counts) + prog.state_cols,
      prog.batch,
      tuple(leaves[i] for i in c.shared),
    )
    if _explicit(mesh):  # stage axes come back sharded; the user's leaves are whole
      gp = jax.tree.map(lambda g: jax.reshard(g, _off_stages(g, mesh, axis_name)), gp)
    loss, aux, gp = prog.split(out, gp)
    grads = p_tree.unflatten(c.grads(leaves, gp, gsh, counts))
    return ((loss, prog.aux(aux, aux_reduce)), grads) if has_aux else (loss, grads)

  def balance(params, *batch) -> Balance:
    """The layers per virtual stage `step` runs for these shapes (a `Balance`)."""
    box = {}

    def trace(p, *b):  # shapes only
      box["b"] = program(p, b).balance
      return 0

    jax.eval_shape(trace, params, *batch)
    return box["b"]

  step.balance = balance
  return step


def _off_stages(g, mesh, axis_name) -> NamedSharding:
  """`g`'s sharding less the stage axis: a weight split over the data axis within its
  stage (FSDP) keeps that split in the user's leaf."""
  spec = getattr(jax.typeof(g).sharding, "spec", P())
  return NamedSharding(mesh, P(*(None if e == axis_name else e for e in spec)))


def _explicit(mesh) -> bool:
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()))
