"""Pipelined training: `ooo.pipeline.make_train_step` (a plain loss, the optimizer
applied per stage; `steps=n` tiles n steps into one table) and `ooo.pipeline.train`
(a stack written by hand, tiled over steps)."""

from __future__ import annotations

from collections.abc import Callable

import optax

from ooojax.passes.pipeline.generate import SCHEDULES, generate
from ooojax.passes.pipeline.schedule import PipelineSchedule
from ooojax.passes.pipeline.steps import tile
from ooojax.passes.pipeline.train import lower_train
from ooojax.pipeline._automatic import _device_major, _table
from ooojax.pipeline._tiled import TiledTrainStep
from ooojax.pipeline._train import PipelineTrainStep

__all__ = ["make_train_step", "train"]


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
  fsdp: str = "auto",
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
    fsdp: as in `value_and_grad` ("auto", the default; "regather"; "keep"),
      read from the shardings of `init`'s parameters: a stack's leaf split over
      `data_axis` on one of its own dimensions (the same in every layer) stays
      split in the state, its optimizer state too (`steps=1`; the tiled step
      gathers the stages); "keep" gathers it at the start of each step and
      reduce-scatters its gradient at the end, "regather" in each action. `step.fsdp_choice` says which ran and why.
      `step.params(state)` gives each leaf back with the sharding `init`'s had.
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
