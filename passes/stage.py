"""stage: put equations into the caller's jaxpr as they are, in one nested call.

Contract: `CallStager()(eqns, env, live) -> bool` stages a run of traced
equations as one nested `jit` equation of the current trace, whose jaxpr is
the run itself (no equation is copied or re-bound); XLA inlines the call.

Copying equations into the caller's trace (`_compat.emit_eqns`) costs a tracer
and a tracing equation per equation, and the caller's jaxpr is then built from
them again (0.17-0.19 s of a 48-layer GPT's lowering, timed phase by phase). The
helpers here build what emission adds (barriers, copies of a traced
template) as equations too, so a whole schedule goes into one call.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from ooojax.passes import _compat
from ooojax.passes._compat import DropVar, Literal


def scoped_eqns(eqns, base, stacks: dict, subst: dict) -> list:
  """`eqns` with the name scopes entered since `base` put before their own name
  stacks, and their inputs renamed by `subst` (var -> var).

  They keep their unit's scope when staged later, from outside it
  (`CallStager`); `stacks` shares the stack objects, as in `_compat.emit_eqns`.
  """
  rel = _compat.relative_name_stack(base)
  out = []
  for eqn in eqns:
    info = eqn.source_info
    key = (rel, info.name_stack)
    stack = stacks.get(key)
    if stack is None:
      stack = stacks[key] = rel + info.name_stack
    src = info.replace(name_stack=stack)
    if subst and any(not isinstance(v, Literal) and v in subst for v in eqn.invars):
      ins = [v if isinstance(v, Literal) else subst.get(v, v) for v in eqn.invars]
      out.append(eqn.replace(invars=ins, source_info=src))
    else:
      out.append(eqn.replace(source_info=src))
  return out


def renamed(jaxpr, ins) -> tuple[list, list]:
  """`jaxpr`'s equations reading `ins` for its inputs, with fresh vars inside.

  A traced template (no consts) copied as equations, not values: the result
  goes into a jaxpr that `CallStager` stages. Returns (equations, outputs).
  """
  m = dict(zip(jaxpr.invars, ins))
  eqns = []
  for eqn in jaxpr.eqns:
    outs = [v if isinstance(v, DropVar) else _compat.new_var(v.aval) for v in eqn.outvars]
    eqns.append(
      eqn.replace(invars=[v if isinstance(v, Literal) else m[v] for v in eqn.invars], outvars=outs)
    )
    m.update(zip(eqn.outvars, outs))
  return eqns, [v if isinstance(v, Literal) else m[v] for v in jaxpr.outvars]


@functools.cache
def _barrier_eqn():
  x = jax.ShapeDtypeStruct((), "float32")
  return jax.make_jaxpr(jax.lax.optimization_barrier)(x).eqns[0]


def barrier_eqn(ins) -> tuple[Any, list]:
  """An `optimization_barrier` equation over the vars `ins`, and its output vars."""
  outs = [_compat.new_var(v.aval) for v in ins]
  src = _compat.new_source_info()
  return _barrier_eqn().replace(
    invars=list(ins), outvars=outs, source_info=src, ctx=_compat.eqn_context()
  ), outs


class CallStager:
  """Stages a run of equations as one nested `jit` equation that holds them as they are.

  Copying equations into the caller's trace (`_compat.emit_eqns`) costs a tracer and a
  tracing equation per equation, then the caller's jaxpr is built from them
  again; a nested `jit` equation whose jaxpr is the run itself costs neither
  (its lowering is a function call that XLA inlines). `ok` is False where the
  current trace does not stage or this JAX's `jit` equation has an unknown form:
  copy there.
  """

  def __init__(self):
    self.ok = False
    self.trace = _compat.staging_trace()
    if self.trace is None:
      return
    try:
      x = jax.ShapeDtypeStruct((), "float32")
      eqn = jax.make_jaxpr(jax.jit(lambda y: y * 2))(x).eqns[0]  # in the caller's context (mesh)
      _compat.relative_name_stack(_compat.name_stack())  # name stacks as this module reads them
    except Exception:  # pragma: no cover - another JAX or an unusual context: copy instead
      return
    self.template = _compat.jit_template(eqn)
    self.ok = self.template is not None

  def __call__(self, eqns, env: dict, live) -> bool:
    """Stages `eqns` (no effects, plain primitives) reading and writing `env`.

    `live(var, reads)`: whether a var the run defines (and reads `reads`
    times) is read after it, so is an output of the call.
    """
    if not self.ok or not _compat.is_current_trace(self.trace):
      return False
    merge = _compat.eqn_context().xla_metadata
    if merge:  # copying merges metadata set around emission into each equation
      return False
    defined: dict = {}
    inner: dict = {}
    free: list = []
    seen: set = set()
    for eqn in eqns:
      if not _compat.plain_eqn(eqn):  # a pass's stand-in must be bound, not held
        return False
      for v in eqn.invars:
        if isinstance(v, Literal):
          continue
        if v in defined:
          inner[v] = inner.get(v, 0) + 1
        elif v not in seen:
          seen.add(v)
          free.append(v)
      for v in eqn.outvars:
        if not isinstance(v, DropVar):
          defined[v] = None
    outs = [v for v in defined if live(v, inner.get(v, 0))]
    if not outs:
      return False
    jaxpr = _compat.open_jaxpr([], free, outs, eqns, _compat.NO_EFFECTS, _compat.call_debug_info())
    p = _compat.jit_params(self.template, _compat.closed(jaxpr), "ooo", len(free), len(outs))
    vals = self.template.primitive.bind(*[env[v] for v in free], **p)
    env.update(zip(outs, vals))
    return True
