"""`ooo.grad` / `ooo.value_and_grad`: drop-ins for `jax.grad` / `jax.value_and_grad`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ooojax import _dp, _dp_gspmd, _filter
from ooojax._args import _check_argnums, _is_dynamic, _resolve_argnums
from ooojax._options import (  # noqa: F401 - re-exported
  _OPTION_NAMES,
  AUTO_MIN_SPEEDUP,
  AUTO_MODE,
  FSDP,
  MODES,
  Options,
  _make_options,
)
from ooojax.passes import _compat
from ooojax.passes.collectives.regather import regathered
from ooojax.passes.cost import CostModel
from ooojax.passes.emit import emit
from ooojax.passes.fingerprint import fingerprint
from ooojax.passes.ir import Schedule, Split
from ooojax.passes.schedule import schedule as make_schedule
from ooojax.passes.split import from_flat, inline_calls, rewrite


def _aval(x, typed: bool = True) -> jax.ShapeDtypeStruct:
  """x's abstract value, weak type included, without converting x (PRNG keys can't be).

  `typed=False` leaves out a tracer's varying mesh axes (`_dp.traced`'s fallback).
  """
  if typed and _compat.is_tracer(x):
    # its own type, varying mesh axes included: under shard_map(check_vma=True)
    # AD then sums an invariant input's gradient over the axes, as jax.grad does
    return _compat.shape_dtype(jax.typeof(x))
  if isinstance(x, jax.Array) and typed:
    # a committed array's type: under explicit mesh axes its sharding is part of
    # it (what `jax.typeof(x).sharding` reads in the loss)
    return _compat.shape_dtype(jax.typeof(x))
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    weak = bool(getattr(getattr(x, "aval", x), "weak_type", False))  # arrays, ShapeDtypeStructs
    sharding = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, weak_type=weak, sharding=sharding)
  return jax.ShapeDtypeStruct(
    (), jax.numpy.result_type(x), weak_type=isinstance(x, (int, float, complex))
  )


class _Static:
  """Stands for a static leaf in the traced argument tree: an empty pytree node,
  so the dynamic leaves keep the key paths (and debug names) of the user's call."""

  __slots__ = ("i",)

  def __init__(self, i):
    self.i = i


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.i), lambda i, _: _Static(i))
_is_static = lambda x: isinstance(x, _Static)  # noqa: E731


def _fun_name(fun) -> str:
  f = fun
  while isinstance(f, functools.partial):
    f = f.func
  return getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or repr(f)


def _describe(x) -> str:
  """A value's type without tracer reprs, e.g. `(float32[], float32[3])`."""

  class _T(str):
    __repr__ = str.__str__

  def one(y):
    try:
      return _T(jax.typeof(y).str_short())
    except TypeError:
      return _T(type(y).__name__)

  return repr(jax.tree_util.tree_map(one, x))


_CONTROL_FLOW_NOTE = (
  "ooo.grad traces {name} once per call with abstract values (as jax.jit does) "
  "so that it can split and schedule the backward pass; Python control flow or "
  "conversions on the value of a differentiated or array argument cannot run there, "
  "although eager jax.grad runs them. Use jax.lax.cond / jnp.where / lax.select for "
  "value-dependent branches, pass the value as a non-array Python argument (it is "
  "then a static), or use jax.grad for this function."
)


@dataclasses.dataclass(frozen=True)
class _Plan:
  split: Split
  schedule: Schedule
  out_tree: Any  # (aux_tree, aux_parts, g_tree, g_parts): see `_Transformed._trace`
  n_aux: int  # traced aux leaves among the outputs
  collectives: Any = None  # passes.collectives.plan.CollectivePlan (data_parallel)


_PLAN_CACHE_SIZE = 8


class _Transformed:
  """The callable `ooo.value_and_grad(fun, ...)` returns.

  Every call traces `fun` afresh (like eager `jax.grad`, so Python state read by
  `fun` is never stale). Only the split's classification and the schedule, which
  depend on the program's structure alone, are reused: when the new trace's
  `passes.fingerprint` equals a cached one's.
  """

  def __init__(self, fun, argnums, has_aux, holomorphic, allow_int, options, filter=False):
    self.fun = fun
    # differentiate the inexact array leaves only, as eqx.filter_value_and_grad
    # (ooojax.equinox); an argument holding an eqx.Module is filtered regardless
    self.filter = filter
    self.argnums = argnums
    self.has_aux = has_aux
    self.holomorphic = holomorphic
    self.allow_int = allow_int
    self.options = options
    self._cache: collections.OrderedDict = collections.OrderedDict()  # fingerprint -> plan
    self._pending: tuple | None = None  # (key, weakref to the flat jaxpr, plan)
    # data_parallel inside a sharded jit (`ooojax._dp_gspmd`): the bound copies by axis,
    # and, while one runs in its shard_map, the gradient leaves it reduce-scatters
    self._bound: dict = {}
    self._scatter: dict = {}
    self._gather: dict = {}  # id(gathered leaf) -> (shard, dim): ZeRO-3 (`_dp_gspmd`)
    self._aux_sums: list | None = None  # per aux leaf: computed last by a sum (to psum)
    # (aux_parts, value and traced aux leaves) -> them combined over the data axis
    # (`_dp_gspmd`): the emitter runs it ahead of the first bucket
    self._early = None
    functools.update_wrapper(self, fun)

  # --- tracing -----------------------------------------------------------------
  def _trace(self, args, kwargs, vary=None, typed: bool = True):
    """Traces forward + vjp; returns (closed jaxpr, dynamic leaves, output layout, diff args).

    `vary`: a data-parallel axis the dynamic leaves are made to vary over (`_dp.traced`);
    `typed=False`: traced without the leaves' varying mesh axes.
    """
    idx = _resolve_argnums(self.argnums, len(args))
    fun, has_aux, holomorphic = self.fun, self.has_aux, self.holomorphic
    dyn: list = []
    statics: list = []

    def mark(x, diff):
      if diff or _is_dynamic(x):
        vma = None
        if vary is not None:  # data_parallel: trace the per-device gradient, vma-typed
          x, vma = _dp.varying_leaf(x, vary)
        dyn.append(x)
        return _aval(x, typed) if vma is None else vma
      statics.append(x)
      return _Static(len(statics) - 1)

    marked_args = []
    # per filtered argument (an Equinox module, or under ooojax.equinox): its
    # treedef and which leaves are differentiated (the inexact arrays)
    kept: dict[int, tuple] = {}
    for i, a in enumerate(args):
      diff = i in idx
      leaves, tree = jax.tree_util.tree_flatten(a)
      if diff and (self.filter or _filter.holds_module(a)):
        keep = tuple(_filter.is_inexact_array(x) for x in leaves)
        kept[i] = (tree, keep)
        marked_args.append(
          jax.tree_util.tree_unflatten(tree, [mark(x, k) for x, k in zip(leaves, keep)])
        )
        continue
      if diff:
        _filter.check_leaves(a, i, len(idx), holomorphic, self.allow_int)
      marked_args.append(jax.tree_util.tree_unflatten(tree, [mark(x, diff) for x in leaves]))
    # kwargs are flattened in sorted-key order, as make_jaxpr flattens them
    marked_kwargs = {
      k: jax.tree_util.tree_map(lambda x: mark(x, False), kwargs[k]) for k in sorted(kwargs)
    }
    name = _fun_name(fun)
    cell: dict = {}

    def traced(ct, *t_args, **t_kwargs):
      t_args, t_kwargs = jax.tree_util.tree_map(
        lambda x: statics[x.i] if isinstance(x, _Static) else x,
        (t_args, t_kwargs),
        is_leaf=_is_static,
      )

      def f_partial(*dargs):
        full = list(t_args)
        for i, d in zip(idx, dargs):
          # a filtered argument: its differentiated leaves put back among the static ones
          full[i] = _filter.merged(d, t_args[i], *kept[i]) if i in kept else d
        out = fun(*full, **t_kwargs)
        if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
          raise TypeError(
            "expected function with aux output to return a two-element "
            f"tuple, but {name} returned {_describe(out)}"
          )
        return out

      primals = [_filter.leaves_of(t_args[i], *kept[i]) if i in kept else t_args[i] for i in idx]
      out = jax.vjp(f_partial, *primals, has_aux=has_aux)
      ans, vjp_fn = out[0], out[1]
      aux = out[2] if has_aux else None
      if (
        isinstance(ans, (tuple, list, dict))
        or not hasattr(ans, "shape")
        and not isinstance(ans, (int, float, complex))
      ):
        raise TypeError(
          "Gradient only defined for scalar-output functions. Output was "
          f"{_describe(ans)} from {name}"
          + (
            "; with several outputs, pass has_aux=True and return (loss, aux)"
            if not has_aux
            else ""
          )
        )
      _compat.check_scalar(ans)
      _compat.check_output_dtype_grad(holomorphic, ans)
      a_aval = jax.typeof(ans)
      ct_ = _compat.convert_element_type(ct, a_aval.dtype, a_aval.weak_type)
      g = vjp_fn(_compat.like_varying(ct_, ans))  # a varying loss takes a varying cotangent
      # a filtered argument's gradient: its tree, None at the static leaves (as Equinox's)
      g = tuple(_filter.unfiltered(gi, *kept[i]) if i in kept else gi for i, gi in zip(idx, g))
      g = g[0] if isinstance(self.argnums, int) else g
      # Only traced leaves are outputs of the jaxpr; Python values (an int or
      # str aux, float0 zeros) come back as the trace produced them.
      aux_leaves, aux_tree = jax.tree_util.tree_flatten(aux)
      g_leaves, g_tree = jax.tree_util.tree_flatten(g)
      aux_parts = tuple(None if _compat.is_tracer(x) else (x,) for x in aux_leaves)
      g_parts = tuple(None if _compat.is_tracer(x) else (x,) for x in g_leaves)
      cell["layout"] = (aux_tree, aux_parts, g_tree, g_parts)
      return [
        ans,
        *(x for x in aux_leaves if _compat.is_tracer(x)),
        *(x for x in g_leaves if _compat.is_tracer(x)),
      ]

    traced.__name__ = getattr(fun, "__name__", "fun")
    traced.__qualname__ = name
    traced.__wrapped__ = fun  # debug info (error messages) names the user's function
    try:
      sig = inspect.signature(fun)
      ct_param = inspect.Parameter("_ooo_cotangent", inspect.Parameter.POSITIONAL_ONLY)
      traced.__signature__ = sig.replace(parameters=[ct_param, *sig.parameters.values()])
    except (TypeError, ValueError):  # no signature: jax falls back to args[i] names
      traced.__signature__ = inspect.Signature(
        [
          inspect.Parameter("_ooo_cotangent", inspect.Parameter.POSITIONAL_ONLY),
          inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
          inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
        ]
      )
    ct_aval = jax.ShapeDtypeStruct((), jax.numpy.float32)
    try:
      closed = jax.make_jaxpr(traced)(ct_aval, *marked_args, **marked_kwargs)
    except _compat.TRACER_VALUE_ERRORS as e:
      e.add_note(_CONTROL_FLOW_NOTE.format(name=name))
      raise
    diff = tuple(
      _filter.unfiltered(_filter.leaves_of(args[i], *kept[i]), *kept[i]) if i in kept else args[i]
      for i in idx
    )
    return closed, dyn, cell["layout"], diff

  def plan(self, args, kwargs) -> tuple[_Plan, list]:
    # Tracing runs with the GC on: JAX's tracing leaves cyclic garbage
    # (about 14% more peak memory on a GPT-2-width LM if kept until the end).
    closed, dyn, layout, diff = _dp.traced(self._trace, self.options, args, kwargs)
    with _gc_paused():
      return self._plan_traced(closed, dyn, layout, diff)

  def abstract_plan(self, *args) -> _Plan:
    """The plan for arguments given by shape (arrays or `jax.ShapeDtypeStruct`s):
    traced under `jax.eval_shape`, nothing runs."""
    box = {}
    # only the array leaves go through eval_shape; a module's static fields (an
    # Equinox activation function, a Python float) stay as they are, as in a call
    leaves, tree = jax.tree_util.tree_flatten(args)
    at = [k for k, x in enumerate(leaves) if _is_dynamic(x)]

    def trace(*dyn):
      full = list(leaves)
      for k, x in zip(at, dyn):
        full[k] = x
      box["plan"], _ = self.plan(tuple(jax.tree_util.tree_unflatten(tree, full)), {})
      return 0.0

    jax.eval_shape(trace, *[leaves[k] for k in at])
    return box["plan"]

  def _plan_traced(self, closed, dyn, layout, diff) -> tuple[_Plan, list]:
    aux_tree, aux_parts, g_tree, g_parts = layout
    n_aux = sum(p is None for p in aux_parts)
    n_grads = sum(p is None for p in g_parts)
    stats: dict = {}
    flat, consts = inline_calls(closed, stats)
    opts = self.options
    if self._gather:  # ZeRO-3: the shards in, each gathered where it is used
      flat, dyn = regathered(flat, len(consts), dyn, self._gather, opts.axis_name)
    # g_tree (its key paths name the clusters) and which grads are traced
    key = (n_aux, g_tree, tuple(p is None for p in g_parts), opts.key(), _dp.axis_size(opts))
    hit, fp = self._lookup(key, flat)
    if hit is not None:
      # the same deterministic rewrite (scan split) the cached split went through
      sp = dataclasses.replace(
        hit.split, jaxpr=rewrite(flat), consts=tuple(consts), inlined=stats.get("inlined", 0)
      )
      sched, coll = hit.schedule, hit.collectives
    else:
      tree = diff[0] if isinstance(self.argnums, int) else diff
      names = [
        jax.tree_util.keystr(p)
        for (p, _), part in zip(jax.tree_util.tree_flatten_with_path(tree)[0], g_parts)
        if part is None
      ]
      sp = from_flat(flat, consts, n_grads, names, stats.get("inlined", 0))
      streams = 1 if opts.resolved_mode() in ("in_order", "data_parallel") else opts.streams
      cm = CostModel(opts.device, opts.measured)
      sched = make_schedule(sp, cm, streams, opts.min_speedup())
      coll = (
        _dp.plan(sp, sched, cm, opts, loss=self._early is not None)
        if opts.mode == "data_parallel"
        else None
      )
    plan = _Plan(sp, sched, layout, n_aux, coll)
    if hit is None:
      # Cached without the program: consts may be large arrays or an outer
      # trace's tracers, and the jaxpr would stay alive through lowering.
      kept = _Plan(dataclasses.replace(sp, jaxpr=None, consts=()), sched, None, n_aux, coll)
      if fp is None:
        self._pending = (key, weakref.ref(flat.jaxpr), kept)
      else:
        self._store(fp, kept)
    return plan, dyn

  def _store(self, fp, plan) -> None:
    self._cache[fp] = plan
    while len(self._cache) > _PLAN_CACHE_SIZE:
      self._cache.popitem(last=False)

  def _lookup(self, key, flat) -> tuple[_Plan | None, Any]:
    """(a cached plan for a structurally identical program or None, its fingerprint).

    The first plan is kept unfingerprinted and its jaxpr only weakly (a
    function traced once, e.g. under `jax.jit`, pays neither time nor memory);
    the second trace is fingerprinted, and the first too if still alive.
    """
    if self._pending is None and not self._cache:
      return None, None
    if self._pending is not None:
      p_key, p_ref, p_plan = self._pending
      self._pending = None
      p_jaxpr = p_ref()
      if p_jaxpr is not None:
        self._store((p_key, fingerprint(p_jaxpr)), p_plan)
    fp = (key, fingerprint(flat.jaxpr))
    hit = self._cache.get(fp)
    if hit is not None:
      self._cache.move_to_end(fp)
    return hit, fp

  def __call__(self, *args, **kwargs):
    if _dp_gspmd.unbound(self.options):
      return _dp_gspmd.call(self, args, kwargs)
    traced = [_dp.traced(self._trace, self.options, args, kwargs)]
    with _gc_paused():  # one pause for the passes and emission
      return self._call(traced)

  def _call(self, traced: list):
    # popped: nothing here keeps the traced program, which emission frees as it goes
    plan, dyn = self._plan_traced(*traced.pop())
    if self._pending is not None and self._pending[1]() is plan.split.jaxpr.jaxpr:
      # emission consumes this jaxpr (below): it must never be fingerprinted,
      # even if a reference cycle keeps it alive until the next call
      self._pending = None
    opts = self.options
    annotate = opts.resolved_mode() == "single_gpu"
    ordering = opts.resolved_ordering()
    if self._aux_sums is not None:
      self._aux_sums.extend(_dp_gspmd.sum_outputs(plan.split.jaxpr.jaxpr, 1, plan.n_aux))
    with _gc_paused():
      if plan.collectives is not None:
        early = self._early and functools.partial(self._early, plan.out_tree[1])
        outs = _dp.emit(plan, dyn, opts, consume=True, scatter=self._scatter, early=early)
      else:
        # the split was traced for this call alone: emission may consume it
        outs = emit(
          plan.split,
          plan.schedule,
          plan.split.consts,
          dyn,
          ordering=ordering,
          annotate=annotate,
          consume=True,
        )
    aux_tree, aux_parts, g_tree, g_parts = plan.out_tree
    ans = outs[0]
    it = iter(outs[1:])
    aux = jax.tree_util.tree_unflatten(
      aux_tree, [next(it) if p is None else p[0] for p in aux_parts]
    )
    g = jax.tree_util.tree_unflatten(g_tree, [next(it) if p is None else p[0] for p in g_parts])
    return ((ans, aux) if self.has_aux else ans), g


@contextlib.contextmanager
def _gc_paused():
  """Pauses Python's cyclic GC while ooojax's passes run over a traced program.

  They allocate many short-lived, acyclic objects; each allocation burst
  triggers collections that walk the whole live program (the traced jaxpr and
  the one being built) and free nothing: about 45% of the emitter's time on a
  GPT-2-width LM. Reference counting still frees everything as usual.
  """
  if not gc.isenabled():
    yield
    return
  gc.disable()
  try:
    yield
  finally:
    gc.enable()


def value_and_grad(
  fun: Callable | None = None,
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
  holomorphic: bool = False,
  allow_int: bool = False,
  **options,
) -> Callable:
  """Like `jax.value_and_grad`, with the backward pass split and scheduled.

  Takes `jax.value_and_grad`'s arguments plus the keyword options of
  `ooojax.Options`. Called without `fun`, returns a decorator.

  >>> import jax.numpy as jnp, ooojax as ooo
  >>> v, g = ooo.value_and_grad(lambda w: jnp.sum(w ** 2))(jnp.ones(3))
  >>> float(v), g.tolist()
  (3.0, [2.0, 2.0, 2.0])
  """
  opts = _make_options(options)
  if fun is None:
    return lambda f: value_and_grad(f, argnums, has_aux, holomorphic, allow_int, **options)
  if not callable(fun):
    raise TypeError(f"Expected a callable value, got {fun!r}")
  argnums = _check_argnums(argnums)
  return _Transformed(fun, argnums, has_aux, holomorphic, allow_int, opts)


def grad(
  fun: Callable | None = None,
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
  holomorphic: bool = False,
  allow_int: bool = False,
  **options,
) -> Callable:
  """Like `jax.grad`, with the backward pass split and scheduled.

  >>> import jax.numpy as jnp, ooojax as ooo
  >>> ooo.grad(lambda w: jnp.sum(w ** 2))(jnp.arange(3.0)).tolist()
  [0.0, 2.0, 4.0]
  """
  if fun is None:
    _make_options(options)
    return lambda f: grad(f, argnums, has_aux, holomorphic, allow_int, **options)
  vg = value_and_grad(fun, argnums, has_aux, holomorphic, allow_int, **options)

  @functools.wraps(fun)
  def grad_f(*args, **kwargs):
    out, g = vg(*args, **kwargs)
    return (g, out[1]) if has_aux else g

  grad_f._ooo = vg  # explain() and tests reach the plan through this
  return grad_f
