"""Every private JAX import ooojax needs, in one place.

A JAX upgrade that moves or renames one of these touches this file only. Each
name has a fallback or a clear error, so an unknown JAX fails loudly here rather
than deep inside a pass.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
from jax.extend import core as jex_core

Literal = jex_core.Literal
Var = jex_core.Var
Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
DropVar = jex_core.DropVar

try:  # jax >= 0.4.3x
  from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover - future JAX
  _siu = None

try:
  from jax._src.api import (
      _check_scalar as check_scalar,
      _check_input_dtype_grad as check_input_dtype_grad,
      _check_output_dtype_grad as check_output_dtype_grad,
  )
except ImportError:  # pragma: no cover - future JAX moved them; keep JAX's wording
  import numpy as _np

  def check_scalar(x):
    shape = jax.numpy.shape(x)
    if shape != ():
      raise TypeError("Gradient only defined for scalar-output functions. "
                      f"Output had shape: {shape}.")

  def check_input_dtype_grad(holomorphic, allow_int, x):
    dt = jax.numpy.result_type(x)
    if not allow_int and not jax.numpy.issubdtype(dt, _np.inexact):
      raise TypeError("grad requires real- or complex-valued inputs (input dtype "
                      f"that is a sub-dtype of np.inexact), but got {dt.name}. "
                      "If you want to use Boolean- or integer-valued inputs, "
                      "use vjp or set allow_int to True.")

  def check_output_dtype_grad(holomorphic, x):
    dt = jax.numpy.result_type(x)
    if not holomorphic and not jax.numpy.issubdtype(dt, _np.floating):
      raise TypeError("grad requires real-valued outputs (output dtype that is "
                      f"a sub-dtype of np.floating), but got {dt.name}.")

# compute_on2 (function form) lowers to one non-inlined `call` carrying
# `_xla_stream_annotation`, the only form XLA GPU wraps into an async call.
# jax <= 0.11.0 calls the function form `compute_on2`; later JAX renamed it to
# `compute_on` (same keywords) and dropped the context-manager `compute_on`.
def _find_compute_on_fn():
  import inspect
  from jax.experimental import compute_on as mod
  for name in ("compute_on2", "compute_on"):
    fn = getattr(mod, name, None)
    if fn is None:
      continue
    try:
      params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
      continue
    if "out_memory_spaces" in params:
      return fn
  return None


try:
  _compute_on2 = _find_compute_on_fn()
except ImportError:  # pragma: no cover
  _compute_on2 = None

try:
  from jax._src.core import MemorySpace as _MemorySpace
  _DEVICE_SPACE = _MemorySpace.Device
except ImportError:  # pragma: no cover
  _DEVICE_SPACE = None


def on_stream(fun, stream: int, n_out: int):
  """Wraps `fun` (returning `n_out` arrays) to lower to one call on GPU stream `stream`."""
  if _compute_on2 is None:  # pragma: no cover
    raise NotImplementedError(
        "this JAX has no function-form compute_on (compute_on2) in "
        "jax.experimental.compute_on; use ooo.grad(..., mode='in_order').")
  return _compute_on2(fun, compute_type=f"gpu_stream:{stream}",
                      out_memory_spaces=(_DEVICE_SPACE,) * n_out)


# Set by `vary_inputs`: bind_eqn makes mixed invariant inputs varying over these axes.
_VARY_AXES: tuple | None = None


@contextlib.contextmanager
def vary_inputs(axis_name):
  """Within: `bind_eqn` casts invariant inputs of an equation with a varying input.

  A jaxpr traced without vma types binds under `shard_map(check_vma=True)`
  only if each equation's inputs agree; `lax` functions insert these casts
  when tracing, `bind` does not.
  """
  global _VARY_AXES
  prev, _VARY_AXES = _VARY_AXES, (axis_name if isinstance(axis_name, tuple) else (axis_name,))
  try:
    yield
  finally:
    _VARY_AXES = prev


def _match_vma(invals):
  vmas = [varying_axes(x) for x in invals]
  want = frozenset().union(*vmas) & frozenset(_VARY_AXES)
  if not want or all(v >= want for v in vmas):
    return invals
  return [x if v >= want else _pcast_varying(x, tuple(sorted(want - v)))
          for x, v in zip(invals, vmas)]


def eval_jaxpr(jaxpr, consts, *args) -> list[Any]:
  """`jax.core.eval_jaxpr` through `bind_eqn` (so `vary_inputs` reaches nested equations)."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
  for e in jaxpr.eqns:
    outs = bind_eqn(e, [read(v) for v in e.invars])
    env.update((v, x) for v, x in zip(e.outvars, outs) if not isinstance(v, DropVar))
  return [read(v) for v in jaxpr.outvars]


def _rebind_scan(eqn, invals):
  # A body traced without vma types types its carries invariant while the
  # re-bound inputs are varying: re-trace it as a scan over varying carries.
  p = eqn.params
  nc, nk = p["num_consts"], p["num_carry"]
  consts, xs = invals[:nc], invals[nc + nk:]
  init = [to_varying(x, _VARY_AXES) for x in invals[nc:nc + nk]]
  body = p["jaxpr"]

  def f(carry, x):
    outs = eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *x)
    return [to_varying(c, _VARY_AXES) for c in outs[:nk]], outs[nk:]
  kw = {"_split_transpose": True} if p.get("_split_transpose") else {}  # a private flag
  carry, ys = jax.lax.scan(f, init, xs, length=p["length"], reverse=p["reverse"],
                           unroll=p["unroll"], **kw)
  return [*carry, *ys]


# primitive name -> (eqn, invals) -> outputs, used under `vary_inputs`.
_VMA_REBIND = {"scan": _rebind_scan}


def bind_eqn(eqn, invals: list[Any]) -> list[Any]:
  """Binds one jaxpr equation in the current trace, as `jax.core.eval_jaxpr` does."""
  if _VARY_AXES is not None and invals:
    invals = _match_vma(invals)
    rule = _VMA_REBIND.get(eqn.primitive.name)
    if rule is not None and any(varying_axes(x) for x in invals):  # check_vma=True only
      return rule(eqn, invals)
  params = eqn.primitive.get_bind_params(eqn.params)
  subfuns: list[Any] = []
  if isinstance(params, tuple):  # older JAX returned (subfuns, params)
    subfuns, params = params
  ctx = eqn.ctx.manager if getattr(eqn, "ctx", None) is not None else contextlib.nullcontext()
  if _siu is not None:
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    src = _siu.user_context(eqn.source_info.traceback, name_stack=name_stack)
  else:  # pragma: no cover
    src = contextlib.nullcontext()
  with src, ctx:
    ans = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(ans) if eqn.primitive.multiple_results else [ans]


try:  # the staging fast path of `emit_eqns`
  from jax._src import core as _core
  from jax._src.interpreters import partial_eval as _pe
  _STAGE = (_core.trace_ctx, _pe.DynamicJaxprTrace, _pe.DynamicJaxprTracer)
  _STAGE[1].emit_eqn, _STAGE[1].to_jaxpr_tracer  # noqa: B018 - fail here if renamed
except (ImportError, AttributeError):  # pragma: no cover - other JAX: bind each equation
  _STAGE = None


def _staging_trace():
  """The current trace when it stages a jaxpr (`jit`, `make_jaxpr`, ...), else None."""
  if _STAGE is None or _VARY_AXES is not None:
    return None
  trace = _STAGE[0].trace
  return trace if isinstance(trace, _STAGE[1]) else None


def emit_eqns(eqns, env: dict, stacks: dict | None = None) -> None:
  """Binds `eqns` in order in the current trace, reading and writing `env` (Var -> value).

  Same result as `bind_eqn` on each equation. When the current trace stages a
  jaxpr, each equation is copied into it as `jax`'s own jaxpr inlining does
  (no abstract evaluation or dispatch: about 6x faster than `bind`), keeping
  the equation's source line and its name stack under the current one.
  `stacks` (kept across calls by the caller) shares those name stacks.
  """
  trace = _staging_trace()
  if trace is not None:
    tracer_t = _STAGE[2]
    base = _siu.current_name_stack()
    stacks = {} if stacks is None else stacks
    # Binding enters the equation's own context (compute type, mesh, ...),
    # only merging in xla metadata set around the call; copying keeps it as is.
    merge = _core.current_jaxpr_eqn_context().xla_metadata
  for eqn in eqns:
    if (trace is None or eqn.effects or merge
        or not isinstance(eqn.primitive, _core.Primitive)):
      # effects may name jaxpr inputs by position; a pass's stand-in
      # primitive (e.g. scan_skew's) does its work in `bind`: bind
      outs = bind_eqn(eqn, [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars])
    else:
      info = eqn.source_info
      key = (base, info.name_stack)
      stack = stacks.get(key)
      if stack is None:  # one shared object per distinct stack, not one per equation
        stack = stacks[key] = base + info.name_stack
      src = info.replace(name_stack=stack)
      ins = [tracer_t(trace, v.aval, v, src) if isinstance(v, Literal)
             else trace.to_jaxpr_tracer(env[v], src) for v in eqn.invars]
      outs = trace.emit_eqn(ins, [v.aval for v in eqn.outvars], eqn.primitive,
                            eqn.params, eqn.effects, src, eqn.ctx)
    env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, DropVar))


def name_stack():
  """The current name stack (None on a JAX without one)."""
  return _siu.current_name_stack() if _siu is not None else None


def at_name_stack(stack):
  """Runs a block with `stack` (from `name_stack()`) as the current name stack."""
  if _siu is None or stack is None:  # pragma: no cover
    return contextlib.nullcontext()
  return _siu.set_name_stack(stack)


def relative_name_stack(base):
  """The name scopes entered since `base` (from `name_stack()`), as a name stack."""
  return _siu.current_name_stack()[len(base):]


def new_source_info():
  """Source info with no traceback and an empty name stack, for equations ooojax makes."""
  return _siu.new_source_info()


def staging_trace():
  """The current trace when it stages a jaxpr and equations may be added to it as they are."""
  return _staging_trace()


def is_current_trace(trace) -> bool:
  return _STAGE is not None and _STAGE[0].trace is trace


def plain_eqn(eqn) -> bool:
  """No effects and a JAX primitive (not a pass's stand-in that works in `bind`)."""
  return not eqn.effects and isinstance(eqn.primitive, _core.Primitive)


NO_EFFECTS = getattr(_core, "no_effects", frozenset()) if _STAGE is not None else frozenset()


@functools.cache
def call_debug_info():
  """DebugInfo for the jaxpr of ooojax's staged call (`passes.stage`)."""
  try:
    from jax._src.linear_util import DebugInfo
    return DebugInfo("ooo", "ooojax's schedule", None, None)
  except (ImportError, TypeError):  # pragma: no cover - other JAX: its default
    return None


@functools.cache
def _control_dep_call():
  # vmap_method broadcasts under vmap, so the order survives per-example grads.
  return jax.ffi.ffi_call("control_dep", (), has_side_effect=True, vmap_method="expand_dims")


@functools.cache
def _control_dep_eqn():
  x = jax.ShapeDtypeStruct((1,), "float32")
  return jax.make_jaxpr(lambda a, b: _control_dep_call()(a, b))(x, x).eqns[0]


def _control_dep(src, dst) -> None:
  if getattr(src, "ndim", None) == 1 and getattr(dst, "ndim", None) == 1:
    # the flat buffers of stream calls: one traced equation's params fit them
    # all (they name operand ranks only), bound without the ffi wrapper's work
    eqn = _control_dep_eqn()
    eqn.primitive.bind(src, dst, **eqn.params)
  else:
    _control_dep_call()(src, dst)


def control_deps(pairs) -> None:
  """Orders each `dst`'s producer after `src`'s producer, where XLA can (CPU).

  XLA turns the `control_dep` custom call into a control edge only in the CPU
  compiler (its control-dep-rewriter); XLA:GPU has no such pass and fails
  with "No FFI handler registered for control_dep". The choice is made per
  lowering platform (`lax.platform_dependent`), not by the default backend,
  so one trace lowers for CPU with the edges and for GPU without them, as in
  an AOT compile for a GPU from a CPU host.
  """
  pairs = list(pairs)
  if not pairs:
    return
  # stop_gradient (free in HLO) gives the edges symbolic-zero tangents, so
  # differentiating through ooo.grad skips them instead of failing; once per
  # value (a chain names each value twice).
  stopped: dict = {}
  for x in (x for p in pairs for x in p):
    if id(x) not in stopped:
      stopped[id(x)] = jax.lax.stop_gradient(x)

  def cpu():
    for src, dst in pairs:
      _control_dep(stopped[id(src)], stopped[id(dst)])
    return jax.numpy.zeros((), jax.numpy.int32)

  jax.lax.platform_dependent(cpu=cpu, default=lambda: jax.numpy.zeros((), jax.numpy.int32))


def new_var(aval):
  """A fresh jaxpr variable (the constructor's signature changed across JAX)."""
  try:
    return Var(aval)
  except TypeError:  # pragma: no cover - older JAX: Var(suffix, aval)
    return Var("", aval)


def flat_debug_info(jaxpr, n_consts: int):
  """`jaxpr`'s DebugInfo for a version whose consts became inputs after the first."""
  dbg = getattr(jaxpr, "debug_info", None)
  if dbg is None:
    return None
  names = getattr(dbg, "arg_names", None)
  if names is None:
    return dbg
  names = (*names[:1], *(f"const{i}" for i in range(n_consts)), *names[1:])
  try:
    return dbg._replace(arg_names=names)
  except (AttributeError, TypeError):  # pragma: no cover
    return dbg


def eqn_context():
  """The context new equations get (xla metadata, compute type, ...): hashable."""
  return _core.current_jaxpr_eqn_context() if _STAGE is not None else None


def is_tracer(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def varying_axes(x) -> frozenset:
  """The manual mesh axes `x` (a value or an aval) varies over under `shard_map(check_vma=True)`."""
  aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
  vma = getattr(aval, "vma", None)  # later JAX
  if vma is None:
    mat = getattr(aval, "mat", None)  # jax 0.10: aval.mat.varying
    vma = getattr(mat, "varying", frozenset()) if mat is not None else frozenset()
  return frozenset(vma)


def to_varying(x, axis_name):
  """Marks `x` as varying over `axis_name` (a no-op without vma checking).

  The data-parallel mode re-binds a per-device gradient jaxpr traced without
  vma types; under `check_vma=True` every input must be varying so that the
  equations type-check and AD inserts no reductions of its own.
  """
  axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  missing = tuple(a for a in axes if a not in varying_axes(x))
  if not missing:
    return x
  return _pcast_varying(x, missing)


def invariant_program(closed) -> bool:
  """No value of `closed` (consts, equations, nested jaxprs) varies over a mesh axis."""
  if any(varying_axes(c) for c in closed.consts):
    return False
  seen: set = set()
  known: dict = {}  # aval -> varies (avals are interned: few distinct ones)

  def varies(aval):
    r = known.get(aval)
    if r is None:
      r = known[aval] = bool(varying_axes(aval))
    return r

  def ok(jaxpr):
    if id(jaxpr) in seen:  # shared bodies (jit caches) are checked once
      return True
    seen.add(id(jaxpr))
    if any(varies(v.aval) for v in jaxpr.invars):
      return False
    for e in jaxpr.eqns:
      for v in e.outvars:
        if varies(v.aval):
          return False
      for p in e.params.values():
        if type(p) is tuple:  # cond's branches
          subs = p if p and type(p[0]) in (ClosedJaxpr, Jaxpr) else ()
        else:
          subs = (p,) if type(p) in (ClosedJaxpr, Jaxpr) else ()
        for q in subs:
          if type(q) is ClosedJaxpr:
            if any(varying_axes(c) for c in q.consts) or not ok(q.jaxpr):
              return False
          elif not ok(q):
            return False
    return True
  return ok(closed.jaxpr)


def like_varying(x, ref):
  """`x` made to vary over every mesh axis `ref` varies over (e.g. a cotangent for `ref`)."""
  axes = tuple(sorted(varying_axes(ref) - varying_axes(x), key=str))
  return _pcast_varying(x, axes) if axes else x


def shape_dtype(aval) -> jax.ShapeDtypeStruct:
  """`aval` as a `jax.ShapeDtypeStruct`, weak type and varying mesh axes kept.

  Traced from such structs under `shard_map(check_vma=True)`, a jaxpr is
  typed as the values it will be bound to: its equations carry their own
  casts, so emission can copy them (`emit_eqns`) instead of re-binding each.
  """
  weak = bool(getattr(aval, "weak_type", False))
  mat = getattr(aval, "mat", None)  # jax 0.10-0.11: the manual axis type (vma)
  if mat is not None and not getattr(mat, "empty", True):
    try:
      return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak,
                                  sharding=aval.sharding, manual_axis_type=mat)
    except (TypeError, ValueError):  # pragma: no cover - other JAX: untyped, cast when bound
      pass
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak)


def _pcast_varying(x, axes):
  if hasattr(jax.lax, "pcast"):  # jax >= 0.8
    return jax.lax.pcast(x, axes, to="varying")
  return jax.lax.pvary(x, axes)  # pragma: no cover - older name


def stacked_aval(length: int, aval):
  """`aval` with a leading axis of `length` (a scan's ys), keeping weak type and sharding."""
  try:
    from jax._src import core as _core
    return _core.unmapped_aval(length, 0, aval)
  except (ImportError, AttributeError, TypeError):  # pragma: no cover
    return aval.update(shape=(length, *aval.shape))


try:
  from jax._src.lax.lax import _convert_element_type as _cet
except ImportError:  # pragma: no cover
  _cet = None


def convert_element_type(x, dtype, weak_type: bool):
  """`x` as `dtype`, weakly typed when `weak_type` (jax.grad's cotangent keeps the output's)."""
  if _cet is None:  # pragma: no cover - loses weak typing only
    return jax.lax.convert_element_type(x, dtype)
  return _cet(x, dtype, weak_type)


# Errors raised when Python needs a traced value (`if x > 0`, `int(x)`, `np.asarray(x)`).
TRACER_VALUE_ERRORS = tuple(
    t for t in (getattr(jax.errors, n, None) for n in (
        "ConcretizationTypeError", "TracerBoolConversionError",
        "TracerIntegerConversionError", "TracerArrayConversionError"))
    if t is not None)
