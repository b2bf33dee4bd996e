"""Single-GPU training steps that leave chosen dW clusters to the next step.

The paper's single-GPU mode runs some weight gradients in the *next*
iteration, beside its forward (DenseNet-121's last dense block): their
parameters are used late in the forward, so the forward has work to hide
them behind. Here:

* step t runs the forward, the dX chain and every other dW cluster (scheduled
  as `ooo.grad` schedules them); for each deferred cluster it stores the
  values the cluster reads (the layer's input activation and output
  cotangent) in `state.pending.local`, and the other gradients in
  `state.pending.ready`;
* step t+1 first runs the deferred clusters on those values (one call on GPU
  stream 1 in `mode="single_gpu"`), and applies the optimizer to step t's
  complete gradient. A parameter whose gradient was complete at the end of
  step t is updated at once; a deferred parameter is updated after
  `Deferral.anchor`, the last sizeable forward conv / matmul before its
  first use, to which the deferred call's result is tied
  (`passes.stream_calls.LateLeaves`). So the deferred dW run beside the forward up
  to that point.

Every forward reads the parameters of the plain synchronous loop
(`params_{t+1} = update(params_t, g_t)`): only the moment of the update
moves, and `state.params` lags one update until `flush(state)`. The pending
values are part of the state, so a checkpoint between steps restores the
same training.

Optimizers: the update of each parameter is one `tx.update` over the whole
tree (so shared state such as Adam's step count advances once per step), and
the parameters used before the anchor are taken from a copy of that update
in which the deferred gradients are zeros. That is exact when no kept
parameter's update reads a deferred gradient, which `init` checks on the
optimizer's own jaxpr (JAX's DCE): every element-wise optax transform passes.
Transforms that read every leaf (`optax.clip_by_global_norm`,
`apply_if_finite`, ...) would make the whole update wait for the deferred dW;
they are refused with an error naming the transform, unless
`coupled="wait"`, which runs them exactly with every update waiting (the
deferral then hides nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from ooojax._api import _make_options, value_and_grad
from ooojax.data_parallel import Pending
from ooojax.passes import _compat, defer as defer_pass
from ooojax.passes.cost import CostModel
from ooojax.passes.emit import emit
from ooojax.passes.stream_calls import LateLeaves, side_call
from ooojax.single_gpu._defer_plan import Plan, plan_deferral

__all__ = ["DeferredTrainState", "Plan", "SingleGPUStep", "make_train_step", "plan_deferral"]


class DeferredTrainState(struct.PyTreeNode):
  """Parameters, optimizer state and the dW work pending from the last step.

  `params` lags one update behind the plain loop while `pending.valid`; use
  `step.flush(state)` for the parameters of the plain loop. `pending.local`
  holds the deferred clusters' inputs, `pending.ready` the other gradients
  (in leaf order).
  """

  step: jax.Array
  params: Any
  opt_state: Any
  pending: Pending


# optax transforms whose update of one leaf reads other leaves (named in errors)
_COUPLING = (
  "clip_by_global_norm",
  "per_example_global_norm_clip",
  "apply_if_finite",
  "scale_by_lbfgs",
  "scale_by_polyak",
  "polyak_sgd",
  "lbfgs",
  "scale_by_backtracking_linesearch",
  "scale_by_zoom_linesearch",
  "normalize_by_update_norm",
  "MultiSteps",
  "skip_not_finite",
  "skip_large_updates",
)


def _transform_names(fn, seen=None) -> list[str]:
  """Names of the optax transforms inside an update function (its closures), best effort."""
  seen = set() if seen is None else seen
  if id(fn) in seen or len(seen) > 500:
    return []
  seen.add(id(fn))
  out = []
  q = getattr(fn, "__qualname__", "") or ""
  if "<locals>" in q:
    out.append(q.split(".<locals>")[0])
  for cell in getattr(fn, "__closure__", None) or ():
    try:
      v = cell.cell_contents
    except ValueError:
      continue
    vs = v if isinstance(v, (tuple, list)) else (v,)
    for x in vs:
      if callable(x):
        out += _transform_names(getattr(x, "update", x), seen)
  return out


def _select(valid, new, old):
  return jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, old)


def _tie(bufs, anchor):
  # twice: XLA's simplifier drops a barrier element whose only user is the
  # barrier (see passes.stream_calls.Anchor.after)
  tied, _ = jax.lax.optimization_barrier((list(bufs), anchor))
  tied, _ = jax.lax.optimization_barrier((tied, anchor))
  return tied


class SingleGPUStep:
  """`state, loss = step(state, batch)` (`state, (loss, aux) = ...` with `has_aux`);
  built by `make_train_step`."""

  def __init__(self, loss_fn, tx, defer, coupled, has_aux, options):
    self.loss_fn, self.tx, self.defer, self.coupled = loss_fn, tx, defer, coupled
    self.has_aux = has_aux
    self.options = options
    self.plan: Plan | None = None
    self._step = self._flush = None

  # --- setup -----------------------------------------------------------------------
  def _vg(self):
    return value_and_grad(self.loss_fn, has_aux=self.has_aux, **self.options)

  def _coupling(self, params, deferred, kept, paths) -> str | None:
    """None if no kept parameter's update reads a deferred gradient, else the first such pair."""
    if not deferred:
      return None
    sds = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), params)
    opt = jax.eval_shape(self.tx.init, sds)

    def upd(g, s, p):
      return jax.tree.leaves(self.tx.update(g, s, p)[0])

    closed = jax.make_jaxpr(upd)(sds, opt, sds)
    n = len(paths)
    used = _compat.used_inputs(closed, [i in set(kept) for i in range(n)])
    if not any(used[i] for i in deferred):
      return None
    for j in kept:
      u = _compat.used_inputs(closed, [i == j for i in range(n)])
      for i in deferred:
        if u[i]:
          return f"the update of {paths[j]} reads the gradient of {paths[i]}"
    return "a kept parameter's update reads a deferred gradient"  # pragma: no cover

  def _plan(self, params, batch) -> Plan:
    vg = self._vg()
    plan = vg.abstract_plan(params, batch)
    cm = CostModel(vg.options.device, vg.options.measured)
    p = plan_deferral(plan, params, self.defer, cm, self.has_aux)
    coupled = self._coupling(params, p.deferred, p.kept, p.paths)
    if coupled is not None and self.coupled != "wait":
      names = [n for n in dict.fromkeys(_transform_names(self.tx.update)) if n in _COUPLING]
      what = f"optax.{names[0]}" if names else "a transform that reads every leaf"
      raise ValueError(
        f"the optimizer couples parameter leaves ({what}): {coupled}, which this step "
        "defers to the next one, so no update could run before the deferred dW and "
        "nothing would overlap the forward. Use defer=() (no deferral), move the "
        "transform out (e.g. optax.clip per leaf instead of clip_by_global_norm), or "
        "pass coupled='wait' (exact: every update waits for the deferred dW)."
      )
    return dataclasses.replace(p, coupled=coupled is not None)

  def init(self, params, batch) -> DeferredTrainState:
    """The first state: nothing pending. `batch` is only traced (shapes)."""
    self.plan = p = self._plan(params, batch)
    self._step = self._flush = None
    leaves = jax.tree.leaves(params)
    local = tuple(jnp.zeros(c.shape, c.dtype) for c in p.carried)
    ready = tuple(jnp.zeros_like(leaves[i]) for i in p.kept)
    return DeferredTrainState(
      jnp.zeros((), jnp.int32),
      params,
      self.tx.init(params),
      Pending(local, ready, jnp.zeros((), bool)),
    )

  def abstract_state(self, params, batch) -> DeferredTrainState:
    """`init`'s state as `jax.ShapeDtypeStruct`s (for `lower` on compile-only devices)."""
    return jax.eval_shape(lambda p: self.init(p, batch), params)

  # --- the step ------------------------------------------------------------------------
  def _update(self, state, grads):
    u, o = self.tx.update(
      jax.tree.unflatten(self.plan.treedef, grads), state.opt_state, state.params
    )
    return jax.tree.leaves(optax.apply_updates(state.params, u)), o

  def _late_grads(self, local, annotate):
    with jax.named_scope("ooo_deferred"):  # names the call in compiled HLO metadata
      if annotate:
        return side_call(self.plan.late, local, stream=1)
      return None, _compat.eval_jaxpr(self.plan.late, [], *local)

  def _body(self, state, batch):
    p, pend = self.plan, state.pending
    valid = pend.valid
    opts = self._vg().options
    annotate = opts.resolved_mode() == "single_gpu"
    pin = annotate and opts.ordering in ("auto", "barriers")
    leaves = jax.tree.leaves(state.params)
    grads = [None] * len(leaves)
    for i, g in zip(p.kept, pend.ready):
      grads[i] = g
    side, dg = self._late_grads(pend.local, annotate) if p.deferred else (None, ())

    def deferred_grads(anchor_out=None):
      if side is None:  # computed inline
        return dg
      return dg(_tie(side, anchor_out) if pin and anchor_out is not None else side)

    def full(dgrads):
      g = list(grads)
      for i, x in zip(p.deferred, dgrads):
        g[i] = x
      return g

    box: dict = {}
    late = None
    if not p.deferred or p.coupled:  # one update, waiting for everything
      early, box["opt"] = self._update(state, full(deferred_grads()))
    else:
      zeros = [jnp.zeros_like(leaves[i]) for i in p.deferred]
      early, _ = self._update(state, full(zeros))  # the kept leaves' values (exact: checked)

      def bind(anchor_out):
        new, box["opt"] = self._update(state, full(deferred_grads(anchor_out)))
        box["late"] = [jnp.where(valid, new[i], leaves[i]) for i in p.deferred]
        return box["late"]

      late = LateLeaves(-1, p.deferred, bind)
    vg = self._vg()
    plan, dyn = vg.plan((state.params, batch), {})
    dfr = defer_pass.defer(plan.split, plan.schedule, p.deferred)
    # shapes and dtypes only: the step's trace may carry the jit's shardings, init's none
    if _shapes(dfr.carried) != _shapes(p.carried):  # pragma: no cover - unlike init's
      raise ValueError("the step traced a different program than init: call init again")
    if late is not None:
      late = dataclasses.replace(late, anchor=dfr.anchor)
    dyn = list(dyn)
    new_params = list(leaves)
    for i in range(len(leaves)):
      if late is not None and i in p.deferred:
        dyn[i] = None
      else:
        dyn[i] = new_params[i] = jnp.where(valid, early[i], leaves[i])
    outs = emit(
      dfr.split,
      dfr.schedule,
      dfr.split.consts,
      dyn,
      ordering=opts.ordering,
      annotate=annotate,
      late=late,
    )
    if late is not None:
      for i, x in zip(p.deferred, box["late"]):
        new_params[i] = x
    gs = dfr.split.grad_out_start
    kept_g = outs[gs : gs + len(p.kept)]
    carried = outs[gs + len(p.kept) :]
    state = state.replace(
      step=state.step + valid.astype(state.step.dtype),
      params=jax.tree.unflatten(p.treedef, new_params),
      opt_state=_select(valid, box["opt"], state.opt_state),
      pending=Pending(tuple(carried), tuple(kept_g), jnp.ones((), bool)),
    )
    if not self.has_aux:
      return state, outs[0]
    aux_tree, aux_parts = plan.out_tree[:2]
    it = iter(outs[1:gs])  # traced aux leaves; Python values as the trace made them
    aux = jax.tree_util.tree_unflatten(
      aux_tree, [next(it) if q is None else q[0] for q in aux_parts]
    )
    return state, (outs[0], aux)

  def _flush_body(self, state):
    p, pend = self.plan, state.pending
    leaves = jax.tree.leaves(state.params)
    g = [None] * len(leaves)
    for i, x in zip(p.kept, pend.ready):
      g[i] = x
    if p.deferred:
      for i, x in zip(p.deferred, _compat.eval_jaxpr(p.late, [], *pend.local)):
        g[i] = x
    new, opt = self._update(state, g)
    valid = pend.valid
    zeros = jax.tree.map(jnp.zeros_like, pend)
    return state.replace(
      step=state.step + valid.astype(state.step.dtype),
      params=_select(valid, jax.tree.unflatten(p.treedef, new), state.params),
      opt_state=_select(valid, opt, state.opt_state),
      pending=zeros.replace(valid=jnp.zeros((), bool)),
    )

  def _build(self):
    if self.plan is None:
      raise ValueError("call step.init(params, batch) first: it chooses the deferred dW")
    if self._step is None:
      self._step = jax.jit(self._body)
      self._flush = jax.jit(self._flush_body)

  def __call__(self, state: DeferredTrainState, batch) -> tuple[DeferredTrainState, Any]:
    self._build()
    return self._step(state, batch)

  def flush(self, state: DeferredTrainState) -> DeferredTrainState:
    """Runs the pending dW and applies the pending update: the plain loop's parameters."""
    self._build()
    return self._flush(state)

  def lower(self, state, batch):
    """`jax.jit(step).lower(state, batch)` (state may be `abstract_state`'s)."""
    self._build()
    return self._step.lower(state, batch)

  @property
  def jitted(self) -> Callable:
    """The jitted `(state, batch) -> (state, loss)` (e.g. for `ooojax.gpu_hlo.schedule`)."""
    self._build()
    return self._step


def make_train_step(
  loss_fn: Callable,
  tx: optax.GradientTransformation,
  *,
  defer: str | Sequence[str] | Callable[[str], bool] | None = "auto",
  coupled: str = "error",
  has_aux: bool = False,
  **ooo_options,
) -> SingleGPUStep:
  """A jitted single-GPU train step whose chosen dW clusters run in the next step.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, or `(scalar, aux)` with `has_aux`.
    tx: any optax optimizer (see the module docstring for transforms that
      read every leaf).
    defer: which parameters' dW run in the next step: "auto" (the cost model
      picks clusters that shorten the simulated steady-state step;
      `ooo_options["device"]` names the device spec), parameter path
      substrings (e.g. `("Dense_2",)`, matched against
      `jax.tree_util.keystr` paths), a predicate on paths, or `()` (none).
    coupled: "error" (default) refuses an optimizer whose kept parameters'
      update reads a deferred gradient; "wait" runs it exactly, every update
      waiting for the deferred dW.
    has_aux: `loss_fn` returns `(loss, aux)`; the step then returns
      `(state, (loss, aux))`, as `jax.value_and_grad(has_aux=True)` returns
      its value. aux comes from step t's forward, which reads the plain
      loop's parameters, so flax mutable collections (BatchNorm's
      `batch_stats`) are exact: pass them in `batch` and take the updated
      ones from aux (see docs/single-gpu.md).
    **ooo_options: options of `ooo.grad` (`mode`, `device`, `ordering`, ...;
      not data_parallel).

  Returns:
    A `SingleGPUStep`: `state = step.init(params, batch)`,
    `state, loss = step(state, batch)`, `state = step.flush(state)`;
    `step.plan` says what is deferred and the simulated effect.

  >>> import jax.numpy as jnp, optax
  >>> from ooojax import single_gpu
  >>> def loss(p, x):
  ...   return jnp.mean((jnp.tanh(x @ p["a"]) @ p["b"]) ** 2)
  >>> step = single_gpu.make_train_step(loss, optax.adam(0.1), defer=("b",))
  >>> state = step.init({"a": jnp.ones((3, 4)), "b": jnp.ones((4, 2))}, jnp.ones((8, 3)))
  >>> step.plan.deferred_paths
  ("['b']",)
  >>> state, l = step(state, jnp.ones((8, 3)))
  >>> int(step.flush(state).step)
  1
  """
  opts = _make_options(ooo_options)
  if opts.mode == "data_parallel":
    raise ValueError(
      "single_gpu.make_train_step runs on one device; for data parallel "
      "use ooojax.data_parallel.make_train_step"
    )
  if coupled not in ("error", "wait"):
    raise ValueError(f"coupled must be 'error' or 'wait', got {coupled!r}")
  if not (defer is None or callable(defer) or isinstance(defer, (str, tuple, list))):
    raise TypeError(f"defer must be 'auto', path strings, a predicate or (), got {defer!r}")
  if not isinstance(has_aux, bool):
    raise TypeError(f"has_aux must be a bool, got {has_aux!r}")
  return SingleGPUStep(loss_fn, tx, defer, coupled, has_aux, dict(ooo_options))


def _shapes(avals) -> tuple:
  return tuple((tuple(a.shape), a.dtype) for a in avals)
