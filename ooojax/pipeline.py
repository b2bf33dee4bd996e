"""Pipeline parallelism: schedules as tables, executed as one SPMD program.

>>> import ooojax as ooo
>>> sched = ooo.pipeline.schedule("zb-h1", stages=4, microbatches=8)
>>> round(sched.bubble_fraction(), 3), max(sched.peak_activations())
(0.111, 4)
>>> zb2 = ooo.pipeline.schedule("zb-h2", stages=4, microbatches=8)
>>> round(zb2.bubble_fraction(), 3), round(zb2.steady_bubble(steps=4), 3)  # simulated
(0.111, 0.0)

`value_and_grad(stage_fn, loss_fn, mesh=..., axis_name=..., schedule=...)`
returns `step(stage_params, batch, shared=None) -> (loss, grads)` that runs the
table with `jax.shard_map` over the stage axis; B and W of each stage come from
the split pass (no recomputation of the dX chain, no hand-written backward).
`explain(stage_fn, loss_fn, schedule, stage_params, batch)` prices the table on
the model (simulated bubble, memory per stage, compiled ppermute windows);
`explain(loss_fn, params, *batch, stages=N)` does so for the automatic form
below, and reports its cut and balance.
`value_and_grad(loss_fn, mesh=..., axis_name=...)`, with the plain loss one
passes to `jax.value_and_grad`, cuts the stages itself
(`passes.pipeline.cut`): `step(params, *batch) -> (loss, grads)`.
`make_train_step(loss_fn, optimizer, mesh=..., axis_name=...)` adds the
optimizer, applied per stage on the stage-sharded parameters; with `steps=n`
one call runs n steps as a table tiled over steps (`ooojax._pipeline_tiled`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ooojax._explain_pipeline import AutoCut, PipelineReport, explain
from ooojax._pipeline_train import (
  PipelineTrainState,
  PipelineTrainStep,
  StageParams,
  make_train_step,
)
from ooojax.passes.pipeline.balance import Balance, balance as _balance, price as _price
from ooojax.passes.pipeline.cut import EXPLICIT as _EXPLICIT, Cut, CutError, cut
from ooojax.passes.pipeline.execute import lower
from ooojax.passes.pipeline.generate import SCHEDULES, generate
from ooojax.passes.pipeline.program import Memory, memory as _memory
from ooojax.passes.pipeline.schedule import Action, PipelineSchedule, ScheduleError
from ooojax.passes.pipeline.steps import SteadyState, steady_state, tile
from ooojax.passes.pipeline.train import lower_train

__all__ = [
  "SCHEDULES",
  "Action",
  "AutoCut",
  "Balance",
  "Cut",
  "CutError",
  "Memory",
  "PipelineReport",
  "PipelineSchedule",
  "PipelineTrainState",
  "PipelineTrainStep",
  "ScheduleError",
  "StageParams",
  "SteadyState",
  "explain",
  "make_train_step",
  "memory",
  "schedule",
  "steady_state",
  "tile",
  "train",
  "value_and_grad",
]


def schedule(
  name: str, stages: int, microbatches: int, chunks: int | None = None, lag: int = 0, steps: int = 1
) -> PipelineSchedule:
  """A validated schedule table by name (one of `SCHEDULES`).

  Args:
    name: "gpipe", "1f1b", "ooo" (gradient fast-forwarding), "zb-h1", "zb-h2",
      "interleaved" (modulo allocation, `chunks` virtual stages per device) or
      "zb-v" (two chunks per device in a V: device s holds blocks s and 2S-1-s).
    stages: pipeline stages (devices on the stage mesh axis).
    microbatches: microbatches per step.
    chunks: virtual stages per device for "interleaved" (default 2).
    lag: 1 receives each transfer one tick after its send, so the executor
      overlaps it with the next tick's compute (more ticks, hidden transfers).
    steps: training steps laid out in one table (`tile`): step t + 1's
      forwards on a stage start once that stage's update of step t is done,
      so one step's drain overlaps the next one's warm-up. Run such a table
      with `train` (`value_and_grad` runs one-step tables).

  Returns:
    A `PipelineSchedule`: `validate()`, `bubble_fraction(costs)`,
    `peak_activations()`, `simulate()`, `plot()`, `to_text()`, `print()`.

  >>> s = schedule("ooo", stages=2, microbatches=2)
  >>> print(s.to_text().splitlines()[1])
  0F0+0SF0 0F1+0SF1 0RB0 0B0 0W0+0RB1 0B1 0W1
  """
  return tile(generate(name, stages, microbatches, chunks, lag), steps)


def value_and_grad(
  fn: Callable,
  loss_fn: Callable | None = None,
  *,
  mesh,
  axis_name: str,
  schedule: str | PipelineSchedule = "ooo",
  microbatches: int | None = None,
  chunks: int | None = None,
  input_fn: Callable | None = None,
  has_aux: bool = False,
  data_axis: str | None = None,
  layers: str | tuple[int, ...] | None = None,
) -> Callable:
  """Pipelined loss and gradients: of a plain loss (stages cut automatically), or
  of a stack of stages written by hand.

  Two forms, told apart by the number of functions given:

  * `value_and_grad(loss_fn, mesh=..., axis_name=...)`: the `loss_fn(params,
    *batch)` one would pass to `jax.value_and_grad`. ooojax traces it, finds the
    stack of layers (a scan over stacked parameters: flax `nn.scan`, `nnx.scan`,
    `lax.scan`; or a Python loop of identical blocks), splits its layers over
    the (virtual) stages by the cost model (`layers`), runs what comes before
    the stack (embedding) on the first stage and what comes after it (final
    norm, head, loss) on the last; parameters both of those read (tied
    embeddings) are replicated and their gradient is reduced once. Returns
    `step(params, *batch) -> (loss, grads)` with `grads` in the structure of
    `params` (ready for optax). Every leaf of `batch` is split on its leading
    axis into microbatches (scalars, such as a loss scale, go whole to each),
    and the loss is the mean over microbatches of `loss_fn` on each: equal to
    `loss_fn(params, *batch)` for a loss that is a mean over equal-sized
    examples. The layers may read values of the batch alone besides the
    activation (a padding mask built from the tokens, segment ids): every
    stage rebuilds them from its microbatch's batch leaves. Values of
    parameters and the batch read by the layers, and random bits drawn from a
    key in the batch (dropout), are refused. With `has_aux=True` `loss_fn`
    returns `(loss, aux)`; `aux` is not computed (the stages never gather it)
    and `step` returns `((loss, None), grads)`. A model it cannot cut raises a
    `ValueError` that says why. `step.balance(params, *batch)` (shapes only)
    is the chosen split, a `Balance`: layers per virtual stage and their
    cost-model times.
  * `value_and_grad(stage_fn, loss_fn, ...)`: the explicit stack, below.

  The model of the explicit form is `loss_fn(stage_fn(p[V-1], ... stage_fn(p[0],
  x)), targets)` averaged over microbatches, with `x = inputs` or `input_fn(inputs)`;
  with `batch = (inputs, targets, side)` every stage is `stage_fn(p[v], x, side)`,
  `side` the microbatch's rows (a mask; not differentiated).

  Args:
    fn: the plain loss (automatic form), or `stage_fn`: `(params_of_one_stage,
      activation) -> activation` (same shape).
    loss_fn: (explicit form) `(activation, targets) -> scalar` (a mean over the
      microbatch). With `shared` weights (see below): `(activation, targets, shared)`.
    mesh: a `jax.sharding.Mesh` with a stage axis.
    axis_name: the stage axis's name; its size is the number of stages.
    schedule: a schedule name or a `PipelineSchedule` for this many stages.
    microbatches: with a schedule name: how many (default: 2 x stages).
    chunks: with "interleaved": virtual stages per device.
    input_fn: (explicit form) optional `(inputs[, shared]) -> activation` run by
      the first stage (e.g. an embedding).
    has_aux: (automatic form) `fn` returns `(loss, aux)`.
    data_axis: a second mesh axis (e.g. `("data", "stage")`) over which each
      microbatch's rows are split: every data replica runs the pipeline on its
      slice, and the loss and gradients are the mean over the replicas.
    layers: (automatic form) the stack's layers per virtual stage: "balanced"
      (the default: the split with the least simulated step time on the cost
      model, the prologue priced on the first virtual stage and the epilogue on
      the last, per the schedule's placement; the even split where that is
      best), "even" (`L / V` each; a remainder to the middle stages), or a
      tuple of V counts. Uneven counts pad the stage stacks to the largest.

  Returns:
    Automatic form: `step(params, *batch)`, see above. Explicit form:
    `step(stage_params, batch, shared=None) -> (loss, grads)`; `stage_params`
    leaves are stacked on a leading axis of (virtual) stages; `batch` is
    `(inputs, targets)` or `(inputs, targets, side)`; `grads` mirrors `stage_params`, or is
    `(stage_grads, shared_grads)` when `shared` is given. `shared` weights (tied
    embeddings) are replicated; their gradient is reduced once over the stages.
    `step` may be wrapped in `jax.jit`.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
  >>> step = value_and_grad(lambda w, x: jnp.tanh(x @ w),
  ...                       lambda y, t: jnp.mean((y - t) ** 2),
  ...                       mesh=mesh, axis_name="stage", schedule="ooo", microbatches=2)
  >>> w = jnp.ones((2, 3, 3)) * 0.1
  >>> loss, g = jax.jit(step)(w, (jnp.ones((4, 3)), jnp.zeros((4, 3))))
  >>> g.shape
  (2, 3, 3)

  The same model as a plain loss over a scan of layers:

  >>> def plain(w, x, t):
  ...   h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]
  ...   return jnp.mean((h - t) ** 2)
  >>> step = value_and_grad(plain, mesh=mesh, axis_name="stage", schedule="ooo",
  ...                       microbatches=2)
  >>> loss2, g2 = jax.jit(step)(w, jnp.ones((4, 3)), jnp.zeros((4, 3)))
  >>> bool(jnp.allclose(g2, g)), bool(jnp.allclose(loss2, loss))
  (True, True)
  """
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
  sched = _table(schedule, mesh.shape[axis_name], microbatches, chunks)
  if loss_fn is None:
    if input_fn is not None:
      raise TypeError(
        "input_fn belongs to the explicit form value_and_grad(stage_fn, "
        "loss_fn, input_fn=...); the automatic form value_and_grad(loss_fn) "
        "finds the embedding itself"
      )
    return _auto(fn, sched, mesh, axis_name, has_aux, data_axis, layers)
  if has_aux or layers is not None:
    raise TypeError(
      f"{'has_aux' if has_aux else 'layers'} belongs to the automatic form "
      "value_and_grad(loss_fn, ...); the explicit form's loss_fn returns a "
      "scalar and its stage_params set the layers per stage"
    )
  return lower(fn, loss_fn, sched, mesh, axis_name, input_fn, data_axis)


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


@dataclasses.dataclass(frozen=True)
class _AutoParts:
  """A plain loss cut for one batch, before lowering: the explicit form's
  `(stage_fn, loss_fn, input_fn)` (`stage_fn` one per virtual stage where the
  counts differ) and `rowed(b_leaves)`, the batch `(inputs, targets[, side])`."""

  cut: Cut
  fns: tuple
  balance: Balance
  rowed: Callable


def _auto_parts(
  loss_fn: Callable,
  has_aux: bool,
  sched: PipelineSchedule,
  D: int,
  p_avals,
  p_tree,
  batch,
  layers=None,
) -> _AutoParts:
  """Traces `loss_fn` at one data replica's slice of one microbatch (what each device
  runs; `D` data replicas), cuts it (`passes.pipeline.cut`) and balances its layers;
  `batch` may hold `jax.ShapeDtypeStruct`s (shapes only)."""
  M, V = sched.microbatches, sched.virtual_stages
  b_leaves, b_tree = jax.tree.flatten(batch)
  scalar = [jnp.ndim(x) == 0 for x in b_leaves]  # passed whole to every microbatch
  rows = {jnp.shape(x)[0] for x, sc in zip(b_leaves, scalar) if not sc}
  if len(rows) != 1 or next(iter(rows)) % (M * D):
    per = f"microbatches={M}" + (f" x {D} data replicas" if D > 1 else "")
    raise ValueError(
      f"the batch's arrays need one leading size divisible by {per} (they "
      f"are split on it); got leading sizes {sorted(rows)}"
    )
  B = next(iter(rows))
  sd = lambda x, s: jax.ShapeDtypeStruct(s, jnp.result_type(x))  # noqa: E731
  b_avals = [
    sd(x, () if sc else (jnp.shape(x)[0] // (M * D), *jnp.shape(x)[1:]))
    for x, sc in zip(b_leaves, scalar)
  ]
  n = len(p_avals)

  def flat(*xs):
    out = loss_fn(p_tree.unflatten(xs[:n]), *b_tree.unflatten(xs[n:]))
    return out[0] if has_aux else out

  c = cut(jax.make_jaxpr(flat)(*p_avals, *b_avals), n)
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

  def stage_fn(k):  # one function per layer count: equal counts share a flavor
    f = c.stage_fn(k)
    return (lambda p, x, sd: f(p, x, whole(c.side, sd))) if c.side else f

  fns = {k: stage_fn(k) for k in sorted(set(bal.counts))}
  stage = fns[bal.counts[0]] if len(fns) == 1 else tuple(fns[k] for k in bal.counts)
  fns = (
    stage,
    lambda y, tg, sh: c.loss_fn(y, whole(c.targets, tg), sh),
    lambda ins, sh: c.input_fn(whole(c.inputs, ins), sh),
  )

  def rowed(b_leaves):
    row = lambda ids: tuple(  # noqa: E731
      jnp.broadcast_to(b_leaves[i], (B,)) if scalar[i] else b_leaves[i] for i in ids
    )
    # side: what every stage reads besides the activation (a mask's tokens), each
    # stage slicing its microbatch's rows from the batch it already holds
    side = (row(c.side),) if c.side else ()
    return (row(c.inputs), row(c.targets), *side)

  return _AutoParts(c, fns, bal, rowed)


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
) -> _AutoProgram:
  """`_auto_parts` lowered (`execute.lower`, or `lowering(cut, stage_fn, loss_fn,
  input_fn)`: the tiled train step's)."""
  D = mesh.shape[data_axis] if data_axis in mesh.shape else 1
  parts = _auto_parts(loss_fn, has_aux, sched, D, p_avals, p_tree, batch, layers)
  c, fns = parts.cut, parts.fns
  if lowering is not None:
    run = lowering(c, *fns)
  else:
    run = lower(fns[0], fns[1], sched, mesh, axis_name, fns[2], data_axis, device_major)
  return _AutoProgram(c, run, parts.rowed(jax.tree.leaves(batch)), parts.balance)


def _auto(
  loss_fn: Callable,
  sched: PipelineSchedule,
  mesh,
  axis_name: str,
  has_aux: bool,
  data_axis: str | None,
  layers=None,
) -> Callable:
  """`step(params, *batch)` of a plain loss (`_auto_program`). The loss is traced on
  every call of `step` (once per `jax.jit` trace): a cached trace would keep the
  constants it closes over, tracers of an outer trace included."""

  def program(params, batch) -> _AutoProgram:
    leaves, p_tree = jax.tree.flatten(params)
    p_avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]
    return _auto_program(
      loss_fn, has_aux, sched, mesh, axis_name, data_axis, p_avals, p_tree, batch, layers=layers
    )

  def step(params, *batch):
    leaves, p_tree = jax.tree.flatten(params)
    prog = program(params, batch)
    c, counts = prog.cut, prog.balance.counts
    loss, (gp, gsh) = prog.run(
      c.stage_params(leaves, counts), prog.batch, tuple(leaves[i] for i in c.shared)
    )
    if _explicit(mesh):  # stage axes come back sharded; the user's leaves are whole
      gp = jax.tree.map(lambda g: jax.reshard(g, NamedSharding(mesh, P())), gp)
    grads = p_tree.unflatten(c.grads(leaves, gp, gsh, counts))
    return ((loss, None), grads) if has_aux else (loss, grads)

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


def _explicit(mesh) -> bool:
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()))


def train(
  stage_fn: Callable,
  loss_fn: Callable,
  optimizer,
  *,
  mesh,
  axis_name: str,
  schedule: str | PipelineSchedule = "zb-h2",
  microbatches: int | None = None,
  steps: int = 2,
  chunks: int | None = None,
  input_fn: Callable | None = None,
) -> Callable:
  """Several pipelined training steps in one program, each stage's optimizer
  update inside the tick loop: step t + 1's warm-up runs under step t's drain.

  Args:
    stage_fn, loss_fn, mesh, axis_name, input_fn: as in `value_and_grad`
      (no `shared` weights: their update would need a reduction across stages).
    optimizer: an optax `GradientTransformation` that acts leaf by leaf (sgd,
      momentum, adam, adamw); it runs per virtual stage.
    schedule: a name, or a table tiled over steps (`tile(sched, steps)`).
    microbatches, steps, chunks: with a schedule name (`steps=1`: one step per
      call, its updates still inside the tick loop).

  Returns:
    `train(stage_params, opt_state, batches) -> (stage_params, opt_state, losses)`
    with `opt_state = jax.vmap(optimizer.init)(stage_params)` (one state per
    virtual stage) and `batches = (inputs, targets[, side])` stacked on a leading axis of
    `steps`; `losses[t]` is step t's loss. The parameters each forward reads, and
    so the trajectory, are the synchronous loop's. Wrap it in `jax.jit`.

  >>> import jax, jax.numpy as jnp, optax
  >>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
  >>> opt = optax.sgd(0.1)
  >>> run = train(lambda w, x: jnp.tanh(x @ w), lambda y, t: jnp.mean((y - t) ** 2), opt,
  ...             mesh=mesh, axis_name="stage", schedule="zb-h2", microbatches=2, steps=3)
  >>> w = jnp.ones((2, 3, 3)) * 0.1
  >>> w, state, losses = jax.jit(run)(w, jax.vmap(opt.init)(w),
  ...                                 (jnp.ones((3, 4, 3)), jnp.zeros((3, 4, 3))))
  >>> losses.shape, bool(losses[2] < losses[0])
  ((3,), True)
  """
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
  if isinstance(schedule, str):
    sched = tile(
      generate(schedule, mesh.shape[axis_name], microbatches or 2 * mesh.shape[axis_name], chunks),
      steps,
    )
  elif isinstance(schedule, PipelineSchedule):
    sched = schedule.validate()
  else:
    raise TypeError(
      f"schedule must be a name {SCHEDULES} or a PipelineSchedule, got {type(schedule).__name__}"
    )
  return lower_train(stage_fn, loss_fn, sched, mesh, axis_name, optimizer, input_fn)


def memory(
  stage_fn: Callable,
  loss_fn: Callable,
  schedule: PipelineSchedule,
  stage_params,
  batch,
  shared=None,
  input_fn: Callable | None = None,
) -> Memory:
  """Bytes per device of the pipelined step, from shapes alone (arrays or
  `jax.ShapeDtypeStruct`s): `weights`, `grads`, `fres` / `bres` (one
  microbatch's residual records), `peak`, `slots`, and `bound` (weights +
  gradients + peak x records: what the schedule needs).

  >>> import jax, jax.numpy as jnp
  >>> sd = jax.ShapeDtypeStruct
  >>> m = memory(lambda w, x: jnp.tanh(x @ w), lambda y, t: jnp.mean((y - t) ** 2),
  ...            schedule("1f1b", stages=2, microbatches=4), sd((2, 64, 64), jnp.float32),
  ...            (sd((16, 64), jnp.float32), sd((16, 64), jnp.float32)))
  >>> m.weights, m.peak    # one 64x64 f32 stage per device; 1F1B keeps 2 microbatches
  (16384, 2)
  >>> m.fres               # x, tanh(x w) and, on the last stage, y - t: 3 x 4 x 64 f32
  3072
  """
  return _memory(stage_fn, loss_fn, schedule, stage_params, batch, shared, input_fn)
