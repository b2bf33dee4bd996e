"""`ooo.grad` / `ooo.value_and_grad`: drop-ins for `jax.grad` / `jax.value_and_grad`."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from passes import _compat
from passes.cost import CostModel, DeviceSpec
from passes.emit import ORDERINGS, emit
from passes.ir import Schedule, Split
from passes.schedule import schedule as make_schedule
from passes.split import split as make_split

MODES = ("auto", "single_gpu", "in_order")


@dataclasses.dataclass(frozen=True)
class Options:
  """Keyword options shared by `grad`, `value_and_grad` and `explain`.

  mode: "auto" (single_gpu on a GPU backend, in_order elsewhere),
    "single_gpu" (dW clusters on a second stream), or "in_order" (split and
    re-emit on one stream, no annotations: the control to compare against).
  streams: 1 or 2 compute streams.
  device: device spec name for the cost model ("V100", "A100", "H100",
    "CPU") or a `passes.cost.DeviceSpec`; None guesses from `jax.devices()`.
  ordering: how the chosen order is pinned in XLA: "auto", "control_deps",
    "scheduling_group" or "none" (see `passes.emit`).
  measured: unit label -> seconds, replacing cost-model estimates; labels are
    "forward", "X<i>" (dX segment i) and parameter paths (dW clusters), as
    returned by `ooo.calibrate`.
  """
  mode: str = "auto"
  streams: int = 2
  device: str | DeviceSpec | None = None
  ordering: str = "auto"
  measured: Mapping[str, float] | None = None

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"unknown mode {self.mode!r}; allowed: {MODES}")
    if self.streams not in (1, 2):
      raise ValueError(f"streams must be 1 or 2, got {self.streams!r}")
    if self.ordering != "auto" and self.ordering not in ORDERINGS:
      raise ValueError(f"unknown ordering {self.ordering!r}; allowed: "
                       f"{('auto',) + ORDERINGS}")

  def resolved_mode(self) -> str:
    if self.mode != "auto":
      return self.mode
    # CPUs have no streams, and on XLA:CPU an annotated call keeps its convs
    # out of layout assignment (measured ~9x slower steps): see RESULTS.md.
    return "single_gpu" if jax.default_backend() == "gpu" else "in_order"

  def resolved_ordering(self) -> str:
    if self.ordering != "auto":
      return self.ordering
    # control_dep becomes control edges only in the CPU compiler's
    # control-dep-rewriter; on GPU it fails to compile, so GPU relies on the
    # stream assignment alone.
    return "control_deps" if jax.default_backend() == "cpu" else "none"

  def key(self):
    m = tuple(sorted(self.measured.items())) if self.measured else None
    return (self.mode, self.streams, self.device, self.ordering, m)


_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options))


def _make_options(kwargs: dict) -> Options:
  bad = sorted(set(kwargs) - set(_OPTION_NAMES))
  if bad:
    raise ValueError(f"unknown option(s) {bad}; allowed: {list(_OPTION_NAMES)}")
  return Options(**kwargs)


def _is_dynamic(x) -> bool:
  # Arrays are traced; everything else (Python scalars, strings, modules) is
  # closed over as jax.grad closes over non-differentiated arguments.
  # ShapeDtypeStructs too: `explain` and AOT lowering need shapes only.
  return (isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))
          or _compat.is_tracer(x))


_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes)


def _value_hashable(x) -> bool:
  """True for statics whose hash and equality are by value, so a cache hit is safe."""
  if isinstance(x, tuple):
    return all(_value_hashable(y) for y in x)
  return isinstance(x, _VALUE_TYPES) or isinstance(x, (np.dtype, type))


def _aval_key(x) -> tuple:
  """(shape, dtype, weak_type) without converting x (PRNG keys can't be)."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    weak = bool(getattr(getattr(x, "aval", None), "weak_type", False))
    return tuple(x.shape), x.dtype, weak
  return (), jax.numpy.result_type(x), isinstance(x, (int, float, complex))


@dataclasses.dataclass(frozen=True)
class _Plan:
  split: Split
  schedule: Schedule
  out_tree: Any
  n_aux: int


class _Transformed:
  """The callable `ooo.value_and_grad(fun, ...)` returns."""

  def __init__(self, fun, argnums, has_aux, holomorphic, allow_int, options):
    self.fun = fun
    self.argnums = argnums
    self.has_aux = has_aux
    self.holomorphic = holomorphic
    self.allow_int = allow_int
    self.options = options
    self._cache: dict = {}
    functools.update_wrapper(self, fun)

  # --- tracing -----------------------------------------------------------------
  def plan(self, args, kwargs) -> tuple[_Plan, list]:
    argnums = self.argnums
    idx = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    max_arg = max(idx) if idx else -1
    if max_arg >= len(args):
      raise TypeError(f"differentiating with respect to argnums={argnums} requires "
                      f"at least {max_arg + 1} positional arguments to be passed "
                      f"by the caller, but got only {len(args)} positional arguments.")
    diff = tuple(args[i] for i in idx)
    diff_leaves, diff_tree = jax.tree_util.tree_flatten(diff)
    for leaf in diff_leaves:
      _compat.check_input_dtype_grad(self.holomorphic, self.allow_int, leaf)
    rest = tuple(None if i in idx else a for i, a in enumerate(args))
    rest_leaves, rest_tree = jax.tree_util.tree_flatten((rest, kwargs))
    dyn_mask = tuple(_is_dynamic(x) for x in rest_leaves)
    statics = tuple(x for x, d in zip(rest_leaves, dyn_mask) if not d)
    dyn = [*diff_leaves, *(x for x, d in zip(rest_leaves, dyn_mask) if d)]
    avals = tuple(_aval_key(x) for x in dyn)
    key = (diff_tree, rest_tree, dyn_mask, avals, self.options.key(),
           jax.config.jax_enable_x64)
    if all(_value_hashable(s) for s in statics):
      key = key + (tuple((type(s), s) for s in statics),)  # 1.0 == True, but not alike
    else:
      key = None  # an object hashed by identity may change inside: re-trace
    cached = self._cache.get(key) if key is not None else None
    if cached is not None:
      return cached, dyn

    n_diff = len(diff_leaves)
    fun, has_aux = self.fun, self.has_aux
    holomorphic, allow_int = self.holomorphic, self.allow_int
    cell: dict = {}

    def flat_fun(ct, *leaves):
      diff_vals = jax.tree_util.tree_unflatten(diff_tree, leaves[:n_diff])
      it_dyn, it_static = iter(leaves[n_diff:]), iter(statics)
      rest_vals = [next(it_dyn) if d else next(it_static) for d in dyn_mask]
      rest_args, kw = jax.tree_util.tree_unflatten(rest_tree, rest_vals)

      def f_partial(*dargs):
        full = list(rest_args)
        for i, a in zip(idx, dargs):
          full[i] = a
        return fun(*full, **kw)

      out = jax.vjp(f_partial, *diff_vals, has_aux=has_aux)
      ans, vjp_fn = out[0], out[1]
      aux = out[2] if has_aux else None
      _compat.check_scalar(ans)
      jax.tree_util.tree_map(functools.partial(_compat.check_output_dtype_grad,
                                               holomorphic), ans)
      g = vjp_fn(ct.astype(jax.numpy.result_type(ans)))
      g = g[0] if isinstance(argnums, int) else g
      aux_leaves, aux_tree = jax.tree_util.tree_flatten(aux)
      g_leaves, g_tree = jax.tree_util.tree_flatten(g)
      cell["trees"] = (aux_tree, g_tree, len(aux_leaves))
      return [ans, *aux_leaves, *g_leaves]

    in_avals = [jax.ShapeDtypeStruct((), jax.numpy.float32)]
    for x, (shape, dtype, weak) in zip(dyn, avals):
      in_avals.append(jax.ShapeDtypeStruct(shape, dtype, weak_type=weak))
    names = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(diff if not isinstance(argnums, int) else diff[0])[0]]
    sp = make_split(flat_fun, in_avals, n_diff, names)
    opts = self.options
    streams = 1 if opts.resolved_mode() == "in_order" else opts.streams
    sched = make_schedule(sp, CostModel(opts.device, opts.measured), streams)
    plan = _Plan(sp, sched, cell["trees"], cell["trees"][2])
    # A captured array (a global, or one held by an argument object) would be
    # frozen into a cached trace: keep those traces uncached, never stale.
    if key is not None and not sp.consts:
      self._cache[key] = plan
    return plan, dyn

  def __call__(self, *args, **kwargs):
    plan, dyn = self.plan(args, kwargs)
    opts = self.options
    annotate = opts.resolved_mode() == "single_gpu"
    ordering = opts.resolved_ordering()
    outs = emit(plan.split, plan.schedule, plan.split.consts, dyn,
                ordering=ordering, annotate=annotate)
    aux_tree, g_tree, n_aux = plan.out_tree
    ans = outs[0]
    aux = jax.tree_util.tree_unflatten(aux_tree, outs[1:1 + n_aux])
    g = jax.tree_util.tree_unflatten(g_tree, outs[1 + n_aux:])
    return ((ans, aux) if self.has_aux else ans), g


def _check_argnums(argnums):
  if isinstance(argnums, (int, np.integer)) and not isinstance(argnums, bool):
    return int(argnums)
  if isinstance(argnums, Sequence) and all(
      isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in argnums):
    return tuple(int(a) for a in argnums)
  raise TypeError(f"argnums must be an int or a tuple of ints, got {argnums!r}")


def value_and_grad(fun: Callable | None = None, argnums: int | Sequence[int] = 0,
                   has_aux: bool = False, holomorphic: bool = False,
                   allow_int: bool = False, **options) -> Callable:
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
    return lambda f: value_and_grad(f, argnums, has_aux, holomorphic, allow_int,
                                    **options)
  if not callable(fun):
    raise TypeError(f"Expected a callable value, got {fun!r}")
  argnums = _check_argnums(argnums)
  return _Transformed(fun, argnums, has_aux, holomorphic, allow_int, opts)


def grad(fun: Callable | None = None, argnums: int | Sequence[int] = 0,
         has_aux: bool = False, holomorphic: bool = False,
         allow_int: bool = False, **options) -> Callable:
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
