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
one call runs n steps as a table tiled over steps (`ooojax.pipeline._tiled`).
`step.tune(state, *batch)` times the candidate tables (`ooo`, 1F1B's, GPipe's)
on the devices at hand and keeps the fastest (`tune` for any step built from a
table).
"""

from __future__ import annotations

from collections.abc import Callable

import optax

from ooojax.passes.pipeline.balance import Balance
from ooojax.passes.pipeline.cut import Cut, CutError
from ooojax.passes.pipeline.depth import DepthChoice, pick_measured, plan_ooo, trial_tables
from ooojax.passes.pipeline.execute import device_order, lower, xla_options
from ooojax.passes.pipeline.generate import SCHEDULES, generate
from ooojax.passes.pipeline.link import LinkModel, simulate_link
from ooojax.passes.pipeline.program import Memory, memory as _memory
from ooojax.passes.pipeline.schedule import Action, PipelineSchedule, ScheduleError
from ooojax.passes.pipeline.steps import SteadyState, steady_state, tile
from ooojax.passes.pipeline.train import lower_train
from ooojax.pipeline import _modules
from ooojax.pipeline._automatic import (  # noqa: F401 - the private ones: tests, models.matrix
  _auto,
  _auto_parts,
  _auto_program,
  _AutoParts,
  _AutoProgram,
  _device_major,
  _explicit,
  _table,
  is_key,
  mean_aux,
  microbatch_keys,
)
from ooojax.pipeline._explain import AutoCut, PipelineReport, explain
from ooojax.pipeline._tiled import TiledTrainStep
from ooojax.pipeline._train import PipelineTrainState, PipelineTrainStep, StageParams
from ooojax.pipeline._tune import Tuning, tune

__all__ = [
  "SCHEDULES",
  "Action",
  "AutoCut",
  "Balance",
  "Cut",
  "CutError",
  "DepthChoice",
  "LinkModel",
  "Memory",
  "PipelineReport",
  "pick_measured",
  "plan_ooo",
  "trial_tables",
  "simulate_link",
  "PipelineSchedule",
  "PipelineTrainState",
  "PipelineTrainStep",
  "ScheduleError",
  "StageParams",
  "SteadyState",
  "compiler_options",
  "device_order",
  "explain",
  "make_train_step",
  "mean_aux",
  "memory",
  "schedule",
  "steady_state",
  "tile",
  "train",
  "tune",
  "Tuning",
  "value_and_grad",
]


def compiler_options(schedule: PipelineSchedule) -> dict:
  """The XLA options to compile a step of `schedule` with, for its transfers to
  run beside its compute on a GPU: `jax.jit(step, compiler_options=...)`.

  A lag-1 table (`schedule(..., lag=1)`) on more than 2 stages sends each
  tick's output on two rings, up and down, before the tick's action. XLA:GPU's
  scheduler keeps one collective in flight by default, so only one ring runs
  beside the action; these options allow both. Otherwise the dict is empty.
  `make_train_step` and `explain(...).compiled()` apply them themselves (options
  you pass win); other backends ignore them.

  >>> import ooojax as ooo
  >>> ooo.pipeline.compiler_options(ooo.pipeline.schedule("ooo", 4, 8, lag=1))
  {'xla_gpu_experimental_parallel_collective_overlap_limit': 2}
  >>> ooo.pipeline.compiler_options(ooo.pipeline.schedule("ooo", 4, 8))
  {}
  """
  if not isinstance(schedule, PipelineSchedule):
    raise TypeError(
      f"compiler_options takes a PipelineSchedule (ooo.pipeline.schedule(...)), got "
      f"{type(schedule).__name__}"
    )
  return xla_options(schedule)


def schedule(
  name: str,
  stages: int,
  microbatches: int,
  chunks: int | None = None,
  lag: int = 0,
  steps: int = 1,
  *,
  link: LinkModel | None = None,
  costs=None,
  budget: int | None = None,
  mode: str = "executor",
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
    link: for "ooo" only, a `LinkModel` (latency, bandwidth, bytes per
      transfer): the in-flight depth is planned on it (`plan_ooo`): the
      fastest table, simulated on that link with `costs`, that holds at most
      `budget` activations per stage (default GPipe's, `microbatches`).
      GPipe's and 1F1B's own tables are candidates, so on that link the result
      is never slower than either at the same memory.
    costs: `{"F", "B", "W"}` seconds per whole stage for planning with `link`.
    budget: activations a stage may hold when planning with `link`.
    mode: how the planner replays a table: "executor" (this package's tick
      loop, transfers after each tick's compute) or "overlap" (asynchronous
      transfers beside compute).

  Returns:
    A `PipelineSchedule`: `validate()`, `bubble_fraction(costs)`,
    `peak_activations()`, `simulate()`, `plot()`, `to_text()`, `print()`.

  >>> s = schedule("ooo", stages=2, microbatches=2)
  >>> print(s.to_text().splitlines()[1])
  0F0+0SF0 0F1+0SF1 0RB0 0B0 0W0+0RB1 0B1 0W1
  """
  if link is not None:
    if name != "ooo":
      raise ValueError(
        f"link= plans the in-flight depth of 'ooo' only, not {name!r}; "
        "compare other tables with passes.pipeline.link.simulate_link"
      )
    return tile(plan_ooo(stages, microbatches, costs, link, budget, mode, lag)[0], steps)
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
  layout: str | None = None,
  aux_reduce: Callable | None = None,
  state_argnums: int | tuple[int, ...] = (),
  fsdp: str = "regather",
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
    parameters and the batch read by the layers are refused. A scalar typed
    key in the batch (or a keyword argument of `step`, e.g. `rngs={"dropout":
    key}`) reaches microbatch m as `fold_in(key, m)`, and each layer of a loop
    of blocks draws its bits as the model does (flax's per-module constants):
    dropout equals the microbatch loop with those keys. A split of that key into
    the microbatch's rows (per-example keys, `split(key, batch)` vmapped over
    the rows) is the microbatch's rows of the whole batch's split, and keys
    split per layer (`keys[i]`) cut with the stack (docs/guides/equinox.md).
    An Equinox module passed as the parameters is split as
    `eqx.filter_value_and_grad` splits it. With `has_aux=True` `loss_fn`
    returns `(loss, aux)` and `step` returns `((loss, aux), grads)`: the last
    stage computes each microbatch's aux in its forward (no activation moves
    for it), and `aux_reduce` combines them (default `mean_aux`: the mean over
    microbatches of floating leaves, the others stacked on a leading axis of
    microbatches). The aux may read the stack's output, the batch and the
    parameters, not values inside the stack. A model it cannot cut raises a
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
    aux_reduce: (automatic form, with `has_aux`) `f(stacked) -> aux`, `stacked`
      the aux tree with every leaf stacked over the microbatches (then the data
      replicas, microbatch-major): `(M * D, ...)`. Default `mean_aux`.
    state_argnums: (automatic form) the loss's arguments (1: the first after the
      parameters) that hold model state, such as BatchNorm's `batch_stats`
      (`model.apply({"params": p, "batch_stats": s}, x, mutable=["batch_stats"])`,
      the updated collection returned in the aux): passed whole to every
      microbatch, not differentiated; each layer of the stack keeps its own
      leaves on its stage. Each microbatch normalises with its own statistics
      (GPipe), and an aux leaf a layer updates is the mean over microbatches of
      each microbatch's update (over data replicas too): what `mean_aux` makes
      of the microbatch loop's aux. Such leaves reach `aux_reduce` already
      averaged (every microbatch's entry is the mean).
    data_axis: a second mesh axis (e.g. `("data", "stage")`) over which each
      microbatch's rows are split: every data replica runs the pipeline on its
      slice, and the loss and gradients are the mean over the replicas.
    fsdp: with `data_axis`, for stage weights whose sharding splits one of their
      own dimensions over the data axis (FSDP / ZeRO-3 within a stage: an
      Explicit-axes type, or arrays placed so): "regather" (the default) keeps
      them split on each replica, all-gathers a chunk's weights inside each
      action that reads them (F, B, W) and reduce-scatters each W's gradient,
      which comes back split as the weight is; "keep" gathers every stage's
      weights once before the tick loop and holds them for the step.
    layers: (automatic form) the stack's layers per virtual stage: "balanced"
      (the default: the split with the least simulated step time on the cost
      model, the prologue priced on the first virtual stage and the epilogue on
      the last, per the schedule's placement; the even split where that is
      best), "even" (`L / V` each; a remainder to the middle stages), or a
      tuple of V counts. Uneven counts pad the stage stacks to the largest.
    layout: (explicit form) the order of the rows of `stage_params` (and of
      `grads`): "virtual" (the default: row v is virtual stage v) or "device"
      (row `s * chunks + c` is device s's chunk c, `device_order(schedule)`).
      The same for schedules without chunks. With chunks (interleaved, zb-v)
      a `P(axis_name)`-sharded stack must be in "device" order for each
      device's rows to be its own chunks: in "virtual" order every step moves
      the weights (and gathers the gradients) across the stage axis.

  Returns:
    Automatic form: `step(params, *batch)`, see above. Explicit form:
    `step(stage_params, batch, shared=None) -> (loss, grads)`; `stage_params`
    leaves are stacked on a leading axis of (virtual) stages; `batch` is
    `(inputs, targets)` or `(inputs, targets, side)`; `grads` mirrors `stage_params`, or is
    `(stage_grads, shared_grads)` when `shared` is given. `shared` weights (tied
    embeddings) are replicated; their gradient is reduced once over the stages.
    `step` may be wrapped in `jax.jit`; for a `lag=1` table run on GPUs, pass
    `compiler_options=compiler_options(schedule)` (both rings of its transfers
    beside each tick's compute).

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
    if layout is not None:
      raise TypeError(
        "layout belongs to the explicit form value_and_grad(stage_fn, "
        "loss_fn, layout=...); the automatic form takes the parameters in "
        "their own structure (make_train_step keeps them by device)"
      )
    if input_fn is not None:
      raise TypeError(
        "input_fn belongs to the explicit form value_and_grad(stage_fn, "
        "loss_fn, input_fn=...); the automatic form value_and_grad(loss_fn) "
        "finds the embedding itself"
      )
    return _modules.automatic(
      lambda f: _auto(
        f, sched, mesh, axis_name, has_aux, data_axis, layers, aux_reduce, state_argnums, fsdp
      ),
      fn,
    )
  if has_aux or layers is not None or aux_reduce is not None or state_argnums:
    raise TypeError(
      f"{'has_aux' if has_aux else 'layers'} belongs to the automatic form "
      "value_and_grad(loss_fn, ...); the explicit form's loss_fn returns a "
      "scalar and its stage_params set the layers per stage"
    )
  return lower(
    fn, loss_fn, sched, mesh, axis_name, input_fn, data_axis, _device_major(layout), fsdp=fsdp
  )


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
  layout: str | None = None,
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
    layout: the order of the rows of `stage_params` and `opt_state`, as in
      `value_and_grad`: "virtual" (the default) or "device" (keeps a
      stage-sharded stack of interleaved / zb-v weights where it lives).

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
  return lower_train(
    stage_fn, loss_fn, sched, mesh, axis_name, optimizer, input_fn, _device_major(layout)
  )


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


def make_train_step(
  loss_fn: Callable,
  optimizer: optax.GradientTransformation,
  *,
  mesh,
  axis_name: str,
  schedule: str | PipelineSchedule = "ooo",
  microbatches: int | None = None,
  chunks: int | None = None,
  data_axis: str | None = None,
  has_aux: bool = False,
  compiler_options: dict | None = None,
  layers: str | tuple[int, ...] | None = None,
  steps: int = 1,
  aux_reduce: Callable | None = None,
  state_argnums: int | tuple[int, ...] = (),
  fsdp: str = "regather",
) -> PipelineTrainStep:
  """A jitted pipelined train step of a plain loss, the optimizer applied per stage.

  The stages are cut from `loss_fn` as in `value_and_grad(loss_fn, mesh=...,
  axis_name=...)`; each step is one pipelined gradient (the mean over
  microbatches, and over data replicas with `data_axis`) followed by the
  optimizer's update, applied where each parameter lives: the stack's layers
  sharded on the stage axis, shared (tied) weights replicated and updated
  identically on every stage. Any optax transformation works, including those
  that reduce over every leaf (`clip_by_global_norm`: exact). Transformations
  that look at the parameters' structure see the user's tree: the masks and
  labels of `optax.masked` and `optax.partition` / `multi_transform` (a tree or
  a function, as in `adamw(mask=...)`) are evaluated on the user's parameters
  and laid out for the state's `StageParams` (the stack's layers must agree).

  Args:
    loss_fn: `loss_fn(params, *batch) -> scalar`, the plain loss (a mean over
      examples); with `has_aux`, `(loss, aux)`: the step returns `state, (loss,
      aux)` (`steps > 1`: each aux leaf with a leading axis of steps), the aux
      reduced over microbatches by `aux_reduce` as in `value_and_grad`.
    optimizer: the optax optimizer.
    mesh, axis_name, schedule, microbatches, chunks, data_axis, layers: as in
      `value_and_grad`. The split is fixed at `init` (`step.balance`); the cost
      model prices the local device, so pin `layers=step.balance.counts` to
      restore a checkpoint on another kind of device.
    compiler_options: passed to `jax.jit` (e.g. XLA's optimization level).
    fsdp: as in `value_and_grad`, read from the shardings of `init`'s
      parameters: with "regather" a stack's leaf split over `data_axis` on one
      of its own dimensions (the same in every layer) stays split in the state,
      its optimizer state too (`steps=1`; the tiled step gathers the stages).
    state_argnums: model state arguments (BatchNorm statistics), as in
      `value_and_grad`: pass the state in each call's batch and take the updated
      state from the aux. With `steps > 1` the state arguments are passed once
      (not stacked per step), each step's update feeds the next inside the call,
      and the call returns `state, (losses, aux), model_state` (the state
      arguments after the last step); state the first stage's forward reads (a
      stem BatchNorm normalising with its running statistics) is refused: use
      steps=1.
    steps: training steps per call. `steps > 1` runs them as one table tiled
      over steps (`ooojax.pipeline._tiled.TiledTrainStep`): step t + 1's
      warm-up under step t's drain, each stage's update at its own tick; the
      batch leaves (of `init` and of each call) are stacked on a leading axis
      of `steps`, the call returns the `(steps,)` losses. Needs an optimizer
      that acts leaf by leaf (`clip_by_global_norm` is refused: use steps=1).

  Returns:
    A `PipelineTrainStep`: `state = step.init(params, *batch)`, `state, loss =
    step(state, *batch)`, `params = step.params(state)` (the user's structure).
    The state is a pytree that orbax saves and restores (`step.abstract_state(
    params, *batch)` is the restore target, from shapes alone). `loss, grads =
    step.value_and_grad(state, *batch)` is the gradient without the update, in
    the state's layout (with `steps=1`).

  >>> import jax, jax.numpy as jnp, optax
  >>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
  >>> def loss(w, x, t):
  ...   h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]
  ...   return jnp.mean((h - t) ** 2)
  >>> step = make_train_step(loss, optax.sgd(0.1), mesh=mesh, axis_name="stage",
  ...                        schedule="1f1b", microbatches=2)
  >>> x, t = jnp.ones((4, 3)), jnp.zeros((4, 3))
  >>> state = step.init(jnp.ones((2, 3, 3)) * 0.1, x, t)
  >>> state.params.stacked[0].shape      # (stages, layers per stage, 3, 3)
  (2, 1, 3, 3)
  >>> step.balance.counts                # layers per virtual stage (`Balance`)
  (1, 1)
  >>> state, l0 = step(state, x, t)
  >>> state, l1 = step(state, x, t)
  >>> bool(l1 < l0), step.params(state).shape
  (True, (2, 3, 3))
  """
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
  if data_axis is not None and (data_axis not in mesh.shape or data_axis == axis_name):
    raise ValueError(
      f"data_axis={data_axis!r} must be a mesh axis other than the stage "
      f"axis {axis_name!r}; the mesh has {dict(mesh.shape)}"
    )
  sched = _table(schedule, mesh.shape[axis_name], microbatches, chunks)
  args = (
    loss_fn,
    optimizer,
    sched,
    mesh,
    axis_name,
    data_axis,
    has_aux,
    compiler_options,
    layers,
    aux_reduce,
    state_argnums,
    fsdp,
  )
  if not (isinstance(steps, int) and steps >= 1):
    raise ValueError(f"steps must be an int >= 1, got {steps!r}")
  if steps > 1:
    return TiledTrainStep(*args, steps=steps)
  return PipelineTrainStep(*args)
