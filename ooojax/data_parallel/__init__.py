"""Data-parallel training steps with cross-step overlap (the paper's full algorithm).

`ooo.grad(loss, mode="data_parallel", axis_name=...)` inside `pmap` /
`shard_map` gives mean gradients with each bucket's all-reduce issued right
after its last dW cluster. This module adds the opt-in step in which the
all-reduce and optimizer update of the first `k` layers finish at the START of
the next step:

* step t computes its gradients with the first `k` layers' dW after the dX
  chain (reverse first-k) and reduces every other bucket during the backward;
  the first-k gradients stay per-device and unreduced in `state.pending` (on a
  link-bound step the planner may carry the last layers the forward reads
  instead, their dW in place: `CollectivePlan.carried`);
* step t+1 first reduces them (in the order its forward reads them, in
  buckets of the plan's size, chained), applies the optimizer to the complete gradient of step t, then
  runs its forward. Layer j's update depends only on layer j's reduction (for
  an optimizer that updates each leaf from its own gradient: adam, adamw, sgd,
  chains of them; `leafwise`), so XLA may run the later layers' reductions
  under the earlier layers' forward. With a global transform
  (`clip_by_global_norm`) every update waits for every reduction: the planner
  then carries nothing (k = 0) unless `first_k` is given.

The parameters each forward sees are exactly those of the plain synchronous
loop (`params_{t+1} = update(params_t, g_t)`): only the moment the update is
applied moves. `state.params` therefore lags one update behind until
`flush(state)` applies what is pending; `pending` is part of the state, so
a checkpoint taken between steps restores the same training.

`Pending` is the general container for work one step leaves to the next
(per-parameter values still to be reduced, values ready to apply, and whether
they are real); `ooojax.single_gpu` carries its deferred dW clusters' inputs
in it the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from ooojax import _dp, _filter
from ooojax._api import _make_options, value_and_grad
from ooojax.passes import _compat
from ooojax.passes.collectives import plan as collectives
from ooojax.passes.collectives.emit import chain_after, reduce_buffers
from ooojax.passes.cost import CostModel


class Pending(struct.PyTreeNode):
  """Per-parameter work left for the next step, in leaf order of the params.

  local: per-device values still to be reduced over the data axis, one per
    deferred leaf, each with a leading device axis (sharded over the mesh).
  ready: values already complete on every device, one per other leaf.
  valid: False before the first step and after `flush` (nothing to apply).
  """

  local: tuple
  ready: tuple
  valid: jax.Array


class DPTrainState(struct.PyTreeNode):
  """Parameters, optimizer state and pending work of a cross-step data-parallel loop.

  `params` lags one update behind the plain loop while `pending.valid`; use
  `step.flush(state)` for the parameters of the plain loop.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  pending: Pending


@dataclasses.dataclass(frozen=True)
class _Layout:
  treedef: Any
  deferred: tuple[int, ...]  # leaf positions reduced next step, as the forward reads them
  ready: tuple[int, ...]
  first_k: int
  bucket_bytes: int
  # the deferred leaves' all-reduces next step: positions into `deferred`, one
  # bucket each, forward order (`collectives.carried_buckets`)
  carried: tuple[tuple[int, ...], ...] = ()


class DataParallelStep:
  """`state, loss = step(state, batch)`; built by `make_train_step`."""

  def __init__(self, loss_fn, tx, mesh, axis_name, cross_step, options, has_aux=False):
    self.loss_fn, self.tx, self.mesh, self.axis_name = loss_fn, tx, mesh, axis_name
    self.user_loss_fn, self.has_aux = loss_fn, has_aux
    self._held = None  # what `init` was given when not bare params (see `held`)
    self.cross_step = cross_step
    self.options = options
    self.n = mesh.shape[axis_name]
    self._layout: _Layout | None = None
    self.plan = None  # set by `init` / `abstract_state`
    self._step = self._flush = None

  # --- setup ---------------------------------------------------------------------
  def _plan_layout(self, params, batch) -> _Layout:
    """Traces one device's gradient to choose k and bucket size, and the deferred leaves."""
    opts = self.options
    vg = value_and_grad(
      self.loss_fn, mode="in_order", device=opts.get("device"), has_aux=self.has_aux
    )
    local = jax.tree.map(
      lambda b: jax.ShapeDtypeStruct((b.shape[0] // self.n, *b.shape[1:]), b.dtype), batch
    )
    plan = vg.abstract_plan(params, local)
    cp = collectives.plan(
      plan.split,
      plan.schedule,
      CostModel(opts.get("device")),
      self.n,
      opts.get("link"),
      opts.get("bucket_bytes"),
      opts.get("first_k"),
      cross_step=self.cross_step,
      reduce_dtype=opts.get("reduce_dtype"),
    )
    self.plan = cp  # the chosen `CollectivePlan` (`cross_step`: its carried-step estimate)
    k = cp.first_k if self.cross_step else 0
    last = cp.carried if self.cross_step else frozenset()
    deferred = collectives.first_k_leaves(plan.split, k) | last
    if deferred and opts.get("first_k") is None and not leafwise(self.tx, params, deferred):
      # a global transform (clip_by_global_norm, ...): every update waits for every
      # carried reduction, so nothing of the next forward can hide them
      k, deferred = 0, frozenset()
    # reduced next step in the order its forward reads them (a tied embedding first)
    order = collectives.carried_order(plan.split, deferred, collectives.forward_starts(plan.split))
    leaves, treedef = jax.tree.flatten(params)
    ready = tuple(i for i in range(len(leaves)) if i not in deferred)
    nbytes = collectives._grad_bytes(plan.split, opts.get("reduce_dtype"))  # link bytes
    pos = {leaf: j for j, leaf in enumerate(order)}
    carried = tuple(
      tuple(pos[leaf] for leaf in b)
      for b, _ in collectives.carried_buckets(order, nbytes, cp.bucket_bytes)
    )
    return _Layout(treedef, tuple(order), ready, k, cp.bucket_bytes, carried)

  def _take(self, held):
    """Params (and optimizer state or None) from what the user holds; see `init`."""
    if isinstance(held, tuple) and len(held) == 2 and _is_nnx_graphdef(held[0]):
      from flax import nnx

      graphdef, params = held
      bad = [
        jax.tree_util.keystr(p)
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating)
      ]
      if bad:
        raise TypeError(
          f"the nnx state holds non-float leaves {bad[:4]}: split the Params "
          "out, `graphdef, params, rest = nnx.split(model, nnx.Param, ...)`, and "
          "pass (graphdef, params); close over `rest` in loss_fn"
        )
      user = self.user_loss_fn
      self.loss_fn = lambda p, *b: user(nnx.merge(graphdef, p), *b)
      self._held = ("nnx", graphdef)
      return params, None
    if _filter.holds_module(held):  # Equinox: its inexact arrays, the rest closed in
      if self.tx is None:
        raise TypeError("make_train_step(..., tx=None) with an Equinox module: pass tx")
      module = _filter.Filtered(held)
      self.loss_fn = module.loss(self.user_loss_fn)
      self._held = ("equinox", module)
      return module.diff, None
    if all(hasattr(held, a) for a in ("params", "opt_state", "tx", "apply_fn")):  # TrainState
      if self.tx is None:
        self.tx = held.tx
      self._held = ("train_state", held)
      return held.params, held.opt_state
    if self.tx is None:
      raise TypeError(
        "make_train_step(..., tx=None) takes its optimizer from a flax "
        "TrainState: pass one to init, or pass tx"
      )
    return held, None

  def held(self, state: DPTrainState):
    """`state` flushed and given back as `init` took it: a flax `TrainState` (its
    `step` counts the updates applied), nnx's `(graphdef, params)`, or the params."""
    state = self.flush(state)
    kind = self._held[0] if self._held else None
    if kind == "train_state":
      return self._held[1].replace(step=state.step, params=state.params, opt_state=state.opt_state)
    if kind == "nnx":
      return self._held[1], state.params
    if kind == "equinox":  # the module, its trained arrays put back
      return self._held[1].combine(state.params)
    return state.params

  def init(self, params, batch) -> DPTrainState:
    """The first state: nothing pending. `batch` is only traced (shapes).

    `params` may be the parameters, a flax `TrainState` (its params, optimizer
    state and, with `tx=None`, its `tx`), an nnx `(graphdef, params)` pair
    (`loss_fn(model, batch)` then gets `nnx.merge(graphdef, params)`), or an
    Equinox module (its inexact arrays are the state's params, its other
    fields kept as `init` saw them; `held(state)` gives the module back).
    """
    params, opt_state = self._take(params)
    lay = self._layout = self._plan_layout(params, batch)
    leaves = jax.tree.leaves(params)
    rep = NamedSharding(self.mesh, P())
    dev = NamedSharding(self.mesh, P(self.axis_name))
    local = tuple(
      jax.device_put(jnp.zeros((self.n, *leaves[i].shape), leaves[i].dtype), dev)
      for i in lay.deferred
    )
    ready = tuple(jax.device_put(jnp.zeros_like(leaves[i]), rep) for i in lay.ready)
    state = DPTrainState(
      jnp.zeros((), jnp.int32),
      params,
      self.tx.init(params) if opt_state is None else opt_state,
      Pending(local, ready, jnp.zeros((), bool)),
    )
    return jax.device_put(state, self._specs(state, sharding=True))

  def abstract_state(self, params, batch) -> DPTrainState:
    """`init`'s state as `jax.ShapeDtypeStruct`s (for `lower` on compile-only devices)."""
    params, _ = self._take(params)
    lay = self._layout = self._plan_layout(params, batch)
    leaves = jax.tree.leaves(params)
    rep = NamedSharding(self.mesh, P())
    dev = NamedSharding(self.mesh, P(self.axis_name))
    sds = lambda shape, dtype, s: jax.ShapeDtypeStruct(shape, dtype, sharding=s)
    on = lambda tree: jax.tree.map(lambda a: sds(a.shape, a.dtype, rep), tree)
    return DPTrainState(
      sds((), jnp.int32, rep),
      on(params),
      on(jax.eval_shape(self.tx.init, params)),
      Pending(
        tuple(sds((self.n, *leaves[i].shape), leaves[i].dtype, dev) for i in lay.deferred),
        tuple(sds(leaves[i].shape, leaves[i].dtype, rep) for i in lay.ready),
        sds((), bool, rep),
      ),
    )

  def lower(self, state, batch):
    """`jax.jit(step).lower(state, batch)` (state may be `abstract_state`'s)."""
    if self._step is None:
      self._build(state)
    return self._step.lower(state, batch)

  def _specs(self, state, sharding=False):
    wrap = (lambda s: NamedSharding(self.mesh, s)) if sharding else (lambda s: s)
    specs = jax.tree.map(lambda _: wrap(P()), state)
    local = tuple(wrap(P(self.axis_name)) for _ in state.pending.local)
    return specs.replace(pending=specs.pending.replace(local=local))

  # --- the per-device program ------------------------------------------------------
  def _apply_pending(self, state: DPTrainState) -> DPTrainState:
    lay, pend = self._layout, state.pending
    vals = [x[0] for x in pend.local]  # drop the device axis of this shard
    reduced, prev = [None] * len(vals), None
    for b in lay.carried:  # one all-reduce per bucket, layer 0 first, chained
      rs, prev = reduce_buffers(
        chain_after(prev, [vals[j] for j in b]),
        self.axis_name,
        self.options.get("reduce", "mean"),
        prescale=len(b) > 1,
        reduce_dtype=self.options.get("reduce_dtype"),
      )
      for j, r in zip(b, rs):
        reduced[j] = r
    flat = [None] * (len(lay.deferred) + len(lay.ready))
    for i, r in zip(lay.deferred, reduced):
      flat[i] = r
    for i, r in zip(lay.ready, pend.ready):
      flat[i] = r
    grads = jax.tree.unflatten(lay.treedef, flat)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(pend.valid, a, b), new, old)
    return state.replace(
      step=state.step + pend.valid.astype(state.step.dtype),
      params=keep(params, state.params),
      opt_state=keep(opt_state, state.opt_state),
    )

  def _body(self, state, batch):
    lay = self._layout
    state = self._apply_pending(state)
    opts = {k: v for k, v in self.options.items() if k not in ("first_k", "bucket_bytes")}
    vg = value_and_grad(
      self.loss_fn,
      mode="data_parallel",
      axis_name=self.axis_name,
      has_aux=self.has_aux,
      first_k=lay.first_k,
      bucket_bytes=lay.bucket_bytes,
      **opts,
    )
    plan, dyn = vg.plan((state.params, batch), {})
    outs = _dp.emit(plan, dyn, vg.options, defer=frozenset(lay.deferred))
    loss = jax.lax.pmean(outs[0], self.axis_name)
    if self.has_aux:
      aux = _aux_of(plan, outs, self.axis_name, batch)
      loss = (loss, aux)
    g = outs[plan.split.grad_out_start :]
    pending = Pending(
      tuple(g[i][None] for i in lay.deferred), tuple(g[i] for i in lay.ready), jnp.ones((), bool)
    )
    state = state.replace(pending=pending)
    if not self.cross_step:  # apply now: params never lag
      state = self._flush_body(state)
    return state, loss

  def _flush_body(self, state):
    state = self._apply_pending(state)
    pend = state.pending
    zeros = jax.tree.map(jnp.zeros_like, pend)
    return state.replace(pending=zeros.replace(valid=jnp.zeros((), bool)))

  def _build(self, state):
    specs = self._specs(state)
    batch_spec = P(self.axis_name)
    self._step = jax.jit(
      jax.shard_map(
        self._body, mesh=self.mesh, in_specs=(specs, batch_spec), out_specs=(specs, P())
      )
    )
    self._flush = jax.jit(
      jax.shard_map(self._flush_body, mesh=self.mesh, in_specs=(specs,), out_specs=specs)
    )

  def __call__(self, state: DPTrainState, batch) -> tuple[DPTrainState, jax.Array]:
    if self._layout is None:
      raise ValueError("call step.init(params, batch) first: it chooses k and the buckets")
    if self._step is None:
      self._build(state)
    return self._step(state, batch)

  def flush(self, state: DPTrainState) -> DPTrainState:
    """Applies the pending update: `state.params` become those of the plain loop."""
    if self._step is None:
      self._build(state)
    return self._flush(state)


def leafwise(tx: optax.GradientTransformation, params, leaves=None) -> bool:
  """Whether no leaf's update reads the gradient of another of `leaves` (leaf positions;
  None: all): adam, adamw, sgd, momentum and chains of per-leaf transforms update each
  leaf from its own gradient (JAX's DCE on the traced update, as `ooojax.single_gpu`
  checks its deferral). False for global transforms such as `clip_by_global_norm`:
  every update then waits for the whole gradient."""
  sds = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), params)
  closed = jax.make_jaxpr(lambda g, s, p: jax.tree.leaves(tx.update(g, s, p)[0]))(
    sds, jax.eval_shape(tx.init, sds), sds
  )
  n = len(jax.tree.leaves(params))
  if len(closed.jaxpr.outvars) != n:
    return False  # updates not shaped like the parameters: assume coupled
  leaves = frozenset(range(n) if leaves is None else leaves)
  # the other leaves' updates together, then each of `leaves` alone
  for outs in ([i not in leaves for i in range(n)], *([k == i for k in range(n)] for i in leaves)):
    used = _compat.used_inputs(closed, outs)
    if any(used[j] for j in leaves if not (outs[j] and sum(outs) == 1)):
      return False
  return True


def _is_nnx_graphdef(x) -> bool:
  try:
    from flax import nnx
  except ImportError:  # pragma: no cover - flax is a dependency
    return False
  return isinstance(x, nnx.GraphDef)


def _aux_of(plan, outs, axis, batch):
  """The aux outputs, combined over devices as `ooo.value_and_grad` does under a sharded
  jit (`ooojax._dp_gspmd.combine_aux`): per-row leaves gathered, sums summed, means
  averaged."""
  from ooojax import _dp_gspmd

  aux_tree, aux_parts, _, _ = plan.out_tree
  sums = iter(
    _dp_gspmd.sum_outputs(plan.split.jaxpr.jaxpr, 1, plan.n_aux)
    if plan.split.jaxpr is not None
    else ()
  )
  rows = frozenset(b.shape[0] for b in jax.tree.leaves(batch) if getattr(b, "ndim", 0))
  it = iter(outs[1 : 1 + plan.n_aux])
  leaves = [
    _dp_gspmd.combine_aux(next(it), axis, rows, next(sums, False)) if p is None else p[0]
    for p in aux_parts
  ]
  return jax.tree_util.tree_unflatten(aux_tree, leaves)


def make_train_step(
  loss_fn: Callable,
  tx: optax.GradientTransformation | None,
  mesh: jax.sharding.Mesh,
  *,
  axis_name: str = "batch",
  cross_step: bool = True,
  has_aux: bool = False,
  **ooo_options,
) -> DataParallelStep:
  """A jitted data-parallel step over `mesh[axis_name]` with cross-step overlap.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, the mean loss of one device's
      shard (the step's loss is its mean over devices; its gradient is the
      full-batch gradient for equal shards).
    tx: the optax optimizer (None: the `tx` of the flax `TrainState` given to
      `init`).
    mesh: a mesh holding `axis_name`; the batch's leading axis is split over it
      (with `jax.distributed.initialize`, a mesh over every process's devices).
    axis_name: the data-parallel mesh axis.
    cross_step: defer the first-k layers' reduction and the update into the
      next step (False: k = 0 and the update is applied at the end of each
      step, still with early bucketed reductions).
    has_aux: `loss_fn` returns `(loss, aux)`; the step then returns
      `state, (loss, aux)`, aux combined over devices (per-row leaves gathered,
      leaves computed by a sum summed, other float leaves averaged).
    **ooo_options: `reduce`, `bucket_bytes`, `first_k`, `link`, `device`
      (None: chosen by the cost and network model; see `ooo.grad`), `reduce_dtype`
      (opt-in, e.g. `jnp.bfloat16`: every reduction, the carried first-k ones too,
      runs in that dtype; `ooojax.Options`).

  Returns:
    A `DataParallelStep`: `state = step.init(params, batch)`,
    `state, loss = step(state, batch)`, `state = step.flush(state)`.

  >>> import jax, jax.numpy as jnp, numpy as np, optax
  >>> from ooojax import data_parallel as dp
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
  >>> loss = lambda w, b: jnp.mean((b @ w) ** 2)
  >>> step = dp.make_train_step(loss, optax.sgd(0.1), mesh, first_k=1)
  >>> state = step.init(jnp.ones((3, 2)), jnp.ones((4, 3)))
  >>> state, l = step(state, jnp.ones((4, 3)))
  >>> float(l), int(step.flush(state).step)
  (9.0, 1)
  """
  _make_options({"mode": "data_parallel", "axis_name": axis_name, **ooo_options})
  if axis_name not in mesh.shape:
    raise NameError(f"unbound axis name: {axis_name} (the mesh has axes {tuple(mesh.shape)})")
  return DataParallelStep(loss_fn, tx, mesh, axis_name, cross_step, dict(ooo_options), has_aux)
