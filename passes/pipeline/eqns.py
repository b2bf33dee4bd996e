"""pipeline.eqns: a jaxpr's top-level equations with `jit` calls inlined, and their evaluation.

Contract: `flatten(closed_jaxpr) -> (eqns, outs, consts)` (fresh variables for
inlined bodies; `consts` maps constvars to values) and `evaluate(eqns, env,
outs) -> values`. `passes.pipeline.cut` analyses the flat equations and builds
the stage functions by evaluating subsets of them.
"""

from __future__ import annotations

from ooojax.passes import _compat

__all__ = ["evaluate", "flatten"]


def flatten(closed):
  """The top-level equations with `jit` calls inlined (fresh variables), the
  outputs, and the constants' values by variable.

  >>> import jax, jax.numpy as jnp
  >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2.0)(1.0)
  >>> eqns, outs, consts = flatten(closed)
  >>> [e.primitive.name for e in eqns]
  ['sin', 'mul']
  >>> env = dict(zip(closed.jaxpr.invars, [jnp.float32(0.5)]))
  >>> float(evaluate(eqns, env, outs)[0]) == float(jnp.sin(0.5) * 2)
  True
  """
  consts = dict(zip(closed.jaxpr.constvars, closed.consts))
  eqns: list = []

  def walk(jaxpr, sub, fresh):
    for e in jaxpr.eqns:
      ins = [sub.get(v, v) if isinstance(v, _compat.Var) else v for v in e.invars]
      call = _compat.call_body(e) if e.primitive.name in ("jit", "pjit") else None
      if call is None:
        outs = e.outvars
        if fresh:
          outs = [
            v if isinstance(v, _compat.DropVar) else _compat.new_var(v.aval) for v in e.outvars
          ]
          sub.update(zip(e.outvars, outs))
        eqns.append(e.replace(invars=ins, outvars=outs) if fresh or ins != e.invars else e)
        continue
      inner, inner_consts, _ = call
      m: dict = {}
      for v, c in zip(inner.constvars, inner_consts):
        m[v] = _compat.new_var(v.aval)
        consts[m[v]] = c
      m.update(zip(inner.invars, ins))
      walk(inner, m, True)
      for ov, iv in zip(e.outvars, inner.outvars):
        sub[ov] = m.get(iv, iv) if isinstance(iv, _compat.Var) else iv

  top: dict = {}
  walk(closed.jaxpr, top, False)
  outs = [top.get(v, v) if isinstance(v, _compat.Var) else v for v in closed.jaxpr.outvars]
  return eqns, outs, consts


def evaluate(eqns, env: dict, outs) -> list:
  """Runs `eqns` on `env` (var -> value, updated) and returns the values of `outs`."""
  read = lambda v: v.val if isinstance(v, _compat.Literal) else env[v]  # noqa: E731
  for e in eqns:
    for v, x in zip(e.outvars, _compat.bind_eqn(e, [read(v) for v in e.invars])):
      if not isinstance(v, _compat.DropVar):
        env[v] = x
  return [read(v) for v in outs]
