"""The pipelined train step of a plain loss: `ooo.pipeline.make_train_step`.

The state keeps the parameters in the cut's layout (`passes.pipeline.cut`)
between steps, so no step gathers the model:

* `stacked`: the stack's leaves as `(virtual stages, layers per stage, ...)`,
  sharded on the stage axis (device s holds its stages' layers only; with an
  uneven split, `step.balance`, padded to the largest count with zero rows
  whose gradient is zero, so they stay zero under any optimizer); with
  chunks (interleaved, zb-v) the virtual stages are in device order
  (`execute.device_order`), so each device's chunks are its own shard;
* `shared`: leaves the prologue or the epilogue read (tied embeddings, the
  head, the final norm), replicated; their gradient is reduced over the
  stages inside the executor, so every device applies the same update;
* `rest`: leaves the loss never reads (zero gradient), replicated.

The optimizer state mirrors that layout and sharding (`optax.tree_map_params`).
The update runs in the global view of one `jax.jit` around the pipelined
gradient: leaf-wise optimizers stay on each device's shard, and reductions
over every leaf (`clip_by_global_norm`) get their cross-stage sum from XLA, so
they are exact. `step.params(state)` converts back to the user's structure
(the one place the stages are gathered).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from ooojax.passes.pipeline.balance import Balance
from ooojax.passes.pipeline.cut import Cut
from ooojax.passes.pipeline.execute import device_order
from ooojax.passes.pipeline.schedule import PipelineSchedule


class StageParams(struct.PyTreeNode):
  """The parameters in the cut's layout; what the optimizer sees."""

  stacked: tuple  # (virtual stages in device order, layers per stage, ...) per stack leaf
  shared: tuple  # leaves read outside the stack, replicated
  rest: tuple  # leaves the loss never reads, replicated


class PipelineTrainState(struct.PyTreeNode):
  """A pipelined training loop's state; `step.params(state)` gives the user's tree."""

  step: jax.Array
  params: StageParams
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class _Layout:
  treedef: Any
  avals: tuple  # the user's leaves as ShapeDtypeStructs (what the loss is traced at)
  cut: Cut  # from `init`'s trace: leaf positions and layout conversions
  balance: Balance  # layers per virtual stage, fixed at `init` (the state's shapes)
  rest: tuple[int, ...]  # leaf positions the loss never reads


class PipelineTrainStep:
  """`state, loss = step(state, *batch)`; built by `make_train_step`."""

  def __init__(
    self,
    loss_fn,
    optimizer,
    sched,
    mesh,
    axis_name,
    data_axis,
    has_aux,
    compiler_options,
    layers=None,
  ):
    self.loss_fn, self.optimizer, self.sched = loss_fn, optimizer, sched
    self.mesh, self.axis_name, self.data_axis, self.has_aux = (mesh, axis_name, data_axis, has_aux)
    self.compiler_options, self.layers = compiler_options, layers
    self._layout: _Layout | None = None
    self._step = None

  # --- layout ----------------------------------------------------------------------
  def _program(self, avals, treedef, batch, layers=None):
    from ooojax.pipeline import _auto_program  # the automatic form's cut and executor

    return _auto_program(
      self.loss_fn,
      self.has_aux,
      self.sched,
      self.mesh,
      self.axis_name,
      self.data_axis,
      avals,
      treedef,
      batch,
      device_major=True,
      layers=self.layers if layers is None else layers,
    )

  def _plan(self, params, batch) -> _Layout:
    leaves, treedef = jax.tree.flatten(params)
    avals = tuple(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves)
    box = {}

    def trace(*b):  # shapes only: the cut's leaf positions do not depend on values
      box["prog"] = self._program(avals, treedef, b)
      return 0

    jax.eval_shape(trace, *batch)
    c = box["prog"].cut
    used = {i for row in c.stacked for i in row} | set(c.shared)
    return _Layout(
      treedef, avals, c, box["prog"].balance, tuple(i for i in range(len(leaves)) if i not in used)
    )

  def _shardings(self, state_shape: PipelineTrainState) -> PipelineTrainState:
    stage = NamedSharding(self.mesh, P(self.axis_name))
    rep = NamedSharding(self.mesh, P())
    p = state_shape.params
    p_sh = StageParams(
      tuple(stage for _ in p.stacked), tuple(rep for _ in p.shared), tuple(rep for _ in p.rest)
    )
    o_sh = optax.tree_map_params(
      self.optimizer,
      lambda _, s: s,
      state_shape.opt_state,
      p_sh,
      transform_non_params=lambda _: rep,
    )
    return PipelineTrainState(rep, p_sh, o_sh)

  def _to_stages(self, leaves) -> StageParams:
    lay = self._layout
    c = lay.cut
    order = device_order(self.sched)
    stacked = c.stage_params(leaves, lay.balance.counts)
    if self.sched.chunks > 1:
      stacked = tuple(x[order] for x in stacked)
    return StageParams(
      tuple(stacked), tuple(leaves[i] for i in c.shared), tuple(leaves[i] for i in lay.rest)
    )

  # --- public ----------------------------------------------------------------------
  def _make(self, params, batch):
    self._layout = self._plan(params, batch)
    self._step = None

    def make(p):
      sp = self._to_stages(jax.tree.leaves(p))
      return PipelineTrainState(jnp.zeros((), jnp.int32), sp, self.optimizer.init(sp))

    return make, self._shardings(jax.eval_shape(make, params))

  def init(self, params, *batch) -> PipelineTrainState:
    """The first state, laid out and sharded by stage. `batch` is only traced (shapes)."""
    make, shardings = self._make(params, batch)
    return jax.jit(make, out_shardings=shardings)(params)

  def abstract_state(self, params, *batch) -> PipelineTrainState:
    """`init`'s state as sharded `jax.ShapeDtypeStruct`s, from shapes alone: the
    target of an orbax restore in a fresh process (it also readies `step`)."""
    make, shardings = self._make(params, batch)
    return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      jax.eval_shape(make, params),
      shardings,
    )

  def params(self, state: PipelineTrainState):
    """The parameters in the user's structure (gathers every stage's layers)."""
    self._check_init()
    lay = self._layout
    rep = NamedSharding(self.mesh, P())
    p = jax.tree.map(lambda x: jax.device_put(x, rep), state.params)
    zeros = [jnp.zeros((), a.dtype) for a in lay.avals]  # placeholders of the rest
    stacked = p.stacked
    if self.sched.chunks > 1:  # back to virtual-stage order
      stacked = tuple(x[np.argsort(device_order(self.sched))] for x in stacked)
    out = lay.cut.grads(zeros, stacked, p.shared, lay.balance.counts)  # stage_params^-1
    for i, x in zip(lay.rest, p.rest):
      out[i] = x
    return lay.treedef.unflatten(out)

  @property
  def balance(self) -> Balance:
    """The layers per virtual stage (and their cost-model times) `init` chose."""
    self._check_init()
    return self._layout.balance

  def _check_init(self):
    if self._layout is None:
      raise ValueError(
        "call step.init(params, *batch) first: it cuts the loss into stages "
        "and lays the parameters out by stage"
      )

  def _body(self, state: PipelineTrainState, *batch):
    lay = self._layout
    prog = self._program(list(lay.avals), lay.treedef, batch, lay.balance.counts)
    sp = state.params
    loss, (gp, gsh) = prog.run(sp.stacked, prog.batch, sp.shared)
    grads = StageParams(tuple(gp), tuple(gsh), tuple(jnp.zeros_like(x) for x in sp.rest))
    updates, opt_state = self.optimizer.update(grads, state.opt_state, sp)
    return PipelineTrainState(state.step + 1, optax.apply_updates(sp, updates), opt_state), loss

  def _jitted(self, state):
    self._check_init()
    if self._step is None:
      shardings = self._shardings(jax.eval_shape(lambda s: s, state))
      rep = NamedSharding(self.mesh, P())
      kw = {"compiler_options": self.compiler_options} if self.compiler_options else {}
      self._step = jax.jit(self._body, out_shardings=(shardings, rep), **kw)
    return self._step

  def lower(self, state: PipelineTrainState, *batch):
    """`jax.jit(step).lower(state, *batch)` (state may be `abstract_state`'s)."""
    return self._jitted(state).lower(state, *batch)

  def __call__(self, state: PipelineTrainState, *batch) -> tuple[PipelineTrainState, Any]:
    return self._jitted(state)(state, *batch)


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
) -> PipelineTrainStep:
  """A jitted pipelined train step of a plain loss, the optimizer applied per stage.

  The stages are cut from `loss_fn` as in `value_and_grad(loss_fn, mesh=...,
  axis_name=...)`; each step is one pipelined gradient (the mean over
  microbatches, and over data replicas with `data_axis`) followed by the
  optimizer's update, applied where each parameter lives: the stack's layers
  sharded on the stage axis, shared (tied) weights replicated and updated
  identically on every stage. Any optax transformation works, including those
  that reduce over every leaf (`clip_by_global_norm`: exact). Transformations
  that look at the parameters' structure (`optax.masked` with a tree of flags)
  see the state's `StageParams` layout, not the user's tree.

  Args:
    loss_fn: `loss_fn(params, *batch) -> scalar`, the plain loss (a mean over
      examples); with `has_aux`, `(loss, aux)` (aux is not computed).
    optimizer: the optax optimizer.
    mesh, axis_name, schedule, microbatches, chunks, data_axis, layers: as in
      `value_and_grad`. The split is fixed at `init` (`step.balance`); the cost
      model prices the local device, so pin `layers=step.balance.counts` to
      restore a checkpoint on another kind of device.
    compiler_options: passed to `jax.jit` (e.g. XLA's optimization level).
    steps: training steps per call. `steps > 1` runs them as one table tiled
      over steps (`ooojax._pipeline_tiled.TiledTrainStep`): step t + 1's
      warm-up under step t's drain, each stage's update at its own tick; the
      batch leaves (of `init` and of each call) are stacked on a leading axis
      of `steps`, the call returns the `(steps,)` losses. Needs an optimizer
      that acts leaf by leaf (`clip_by_global_norm` is refused: use steps=1).

  Returns:
    A `PipelineTrainStep`: `state = step.init(params, *batch)`, `state, loss =
    step(state, *batch)`, `params = step.params(state)` (the user's structure).
    The state is a pytree that orbax saves and restores (`step.abstract_state(
    params, *batch)` is the restore target, from shapes alone).

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
  from ooojax.pipeline import _table

  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
  if data_axis is not None and (data_axis not in mesh.shape or data_axis == axis_name):
    raise ValueError(
      f"data_axis={data_axis!r} must be a mesh axis other than the stage "
      f"axis {axis_name!r}; the mesh has {dict(mesh.shape)}"
    )
  sched = _table(schedule, mesh.shape[axis_name], microbatches, chunks)
  args = (loss_fn, optimizer, sched, mesh, axis_name, data_axis, has_aux, compiler_options, layers)
  if not (isinstance(steps, int) and steps >= 1):
    raise ValueError(f"steps must be an int >= 1, got {steps!r}")
  if steps > 1:
    from ooojax._pipeline_tiled import TiledTrainStep

    return TiledTrainStep(*args, steps=steps)
  return PipelineTrainStep(*args)
