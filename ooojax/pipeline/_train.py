"""The pipelined train step of a plain loss: `ooo.pipeline.make_train_step`.

The state keeps the parameters in the cut's layout (`passes.pipeline.cut`)
between steps, so no step gathers the model:

* `stacked`: the stack's leaves by virtual stage (`Cut.stage_params`): a scan's
  leaf as `(virtual stages, layers per stage, ...)`, a loop's as one array
  `(virtual stages, ...)` per row (each stage's j-th layer: no layer is sliced
  out of a stack), sharded on the stage axis (device s holds its stages' layers only; with an
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

import copy
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from ooojax.passes.pipeline.balance import Balance
from ooojax.passes.pipeline.cut import Cut
from ooojax.passes.pipeline.execute import device_order, xla_options


class StageParams(struct.PyTreeNode):
  """The parameters in the cut's layout; what the optimizer sees."""

  stacked: tuple  # the stack's leaves by virtual stage, device order (`Cut.stage_params`)
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
  # per stacked column, its dimension split over the data axis (FSDP within the
  # stage: the state holds 1/D of it), or None; None when no column is split
  fsdp: tuple | None = None
  # the FSDP mode the step runs on those columns (`passes.pipeline.fsdp.choose`)
  fsdp_choice: Any = None
  # per user leaf, the sharding `params` gives it back (the one `init` was given,
  # on this mesh's devices), or None: replicated
  shardings: tuple | None = None


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
    aux_reduce=None,
    state_argnums=(),
    fsdp="auto",
  ):
    from ooojax.passes.pipeline.fsdp import FSDP_MODES

    if fsdp not in FSDP_MODES:
      raise ValueError(f"fsdp={fsdp!r}: use one of {FSDP_MODES}")
    self.fsdp = fsdp
    self.loss_fn, self.optimizer, self.sched = loss_fn, optimizer, sched
    self._user_optimizer = optimizer  # its masks in the user's tree (`_pipeline_masks`)
    self.mesh, self.axis_name, self.data_axis, self.has_aux = (mesh, axis_name, data_axis, has_aux)
    self.compiler_options, self.layers = compiler_options, layers
    self.aux_reduce, self.state_argnums = aux_reduce, state_argnums
    self._layout: _Layout | None = None
    self._step = self._grad = self._to_user = None
    self.tuning = None  # `tune`'s measurement, on the step it returns

  # --- layout ----------------------------------------------------------------------
  def _program(self, avals, treedef, batch, layers=None, lowering=None):
    from ooojax.pipeline._automatic import _auto_program  # the automatic form's cut and executor

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
      lowering=lowering,
      state_argnums=self.state_argnums,
      fsdp=self._layout.fsdp if self._regathers() else "keep",
      split_dims=self._layout and self._layout.fsdp,  # keep: gradients split as the state
    )

  def _regathers(self) -> bool:
    lay = self._layout
    return bool(lay and lay.fsdp and lay.fsdp_choice.mode == "regather")

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
    bal = box["prog"].balance
    split = self._split_columns(leaves, c, bal.counts)
    return _Layout(
      treedef,
      avals,
      c,
      bal,
      tuple(i for i in range(len(leaves)) if i not in used),
      split,
      split and self._choose(avals, c, bal.counts, split),
      tuple(self._given_sharding(x) for x in leaves),
    )

  def _choose(self, avals, c: Cut, counts, split):
    """`fsdp="auto"`'s mode for the split columns, from their bytes on a device."""
    from ooojax.passes.pipeline.fsdp import choose, spec_name

    cols = jax.eval_shape(lambda ls: c.stage_params(ls, counts), list(avals))
    m = self.mesh
    D = m.shape[self.data_axis]
    args = (self.sched.stages, self.sched.microbatches, D, spec_name(m))
    return choose(self.fsdp, cols, split, *args)

  def _given_sharding(self, x):
    """A user leaf's sharding when it is on this step's mesh (an array, or a
    `ShapeDtypeStruct` with one), else None (one program takes one mesh)."""
    s = getattr(x, "sharding", None)
    return s if isinstance(s, NamedSharding) and s.mesh == self.mesh else None

  def _split_columns(self, leaves, c: Cut, counts) -> tuple | None:
    """`_Layout.fsdp`, from the user's leaves' shardings (with a data axis): the state
    holds them split whichever mode runs (keep gathers them at each step's start)."""
    if self.data_axis is None:
      return None
    from ooojax.passes.pipeline.fsdp import stack_dims

    return stack_dims(leaves, c, counts, self.data_axis)

  def _shardings(self, state_shape: PipelineTrainState) -> PipelineTrainState:
    rep = NamedSharding(self.mesh, P())
    p = state_shape.params
    dims = (self._layout.fsdp if self._layout else None) or (None,) * len(p.stacked)
    stage = lambda d: NamedSharding(  # noqa: E731 - FSDP: a dimension split over the data axis
      self.mesh,
      P(self.axis_name) if d is None else P(self.axis_name, *[None] * (d - 1), self.data_axis),
    )
    p_sh = StageParams(
      tuple(stage(d) for d in dims), tuple(rep for _ in p.shared), tuple(rep for _ in p.rest)
    )
    box = {}

    def o_sh():  # traced: the optimizer's init (Adam's count) runs on no device, so
      # this works under a mesh of compile-only GPUs too (`abstract_state`)
      box["o"] = optax.tree_map_params(
        self.optimizer,
        lambda _, s: s,
        state_shape.opt_state,
        p_sh,
        transform_non_params=lambda _: rep,
      )
      return 0

    jax.eval_shape(o_sh)
    return PipelineTrainState(rep, p_sh, box["o"])

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

  def _flags_in_layout(self, flags) -> StageParams:
    """One mask flag or label per user leaf, laid out as `StageParams`."""
    lay = self._layout
    c = lay.cut
    cols = []
    for k in range(len(c.stacked[0])):
      vals = [flags[row[k]] for row in c.stacked]
      if any(v != vals[0] for v in vals):
        paths = [
          jax.tree_util.keystr(p)
          for p, _ in jax.tree_util.tree_flatten_with_path(lay.treedef.unflatten(lay.avals))[0]
        ]
        j = next(j for j, v in enumerate(vals) if v != vals[0])
        raise ValueError(
          f"the optimizer's mask or labels give the stack's layers different values "
          f"({paths[c.stacked[0][k]]}: {vals[0]!r}, {paths[c.stacked[j][k]]}: "
          f"{vals[j]!r}); a pipelined stack updates each leaf of all its layers as "
          "one array: give every layer the same"
        )
      cols += [vals[0]] * c.per_leaf(lay.balance.counts)
    return StageParams(
      tuple(cols), tuple(flags[i] for i in c.shared), tuple(flags[i] for i in lay.rest)
    )

  # --- public ----------------------------------------------------------------------
  def _make(self, params, batch):
    from ooojax.pipeline._masks import in_layout

    self._layout = self._plan(params, batch)
    self._step = self._grad = self._to_user = None
    # masks and labels of the user's tree (optax.masked, partition), laid out by stage
    self.optimizer = in_layout(self._user_optimizer, params, self._flags_in_layout)

    def make(p):
      sp = self._to_stages(jax.tree.leaves(p))
      return PipelineTrainState(jnp.zeros((), jnp.int32), sp, self.optimizer.init(sp))

    try:
      shape = jax.eval_shape(make, params)
    except (ValueError, TypeError) as e:  # a mask or label tree of the user's structure
      if "StageParams" not in str(e):
        raise
      raise ValueError(
        "the optimizer compares a tree in your parameters' structure with the train "
        "state's layout: make_train_step's optimizer sees StageParams(stacked, shared, "
        "rest), the stack's leaves stacked by stage. The masks and labels of "
        "optax.masked and optax.partition / multi_transform (adamw's mask too) are "
        "laid out for it; this tree is kept elsewhere. Use one of those, or take the "
        "gradients in your tree from ooo.pipeline.value_and_grad and apply your "
        "optimizer to them (docs/guides/pipeline-real-losses.md)"
      ) from e
    return make, self._shardings(shape)

  def _split_module(self, params):
    """An Equinox module's inexact arrays (its other fields kept, static, for the
    loss and for `params`), or `params` as given."""
    from ooojax.pipeline import _modules

    if not hasattr(self, "_user_loss"):
      self._user_loss = self.loss_fn
    self._module = _modules.filtered(params)
    if self._module is None:
      self.loss_fn = self._user_loss
      return params
    self.loss_fn = self._module.loss(self._user_loss)
    return self._module.diff

  def init(self, params, *batch) -> PipelineTrainState:
    """The first state, laid out and sharded by stage. `batch` is only traced (shapes)."""
    params = self._split_module(params)
    make, shardings = self._make(params, batch)
    return jax.jit(make, out_shardings=shardings)(params)

  def abstract_state(self, params, *batch) -> PipelineTrainState:
    """`init`'s state as sharded `jax.ShapeDtypeStruct`s, from shapes alone: the
    target of an orbax restore in a fresh process (it also readies `step`)."""
    params = self._split_module(params)
    make, shardings = self._make(params, batch)
    return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      jax.eval_shape(make, params),
      shardings,
    )

  def params(self, state: PipelineTrainState | StageParams):
    """The parameters in the user's structure (gathers every stage's layers); of a
    state, or of any tree in its layout (`StageParams`: `value_and_grad`'s grads).
    Each leaf comes back with the sharding `init`'s leaf had (an FSDP leaf split
    over the data axis stays split), or replicated over the mesh."""
    self._check_init()
    lay = self._layout
    sp = state.params if isinstance(state, PipelineTrainState) else state
    if self._to_user is None:  # one program: no device holds more than its leaves' shards
      rep = NamedSharding(self.mesh, P())
      given = lay.shardings or (None,) * len(lay.avals)
      self._to_user = jax.jit(self._user_leaves, out_shardings=[s or rep for s in given])
    out = lay.treedef.unflatten(self._to_user(sp))
    module = getattr(self, "_module", None)
    return out if module is None else module.combine(out)  # an Equinox module's own tree

  def _user_leaves(self, p: StageParams) -> list:
    """`_to_stages`' inverse: the user's leaves of a tree in the state's layout."""
    lay = self._layout
    zeros = [jnp.zeros((), a.dtype) for a in lay.avals]  # placeholders of the rest
    # the stages gathered first (a stage-split dimension is not sliced under Explicit
    # axes); an FSDP column stays split over the data axis
    dims = lay.fsdp or (None,) * len(p.stacked)
    stacked = tuple(
      jax.device_put(
        x, NamedSharding(self.mesh, P() if d is None else P(*[None] * d, self.data_axis))
      )
      for x, d in zip(p.stacked, dims)
    )
    if self.sched.chunks > 1:  # back to virtual-stage order
      stacked = tuple(x[np.argsort(device_order(self.sched))] for x in stacked)
    out = lay.cut.grads(zeros, stacked, p.shared, lay.balance.counts)  # stage_params^-1
    for i, x in zip(lay.rest, p.rest):
      out[i] = x
    return out

  @property
  def fsdp_choice(self):
    """The FSDP mode the step runs on the stack's leaves split over the data axis and
    why (`passes.collectives.fsdp_mode.FsdpChoice`), or None: none is split."""
    self._check_init()
    return self._layout.fsdp_choice

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
    sp = state.params
    loss, grads = self._grads(state, *batch)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, sp)
    return PipelineTrainState(state.step + 1, optax.apply_updates(sp, updates), opt_state), loss

  def value_and_grad(self, state: PipelineTrainState, *batch) -> tuple[Any, StageParams]:
    """`(loss, grads)` of the state's parameters without the update: the pipelined
    gradient in the state's layout (`StageParams`: stacks in device order, sharded
    by stage; `shared` reduced over the stages), so nothing but activations and
    that reduction crosses between the devices. `step.params(grads)` gives them in
    the user's structure (one gather)."""
    self._check_init()
    if self._grad is None:
      shardings = self._shardings(jax.eval_shape(lambda s: s, state)).params
      rep = NamedSharding(self.mesh, P())
      self._grad = jax.jit(self._grads, out_shardings=(rep, shardings), **self._jit_options())
    return self._grad(state, *batch)

  def _grads(self, state: PipelineTrainState, *batch):
    lay = self._layout
    prog = self._program(list(lay.avals), lay.treedef, batch, lay.balance.counts)
    sp = state.params
    out, (gp, gsh) = prog.run(tuple(sp.stacked) + prog.state_cols, prog.batch, sp.shared)
    loss, aux, gp = prog.split(out, gp)
    if self.has_aux:
      loss = (loss, prog.aux(aux, self.aux_reduce))
    return loss, StageParams(tuple(gp), tuple(gsh), tuple(jnp.zeros_like(x) for x in sp.rest))

  _extra_outputs = 0  # outputs after (state, loss)

  def _jit_options(self) -> dict:
    """`jax.jit`'s keywords: the table's XLA options (`compiler_options`: both
    rings of a lag-1 table beside the action on a GPU), the user's winning."""
    opts = {**xla_options(self.sched), **(self.compiler_options or {})}
    return {"compiler_options": opts} if opts else {}

  def _jitted(self, state):
    self._check_init()
    if self._step is None:
      shardings = self._shardings(jax.eval_shape(lambda s: s, state))
      rep = NamedSharding(self.mesh, P())
      extra = (rep,) * self._extra_outputs  # the tiled step's model state
      self._step = jax.jit(
        self._body, out_shardings=(shardings, rep, *extra), **self._jit_options()
      )
    return self._step

  def lower(self, state: PipelineTrainState, *batch):
    """`jax.jit(step).lower(state, *batch)` (state may be `abstract_state`'s)."""
    return self._jitted(state).lower(state, *batch)

  def __call__(self, state: PipelineTrainState, *batch) -> tuple[PipelineTrainState, Any]:
    return self._jitted(state)(state, *batch)

  def tune(
    self,
    state: PipelineTrainState,
    *batch,
    candidates=None,
    budget: int | None = None,
    link=None,
    costs=None,
    rounds: int = 5,
    tie: float = 0.03,
    lag=None,
  ) -> PipelineTrainStep:
    """This step running the table that times fastest here (`ooo.pipeline.tune`).

    Each candidate (default: `ooo` at 1F1B's depth, 1F1B's and GPipe's tables,
    and `ooo` planned on `link` when one is given; at most `budget`
    activations per stage, default GPipe's) is compiled and timed on `state`
    and `batch` for `rounds` alternating rounds; process 0's times pick for
    every process. Returns a new step (same state layout, the layers per stage
    of `step.balance` kept) whose `tuning` holds the times; `state` is not
    updated. Candidates must lay out the weights as this step's table does
    (the same chunks and device order). Named candidates are generated at this
    step's lag unless `lag` says otherwise (`(0, 1)`: both, see
    `ooo.pipeline.tune`).

    >>> step = step.tune(state, *batch)   # doctest: +SKIP
    >>> print(step.tuning)                # doctest: +SKIP
    """
    from ooojax.pipeline._tune import tune

    self._check_init()
    order = device_order(self.sched)

    def build(t):
      if t.chunks != self.sched.chunks or not np.array_equal(device_order(t), order):
        raise ValueError(
          f"candidate {t.name!r} ({t.chunks} chunks per device) lays the weights "
          f"out differently from this step's {self.sched.name!r} ({self.sched.chunks}); "
          "tune among tables of the same layout, or build a step per layout"
        )
      s = copy.copy(self)
      s.sched, s.layers = t, self._layout.balance.counts
      s._step = s._grad = s._to_user = None
      return s

    s, s_tuning = tune(
      build,
      (state, *batch),
      stages=self.sched.stages,
      microbatches=self.sched.microbatches,
      candidates=candidates,
      budget=budget,
      link=link,
      costs=costs,
      rounds=rounds,
      tie=tie,
      lag=self.sched.lag if lag is None else lag,
    )
    s.tuning = s_tuning
    return s
