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
from jax._src.interpreters import batching as _batching, partial_eval as _pe
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

from jax._src.api import (  # noqa: E402 - JAX's own wording for grad's argument errors
  _check_input_dtype_grad as check_input_dtype_grad,  # noqa: F401 - read by ooojax._api
  _check_output_dtype_grad as check_output_dtype_grad,  # noqa: F401
  _check_scalar as check_scalar,  # noqa: F401
)


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


def conv_asymmetric_padding(eqn) -> bool:
  """A `conv_general_dilated` whose padding differs between the two sides of
  some spatial dimension (cuDNN takes symmetric padding only: XLA:GPU pads or
  slices the input in a kernel of its own)."""
  return any(lo != hi for lo, hi in eqn.params["padding"])


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
  """Wraps `fun` (returning `n_out` arrays) to lower to one call on GPU stream `stream`.

  The call is `compute_on`'s equation under another primitive of the same
  name (`_stream_call_p`) that lowers as `compute_on` does, except in a module
  partitioned over several devices (GSPMD): there it lowers inline, with no
  stream annotation. The partitioner puts collectives inside a dW call (the
  reduction of a batch-sharded weight gradient), and XLA:GPU (jax 0.12) then
  fails: "No ExecutionStreamId found for all-reduce-start". Every transform
  other than lowering is `compute_on`'s own.
  """
  wrapped = _compute_on(
    fun, compute_type=f"gpu_stream:{stream}", out_memory_spaces=(_DEVICE_SPACE,) * n_out
  )

  def call(*args):
    closed, shape = jax.make_jaxpr(wrapped, return_shape=True)(*args)
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, jax.tree_util.tree_leaves(args)))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
    for eqn in closed.jaxpr.eqns:
      prim = _stream_call_p() if eqn.primitive is _compute_on_p() else eqn.primitive
      outs = prim.bind(*map(read, eqn.invars), **eqn.params)
      env.update(zip(eqn.outvars, outs if prim.multiple_results else [outs]))
    return jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(shape), [read(v) for v in closed.jaxpr.outvars]
    )

  return call


def _partitioned(ctx) -> bool:
  """The module being lowered is partitioned over several devices by GSPMD
  (a sharded jit, or `shard_map` with some mesh axes left automatic)."""
  from jax._src import sharding_impls as _si

  axis_ctx = ctx.module_context.axis_context
  if isinstance(axis_ctx, _si.ShardingContext):
    return axis_ctx.num_devices > 1
  if isinstance(axis_ctx, _si.SPMDAxisContext):
    return bool(set(axis_ctx.mesh.axis_names) - set(axis_ctx.manual_axes))
  return False


def _stream_call_lowering(ctx, *args, **params):
  from jax._src import compute_on as _co
  from jax._src.interpreters import mlir as _mlir

  if not _partitioned(ctx):
    return _co._compute_on_lowering(ctx, *args, **params)
  jaxpr = params["jaxpr"]

  def inline(*vals):
    # bound without the equations' own context: it carries the stream
    # compute type, which would annotate each op inside
    env = dict(zip(jaxpr.invars, vals))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
      outs = eqn.primitive.bind(*map(read, eqn.invars), **eqn.params)
      env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [read(v) for v in jaxpr.outvars]

  return _mlir.lower_fun(inline, multiple_results=True)(ctx, *args)


def _compute_on_p():
  from jax._src import compute_on as _co

  return _co.compute_on_p


@functools.cache
def _stream_call_p():
  """`compute_on`'s primitive with a lowering that SPMD partitioning survives."""
  from jax._src import compute_on as _co
  from jax._src.interpreters import ad as _ad, batching as _batching, mlir as _mlir

  base = _co.compute_on_p
  # named as compute_on's: op metadata (`.../ooo_W3/compute_on`) and readers of
  # the jaxpr see the same call
  prim = _core.Primitive("compute_on")
  prim.multiple_results = True
  prim.def_impl(lambda *a, **params: base.bind(*a, **params))
  prim.def_effectful_abstract_eval(_co._compute_on_abstract_eval)
  _mlir.register_lowering(prim, _stream_call_lowering)
  for table in (
    _batching.fancy_primitive_batchers,
    _ad.primitive_jvps,
    _ad.primitive_linearizations,
    _ad.fancy_transposes,
    _pe.custom_partial_eval_rules,
    _pe.partial_eval_jaxpr_custom_rules,
    _pe.dce_rules,
  ):
    if base in table:
      table[prim] = table[base]
  return prim


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
  # The equation's context restores the mesh it was traced under (the user's
  # `jax.set_mesh`); re-bound inside a `shard_map` (the pipeline's stages) the
  # values are manual, so the shard_map's own mesh must stay current.
  cur = jax.sharding.get_abstract_mesh()
  keep = jax.sharding.use_abstract_mesh(cur) if cur.manual_axes else contextlib.nullcontext()
  with src, ctx, keep:
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


def _control_dep_lowering(ctx, src, dst):
  """The `control_dep` custom call (CPU), or nothing where SPMD partitioning follows.

  XLA's SPMD partitioner requires a sharding on every side-effecting
  instruction ("Side-effect HLO must have sharding") and would replicate the
  operands to give it one: an all-gather of sharded gradients whose
  producers, not the calls, would then get the edge. Under a jit partitioned
  over several devices (GSPMD, or `shard_map` with some axes left auto) the
  edge is therefore left out: the stream calls' windows are still pinned by
  the barriers (`ordering="barriers"` / `"auto"`).
  """
  if _partitioned(ctx):
    return []
  from jax._src import ffi as _ffi

  rule = _ffi.ffi_lowering("control_dep", has_side_effect=True)
  return rule(ctx, src, dst)


@functools.cache
def _control_dep_p():
  """`ooo_control_dep(src, dst)`: an output-less ordering edge.

  It lowers to XLA:CPU's `control_dep` custom call, which its
  control-dep-rewriter turns into a control edge; XLA:GPU has no such pass
  (it fails with "No FFI handler registered for control_dep"), so every other
  platform lowers it to nothing. The choice is made per lowering platform,
  not by the default backend: one trace lowers for CPU with the edges and for
  a GPU without them, as in an AOT compile for a GPU from a CPU host.
  """
  from jax._src.interpreters import ad as _ad, batching as _batching, mlir as _mlir

  prim = _core.Primitive("ooo_control_dep")
  prim.multiple_results = True
  prim.def_impl(lambda src, dst: [])  # eager: nothing to order
  # No jaxpr effect: any effect turns off jit's C++ dispatch (pjit's fast
  # path), so every call of a step went through Python: 0.6 ms (demo CNN) to
  # 6 ms (ResNet-50) a step on the H200 (benchmarks.gpu_gaps), the whole
  # single-GPU loss there. A DCE rule keeps the output-less edge instead, and
  # the custom call is side-effecting in HLO, which keeps it in XLA.
  prim.def_abstract_eval(lambda src, dst: [])
  # (used_outputs, eqn) on jax 0.11, (used_outputs, live_inputs, eqn) on 0.12
  _pe.dce_rules[prim] = lambda *a: ([True] * len(a[-1].invars), a[-1])
  # under vmap the edge orders the batched producers: same operands, no outputs
  _batching.primitive_batchers[prim] = lambda args, dims: (prim.bind(*args), [])

  def jvp(primals, tangents):
    return prim.bind(*primals), []

  _ad.primitive_jvps[prim] = jvp
  _mlir.register_lowering(prim, lambda ctx, src, dst: [])
  _mlir.register_lowering(prim, _control_dep_lowering, platform="cpu")
  return prim


def control_deps(pairs) -> None:
  """Orders each `dst`'s producer after `src`'s producer, where XLA can (CPU)."""
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
  for src, dst in pairs:
    _control_dep_p().bind(stopped[id(src)], stopped[id(dst)])


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
  """`aval` as a `jax.ShapeDtypeStruct`, weak type, sharding and varying mesh axes kept.

  Traced from such structs under `shard_map(check_vma=True)`, a jaxpr is
  typed as the values it will be bound to: its equations carry their own
  casts, so emission can copy them (`emit_eqns`) instead of re-binding each.
  The sharding is kept when it names a mesh (a jit over `jax.set_mesh`, explicit
  or auto axes): a loss that reads `jax.typeof(x).sharding` (to `reshard` to
  it) then sees the mesh it sees under `jax.grad`, not an empty one.
  """
  weak = bool(getattr(aval, "weak_type", False))
  sharding = aval_sharding(aval)
  mat = getattr(aval, "mat", None)  # the manual axis type (vma)
  if mat is not None and not getattr(mat, "empty", True):
    try:
      return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, weak_type=weak, sharding=aval.sharding, manual_axis_type=mat
      )
    except (TypeError, ValueError):  # pragma: no cover - other JAX: untyped, cast when bound
      pass
  if sharding is not None:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak, sharding=sharding)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak)


def aval_sharding(aval):
  """`aval`'s `NamedSharding` when its mesh is not empty, else None.

  An aval traced outside any mesh carries an empty abstract mesh; a struct
  given that sharding would fix nothing, so it is left out.
  """
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or getattr(mesh, "empty", True) or not getattr(mesh, "axis_names", ()):
    return None
  return sharding


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


# --- data parallel inside a sharded jit (GSPMD): where a value's sharding shows ---------
_SHARDING_PARAM = {"sharding_constraint": "sharding", "reshard": "dst_sharding"}


def declared_sharding(x):
  """The `NamedSharding` `x` is known to have inside a trace, or None.

  Seen, in order: explicit mesh axes in `x`'s type (`jax.typeof(x).sharding`);
  the sharding of the `with_sharding_constraint` / `reshard` that made the
  tracer (Auto axes do not show in types); a concrete array's own sharding.
  A jit argument under Auto axes shows none of these.
  """
  named = jax.sharding.NamedSharding
  if is_tracer(x):
    try:
      s = jax.typeof(x).sharding
    except (TypeError, AttributeError):  # pragma: no cover - other tracers
      s = None
    mesh = getattr(s, "mesh", None)
    if (
      isinstance(s, named)
      and mesh is not None
      and not mesh.empty
      and any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    ):
      return s
    parent = getattr(x, "parent", None)
    key = _SHARDING_PARAM.get(getattr(getattr(parent, "primitive", None), "name", None))
    if key is not None:
      s = parent.params.get(key)
      return s if isinstance(s, named) else None
    return None
  s = getattr(x, "sharding", None)
  return s if isinstance(s, named) else None


def context_mesh():
  """The mesh set by `jax.set_mesh` / `use_mesh` (abstract), or None."""
  m = jax.sharding.get_abstract_mesh()
  return None if m is None or m.empty else m


def manual_context_mesh():
  """A context that traces as the body of a `shard_map` over every axis of the
  `jax.set_mesh` mesh sees it: all axes manual. A pipeline's stages are traced
  outside the `shard_map` that runs them; under Explicit axes, an equation
  traced against the user's mesh would carry its shardings into the body,
  where JAX takes its values for inputs closed over (unsupported there). No
  mesh set, or no Explicit axis: no change (Auto axes re-bind as they are)."""
  m = context_mesh()
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  if m is None or explicit not in tuple(m.axis_types):
    return contextlib.nullcontext()
  manual = jax.sharding.AxisType.Manual
  return jax.sharding.use_abstract_mesh(m.update_axis_types({a: manual for a in m.axis_names}))


def manual_tracing(fn):
  """`fn` run inside `manual_context_mesh()` (a function that traces stages)."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with manual_context_mesh():
      return fn(*args, **kwargs)

  return wrapped


def manual_avals(tree):
  """`tree`'s unsharded `ShapeDtypeStruct`s typed as a `shard_map` body types its
  values, where `manual_context_mesh` is current: `jax.typeof(x).sharding` then
  names the manual mesh, as it does when the stage runs (a loss that reshards
  to it traces). Elsewhere `tree` as it is."""
  m = jax.sharding.get_abstract_mesh()
  if m is None or m.empty or not m.are_all_axes_manual:
    return tree
  sh = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec())

  def typed(a):
    if isinstance(a, jax.ShapeDtypeStruct) and a.sharding is None:
      return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
    return a

  return jax.tree.map(typed, tree)


def axis_env(axes: Sequence[tuple[str, int]]):
  """A context in which the mapped axes `axes` (name, size) are bound for tracing:
  a pipelined loss that names its data axis (`pmean`, `axis_index`) is traced
  and cut outside the `shard_map` that binds it. Empty `axes`: no change."""
  if not axes:
    return contextlib.nullcontext()
  return _core.extend_axis_env_nd(list(axes))


def pinning_effects(eqn) -> set:
  """`eqn`'s effects other than naming a mapped axis (`axis_index`, `psum` over the
  data axis): those a pass must not duplicate or move across a stage boundary."""
  return {e for e in eqn.effects if not isinstance(e, _core.NamedAxisEffect)}


def _without_axis(s, axis):
  """`s` (a `PartitionSpec` or `NamedSharding`) with `axis` removed from its entries."""
  P = jax.sharding.PartitionSpec

  def entry(e):
    kept = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a is not None and a != axis)
    return None if not kept else kept[0] if len(kept) == 1 else kept

  if isinstance(s, P):
    return P(*(entry(e) for e in s))
  if isinstance(s, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(s.mesh, _without_axis(s.spec, axis))
  return s


@contextlib.contextmanager
def manual_axis_dropped(axis: str) -> Iterator[None]:
  """While tracing inside a `shard_map` manual over `axis` (the data axis of a
  sharded jit), sharding requests that name `axis` (the `out_sharding=` of
  `dot_general`, `einsum`, `jnp` constructors, `reshard`, `auto_axes`) drop it.

  The model was written for the global view: there `P('data', None)` says
  the rows are split, which inside the shard_map holds by construction, but
  naming a manual axis is an error ("cannot contain axis names that are of
  type Auto or Manual"). `auto_axes` / `explicit_axes` without `axes=` switch
  every mesh axis, and a manual one cannot be switched: they switch the other
  axes. JAX resolves every such request through `canonicalize_sharding`,
  which its modules import by name, so each module's reference is replaced.
  """
  import sys

  from jax._src import mesh as _mesh, pjit as _pjit, sharding_impls as _si

  orig = _si.canonicalize_sharding

  def canonicalize(sharding, *a, **k):
    if axis in _mesh.get_abstract_mesh().manual_axes:
      sharding = _without_axis(sharding, axis)
    return orig(sharding, *a, **k)

  orig_new_mesh = _pjit._get_new_mesh

  def new_mesh(axes, *a, **k):
    cur = _mesh.get_abstract_mesh()
    if axes is None and axis in cur.manual_axes:
      axes = tuple(n for n in cur.axis_names if n not in cur.manual_axes)
    return orig_new_mesh(axes, *a, **k)

  holders = [
    m
    for name, m in list(sys.modules.items())
    if name.startswith("jax._src") and getattr(m, "canonicalize_sharding", None) is orig
  ]
  for m in holders:
    m.canonicalize_sharding = canonicalize
  _pjit._get_new_mesh = new_mesh
  try:
    yield
  finally:
    for m in holders:
      m.canonicalize_sharding = orig
    _pjit._get_new_mesh = orig_new_mesh


@contextlib.contextmanager
def per_example_draws(axis: str, rows: frozenset) -> Iterator[None]:
  """While tracing one shard of a batch split over `axis`, a random draw from a
  single key whose leading dimension is the shard's batch size (`rows`: dropout
  masks, per-example noise) is drawn at the full batch's shape and this
  shard's rows are kept.

  So each shard sees the rows of the draw `jax.value_and_grad` makes on the
  whole batch (with `jax_threefry_partitionable`, a draw's values do not
  depend on its sharding), instead of the same first rows on every shard.
  The draw costs the full batch's random bits on every device. Likewise a
  single key split into the shard's batch size (more than 2) outside `vmap`
  (`keys = split(key, batch)`, then vmapped over the rows) gives this
  shard's rows of the whole batch's split.
  """
  from jax._src.random import prng as _prng

  orig = _prng.random_bits

  def bits(keys, bit_width, shape):
    if not getattr(keys, "shape", ()) and shape and shape[0] in rows:
      n = jax.lax.axis_size(axis)
      full = orig(keys, bit_width, (n * shape[0], *shape[1:]))
      at = jax.lax.axis_index(axis) * shape[0]
      return jax.lax.dynamic_slice_in_dim(full, at, shape[0], 0)
    return orig(keys, bit_width, shape)

  orig_split = _prng.random_split

  def split(keys, shape):
    # per-example keys: one key split into the shard's rows at the top of the
    # loss (not under vmap, where a split is per example), as the whole batch's
    # split's rows; split(key) (2 keys) is left alone even for 2-row shards
    if (
      not getattr(keys, "shape", ())
      and len(shape) == 1
      and shape[0] in rows
      and shape[0] > 2
      and not isinstance(keys, _batching.BatchTracer)
    ):
      n = jax.lax.axis_size(axis)
      full = orig_split(keys, (n * shape[0],))
      return jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(axis) * shape[0], shape[0], 0)
    return orig_split(keys, shape)

  _prng.random_bits, _prng.random_split = bits, split
  try:
    yield
  finally:
    _prng.random_bits, _prng.random_split = orig, orig_split


def key_picks(eqn) -> list | None:
  """How `eqn` picks single entries out of an array along one axis, as
  `[(axis, index, squeezed, outvar)]`: an `unstack` (each output one index,
  the axis dropped) or a `slice` one wide along one axis and whole along the
  others (the axis kept); None for any other equation
  (`passes.pipeline.layer_keys`)."""
  name = eqn.primitive.name
  if name == "unstack":
    axis = int(eqn.params["axis"])
    return [(axis, j, True, v) for j, v in enumerate(eqn.outvars)]
  if name != "slice":
    return None
  shape = eqn.invars[0].aval.shape
  start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
  strides = eqn.params.get("strides")
  if strides is not None and any(s != 1 for s in strides):
    return None
  narrow = [d for d, (a, b) in enumerate(zip(start, limit)) if (a, b) != (0, shape[d])]
  if len(narrow) != 1 or limit[narrow[0]] - start[narrow[0]] != 1:
    return None
  return [(narrow[0], int(start[narrow[0]]), False, eqn.outvars[0])]


@contextlib.contextmanager
def splits_replaced(by_key: dict) -> Iterator[None]:
  """While tracing, `jax.random.split(k, n)` of a key `k` in `by_key` (id(k) ->
  `(n, keys)`) gives `keys` instead: a pipelined microbatch's per-example keys
  taken as its rows of the whole batch's split (`ooojax.pipeline._example_keys`)."""
  from jax._src.random import prng as _prng

  orig = _prng.random_split

  def split(keys, shape):
    hit = by_key.get(id(keys))
    if hit is not None and tuple(shape) == (hit[0],):
      return hit[1]
    return orig(keys, shape)

  _prng.random_split = split
  try:
    yield
  finally:
    _prng.random_split = orig


def sharded_over_mesh(avals) -> bool:
  """Some aval's type names a mesh axis (Explicit sharding: `jax.typeof(x).sharding`).

  A reshape that merges such dimensions needs an `out_sharding`, and a module
  partitioned over several devices lowers the stream calls inline anyway
  (`on_stream`), so their operands then go in and out as they are.
  """
  for a in avals:
    spec = getattr(getattr(a, "sharding", None), "spec", None)
    if spec and any(p is not None for p in spec):
      return True
  return False


def slice_window(eqn) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """`(start_indices, sizes)` of a unit-stride `slice` equation; None for any
  other equation (`passes.pipeline.hoist` reads a static slice as a dynamic one)."""
  if eqn.primitive.name != "slice":
    return None
  strides = eqn.params.get("strides")
  if strides is not None and any(s != 1 for s in strides):
    return None
  start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
  return tuple(map(int, start)), tuple(int(b) - int(a) for a, b in zip(start, limit))


@contextlib.contextmanager
def python_dispatches() -> Iterator[Any]:
  """Counts the calls of jitted functions that ran through Python while inside
  (pjit's `cache_miss`: a first call, a new signature, or every call once jit's C++
  fast path is off, as it is for a jaxpr with any effect); yields the count's getter.
  On the fast path a repeated call never reaches Python, so its count stays 0."""
  from jax._src import pjit as _pjit

  real = getattr(_pjit, "_infer_params", None)
  if real is None:  # a JAX that moved it: say so rather than count nothing
    raise NotImplementedError("this JAX has no jax._src.pjit._infer_params to count")
  count = [0]

  def counted(*args, **kwargs):
    count[0] += 1
    return real(*args, **kwargs)

  _pjit._infer_params = counted
  try:
    yield lambda: count[0]
  finally:
    _pjit._infer_params = real
