"""Every private JAX import, and every read of a primitive's params, in one place.

A JAX upgrade that moves or renames one of these touches this file only
(`tests/test_compat.py` checks that no other module indexes `eqn.params`).
Supported: jax/jaxlib 0.11.2 (the GPU machine's) and 0.12.x. Each name has a
clear error for an unknown JAX rather than a `KeyError` deep inside a pass.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
from jax._src import core as _core, flattree as _ft, source_info_util as _siu
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax.lax import _convert_element_type as _cet
from jax._src.linear_util import DebugInfo as _DebugInfo
from jax.extend import core as jex_core

Literal = jex_core.Literal
Var = jex_core.Var
Jaxpr = jex_core.Jaxpr
# jax >= 0.11: one class; a Jaxpr carries its consts (`closed(jaxpr, consts)`).
ClosedJaxpr = jex_core.ClosedJaxpr
DropVar = jex_core.DropVar
JAXPR_TYPES = (Jaxpr,) if ClosedJaxpr is Jaxpr else (Jaxpr, ClosedJaxpr)


def closed(jaxpr, consts: Sequence[Any] = ()):
  """`jaxpr` with `consts` bound to its constvars (a closed jaxpr)."""
  return ClosedJaxpr(jaxpr, list(consts))


def open_jaxpr(constvars, invars, outvars, eqns, effects, debug_info=None):
  """A jaxpr whose `constvars` get values later (`closed`)."""
  return Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), effects, debug_info)


def check_jaxpr(jaxpr) -> None:
  """JAX's type check of a (closed) jaxpr; raises `JaxprTypeError`."""
  _core.check_jaxpr(getattr(jaxpr, "jaxpr", jaxpr))


# --- primitive params: every read and write goes through here -----------------
def param_items(eqn) -> tuple[tuple[str, Any], ...]:
  """An equation's params as (name, value) pairs, for generic walks (fingerprints)."""
  return tuple(eqn.params.items())


def subjaxprs(eqn) -> Iterator[Any]:
  """The jaxprs an equation holds (a scan's body, a cond's branches, ...)."""
  for p in eqn.params.values():
    for q in p if type(p) in (tuple, list) else (p,):
      if isinstance(q, JAXPR_TYPES):
        yield q


def map_subjaxprs(eqn, fn):
  """`eqn` with every jaxpr it holds replaced by `fn(jaxpr)`."""

  def sub(p):
    if isinstance(p, JAXPR_TYPES):
      return fn(p)
    if type(p) in (tuple, list) and any(isinstance(q, JAXPR_TYPES) for q in p):
      return type(p)(sub(q) for q in p)
    return p

  return eqn.replace(params={k: sub(p) for k, p in eqn.params.items()})


class CallBody(NamedTuple):
  """What a call-like equation runs: inline `jaxpr` with `consts` before its inputs."""

  jaxpr: Any
  consts: tuple
  prevent_cse: Any  # False, True, or one bool per input: barrier the inputs when inlining


_CALL_PARAM = {
  "jit": "jaxpr",
  "pjit": "jaxpr",
  "closed_call": "call_jaxpr",
  "core_call": "call_jaxpr",
  "eval_jaxpr": "call_jaxpr",
  "custom_jvp_call": "call_jaxpr",
  "custom_vjp_call": "call_jaxpr",
  "custom_vjp_call_jaxpr": "call_jaxpr",
}
_REMAT = ("checkpoint", "remat2")
CALL_PRIMITIVES = frozenset(_CALL_PARAM) | frozenset(_REMAT)


def call_body(eqn) -> CallBody | None:
  """The body of a call-like equation (jit, eval_jaxpr, custom_jvp/vjp, remat), else None.

  A differentiated remat (the backward's recompute) keeps its CSE barrier so
  that XLA cannot merge the recompute into the forward pass.
  """
  name = eqn.primitive.name
  p = eqn.params
  if name in _REMAT:
    prevent = p["prevent_cse"] if p.get("differentiated") else False
    j = p["jaxpr"]
    return CallBody(j, tuple(getattr(j, "consts", ())), prevent)
  key = _CALL_PARAM.get(name)
  if key is None:
    return None
  j = p[key]
  return CallBody(j, tuple(getattr(j, "consts", ())), False)


def is_call(eqn) -> bool:
  return eqn.primitive.name in CALL_PRIMITIVES


class ScanInfo(NamedTuple):
  """A `scan` equation's params, as the passes read them."""

  body: Any  # closed jaxpr: (*consts, *carry, *xs) -> (*carry, *ys)
  num_consts: int
  num_carry: int
  length: int
  reverse: bool
  unroll: int

  def split_in(self, vals: Sequence[Any]) -> tuple[list, list, list]:
    nc, nk = self.num_consts, self.num_carry
    return list(vals[:nc]), list(vals[nc : nc + nk]), list(vals[nc + nk :])

  def split_out(self, vals: Sequence[Any]) -> tuple[list, list]:
    return list(vals[: self.num_carry]), list(vals[self.num_carry :])

  @property
  def loop_key(self) -> tuple:
    """What two scans must share to run as one loop."""
    return (self.length, self.reverse, self.unroll)


def is_scan(eqn) -> bool:
  return eqn.primitive.name == "scan"


def scan_info(eqn) -> ScanInfo:
  """The params of a `scan` equation (jax >= 0.11 keeps the counts in FlatTrees)."""
  if eqn.primitive.name != "scan":
    raise TypeError(f"scan_info expects a scan equation, got {eqn.primitive.name}")
  p = eqn.params
  nc, nk, _ = (len(t) for t in p["ft_in"].unpack())  # FlatTrees of (consts, carry, xs)
  return ScanInfo(p["jaxpr"], nc, nk, int(p["length"]), bool(p["reverse"]), p.get("unroll", 1))


def scan_eqn(like, *, body, num_consts: int, num_carry: int, invars, outvars):
  """A `scan` equation like `like` (length, direction, unroll) running `body`.

  `body` is closed: `(*consts, *carry, *xs) -> (*carry, *ys)` with `num_consts`
  consts and `num_carry` carries; `invars` / `outvars` are the outer atoms.
  """
  p = dict(like.params, jaxpr=body)
  n_xs = len(body.jaxpr.invars) - num_consts - num_carry
  n_ys = len(body.jaxpr.outvars) - num_carry
  p["ft_in"] = _ft.pack((_ft.nones(num_consts), _ft.nones(num_carry), _ft.nones(n_xs)))
  p["ft_out"] = _ft.pack((_ft.nones(num_carry), _ft.nones(n_ys)))
  return like.replace(invars=list(invars), outvars=list(outvars), params=p)


class WhileInfo(NamedTuple):
  cond: Any  # closed jaxpr: (*cond_consts, *carry) -> pred
  body: Any  # closed jaxpr: (*body_consts, *carry) -> carry
  cond_nconsts: int
  body_nconsts: int


def while_info(eqn) -> WhileInfo:
  p = eqn.params
  return WhileInfo(p["cond_jaxpr"], p["body_jaxpr"], p["cond_nconsts"], p["body_nconsts"])


def cond_branches(eqn) -> tuple:
  """A `cond` equation's branches (closed jaxprs); its first input is the index."""
  return tuple(eqn.params["branches"])


def dot_contracting(eqn) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """A `dot_general`'s (lhs, rhs) contracting dimensions."""
  (lc, rc), _ = eqn.params["dimension_numbers"]
  return tuple(lc), tuple(rc)


def conv_out_feature_dim(eqn) -> int:
  """The kernel's output-feature dimension of a `conv_general_dilated`."""
  dn = eqn.params["dimension_numbers"]
  return dn.rhs_spec[0] if dn is not None else 0


def conv_group_count(eqn) -> int:
  return max(int(eqn.params.get("batch_group_count", 1)), 1)


def call_name(eqn) -> str | None:
  """The `name` of a `jit` equation (None for other primitives)."""
  return eqn.params.get("name") if eqn.primitive.name in ("jit", "pjit") else None


class JitTemplate(NamedTuple):
  """A traced `jit` equation's primitive and params, re-used to stage calls."""

  primitive: Any
  params: dict


_PER_IN = ("in_shardings", "in_layouts", "donated_invars")
_PER_OUT = ("out_shardings", "out_layouts")


def jit_template(eqn) -> JitTemplate | None:
  """`eqn` (a 1-in 1-out `jit`) as a template, or None for a jit form we do not know."""
  p = dict(eqn.params)
  one = {k for k, v in p.items() if isinstance(v, tuple) and len(v) == 1}
  if one != set(_PER_IN + _PER_OUT) or "jaxpr" not in p or "name" not in p:
    return None  # pragma: no cover - a JAX whose jit params we do not know
  return JitTemplate(eqn.primitive, p)


def jit_params(template: JitTemplate, body, name: str, n_in: int, n_out: int) -> dict:
  """Params of a `jit` equation calling `body` (closed) with `n_in` inputs."""
  p = dict(template.params, jaxpr=body, name=name)
  for k in _PER_IN:
    p[k] = p[k] * n_in
  for k in _PER_OUT:
    p[k] = p[k] * n_out
  return p


# compute_on's function form lowers to one non-inlined `call` carrying
# `_xla_stream_annotation`, the only form XLA:GPU wraps into an async call.
from jax.experimental.compute_on import compute_on as _compute_on  # noqa: E402

_DEVICE_SPACE = _core.MemorySpace.Device


def on_stream(fun, stream: int, n_out: int):
  """Wraps `fun` (returning `n_out` arrays) to lower to one call on GPU stream `stream`."""
  return _compute_on(
    fun, compute_type=f"gpu_stream:{stream}", out_memory_spaces=(_DEVICE_SPACE,) * n_out
  )


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
  return [
    x if v >= want else _pcast_varying(x, tuple(sorted(want - v))) for x, v in zip(invals, vmas)
  ]


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
  info = scan_info(eqn)
  consts, init, xs = info.split_in(invals)
  init = [to_varying(x, _VARY_AXES) for x in init]
  body, nk = info.body, info.num_carry

  def f(carry, x):
    outs = eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *x)
    return [to_varying(c, _VARY_AXES) for c in outs[:nk]], outs[nk:]

  carry, ys = jax.lax.scan(
    f, init, xs, length=info.length, reverse=info.reverse, unroll=info.unroll
  )
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
  if isinstance(params, tuple):  # a primitive with function params: (subfuns, params)
    subfuns, params = params
  ctx = eqn.ctx.manager if getattr(eqn, "ctx", None) is not None else contextlib.nullcontext()
  name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
  src = _siu.user_context(eqn.source_info.traceback, name_stack=name_stack)
  with src, ctx:
    ans = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(ans) if eqn.primitive.multiple_results else [ans]


# the staging fast path of `emit_eqns` (None: bind every equation, as tests compare)
_STAGE = (_core.trace_ctx, _pe.DynamicJaxprTrace, _pe.DynamicJaxprTracer)
_STAGE[1].emit_eqn, _STAGE[1].to_jaxpr_tracer  # noqa: B018 - fail here if renamed


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
    if trace is None or eqn.effects or merge or not isinstance(eqn.primitive, _core.Primitive):
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
      ins = [
        tracer_t(trace, v.aval, v, src)
        if isinstance(v, Literal)
        else trace.to_jaxpr_tracer(env[v], src)
        for v in eqn.invars
      ]
      outs = trace.emit_eqn(
        ins, [v.aval for v in eqn.outvars], eqn.primitive, eqn.params, eqn.effects, src, eqn.ctx
      )
    env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, DropVar))


def name_stack():
  """The current name stack."""
  return _siu.current_name_stack()


def at_name_stack(stack):
  """Runs a block with `stack` (from `name_stack()`) as the current name stack."""
  if stack is None:
    return contextlib.nullcontext()
  return _siu.set_name_stack(stack)


def relative_name_stack(base):
  """The name scopes entered since `base` (from `name_stack()`), as a name stack."""
  return _siu.current_name_stack()[len(base) :]


def new_source_info():
  """Source info with no traceback and an empty name stack, for equations ooojax makes."""
  return _siu.new_source_info()


def staging_trace():
  """The current trace when it stages a jaxpr and equations may be added to it as they are."""
  return _staging_trace()


def is_current_trace(trace) -> bool:
  return _core.trace_ctx.trace is trace


def plain_eqn(eqn) -> bool:
  """No effects and a JAX primitive (not a pass's stand-in that works in `bind`)."""
  return not eqn.effects and isinstance(eqn.primitive, _core.Primitive)


NO_EFFECTS = _core.no_effects


@functools.cache
def call_debug_info():
  """DebugInfo for the jaxpr of ooojax's staged call (`passes.stage`)."""
  return _DebugInfo("ooo", "ooojax's schedule", None, None)


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
  """A fresh jaxpr variable."""
  return Var(aval)


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
  return _core.current_jaxpr_eqn_context()


def is_tracer(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def varying_axes(x) -> frozenset:
  """The manual mesh axes `x` (a value or an aval) varies over under `shard_map(check_vma=True)`."""
  aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
  vma = getattr(aval, "vma", None)  # older JAX
  if vma is None:
    mat = getattr(aval, "mat", None)  # jax 0.10-0.12: aval.mat.varying
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
      for q in subjaxprs(e):
        if any(varying_axes(c) for c in getattr(q, "consts", ())) or not ok(q.jaxpr):
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
  mat = getattr(aval, "mat", None)  # the manual axis type (vma)
  if mat is not None and not getattr(mat, "empty", True):
    try:
      return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, weak_type=weak, sharding=aval.sharding, manual_axis_type=mat
      )
    except (TypeError, ValueError):  # pragma: no cover - other JAX: untyped, cast when bound
      pass
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak)


def _pcast_varying(x, axes):
  return jax.lax.pcast(x, axes, to="varying")


def stacked_aval(length: int, aval):
  """`aval` with a leading axis of `length` (a scan's ys), keeping weak type and sharding."""
  return _core.unmapped_aval(length, 0, aval)


def convert_element_type(x, dtype, weak_type: bool):
  """`x` as `dtype`, weakly typed when `weak_type` (jax.grad's cotangent keeps the output's)."""
  return _cet(x, dtype, weak_type)


# Errors raised when Python needs a traced value (`if x > 0`, `int(x)`, `np.asarray(x)`).
TRACER_VALUE_ERRORS = tuple(
  t
  for t in (
    getattr(jax.errors, n, None)
    for n in (
      "ConcretizationTypeError",
      "TracerBoolConversionError",
      "TracerIntegerConversionError",
      "TracerArrayConversionError",
    )
  )
  if t is not None
)


def used_inputs(closed, used_outputs: Sequence[bool]) -> list[bool]:
  """Which inputs of a closed jaxpr the chosen outputs read (JAX's own DCE rules).

  E.g. whether an optimizer's update of one parameter reads another's gradient.
  """
  _, used = _pe.dce_jaxpr(closed.jaxpr, list(used_outputs))
  return list(used)
