"""Pipelined loss and gradients: `ooo.pipeline.value_and_grad`, of a plain loss (the
stages cut automatically, `ooojax.pipeline._automatic`) or of a stack of stages
written by hand (`passes.pipeline.execute.lower`)."""

from __future__ import annotations

from collections.abc import Callable

from ooojax.passes.pipeline.execute import lower
from ooojax.passes.pipeline.fsdp import FSDP_MODES
from ooojax.passes.pipeline.schedule import PipelineSchedule
from ooojax.pipeline import _modules
from ooojax.pipeline._automatic import _auto, _device_major, _table

__all__ = ["value_and_grad"]


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
  fsdp: str = "auto",
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
      Explicit-axes type, or arrays placed so and passed outside `jax.jit`;
      under Auto axes a traced leaf shows no sharding, and `make_train_step`,
      which reads `init`'s arrays, is the way there): "regather" keeps
      them split on each replica, all-gathers a chunk's weights inside each
      action that reads them (F, B, W) and reduce-scatters each W's gradient,
      which comes back split as the weight is; "keep" gathers every stage's
      weights once before the tick loop and holds them for the step, and
      reduce-scatters their gradient once after it (it comes back split); "auto" (the default) keeps, unless a device's
      stages gathered take over a quarter of its memory (the mesh's devices:
      H100, H200, A100, V100; a CPU's is unknown), as data parallel's
      `fsdp="auto"` (`passes.collectives.fsdp_mode`). `explain` says which, and why.
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
  if fsdp not in FSDP_MODES:
    raise ValueError(f"fsdp={fsdp!r}: use one of {FSDP_MODES}")
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
