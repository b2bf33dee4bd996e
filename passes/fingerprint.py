"""fingerprint: a jaxpr's structure as a hashable key, to reuse a split's plan.

A plan (equation kinds, clusters, schedule) indexes equations by position and
depends only on the program's wiring, primitives, shapes and parameters, never
on literal or constant values. Two traces with equal fingerprints can share a
plan; the equations themselves are always taken from the newest trace.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from ooojax.passes import _compat


def _param(x) -> Any:
  if isinstance(x, _compat.ClosedJaxpr):
    return ("closed", fingerprint(x.jaxpr))
  if isinstance(x, _compat.Jaxpr):
    return ("jaxpr", fingerprint(x))
  if isinstance(x, (tuple, list)):
    return tuple(_param(y) for y in x)
  t = type(x)
  if (callable(x) and not isinstance(x, type)) or hasattr(x, "call_wrapped"):
    return ("fn", t.__name__)  # rules and thunks (lu.WrappedFun): new objects every trace
  if t.__eq__ is object.__eq__ and not isinstance(x, enum.Enum):
    return ("obj", t.__name__)  # compared by identity: would never match a new trace
  try:
    hash(x)
  except TypeError:
    return ("?", t.__name__)
  return x


def fingerprint(jaxpr) -> tuple:
  """Hashable structure of `jaxpr`: wiring, primitives, avals, params, effects.

  Literal values and constant values are left out (a plan never depends on
  them). Example:

  >>> import jax, jax.numpy as jnp
  >>> a = jax.make_jaxpr(lambda x: x * 2.0)(1.0).jaxpr
  >>> b = jax.make_jaxpr(lambda x: x * 3.0)(1.0).jaxpr
  >>> fingerprint(a) == fingerprint(b)
  True
  """
  ids: dict = {}
  Literal = _compat.Literal

  def ref(v):
    if isinstance(v, Literal):
      return ("L", v.aval)
    return ids[v]

  for v in (*jaxpr.constvars, *jaxpr.invars):
    ids[v] = len(ids)
  eqns = []
  for e in jaxpr.eqns:
    ins = tuple(ref(v) for v in e.invars)
    for v in e.outvars:
      ids[v] = len(ids)
    params = tuple((k, _param(p)) for k, p in _compat.param_items(e))
    eqns.append(
      (
        e.primitive.name,
        ins,
        tuple(v.aval for v in e.outvars),
        params,
        tuple(e.effects) if e.effects else (),
      )
    )
  heads = (tuple(v.aval for v in jaxpr.constvars), tuple(v.aval for v in jaxpr.invars))
  return heads, tuple(eqns), tuple(ref(v) for v in jaxpr.outvars)


def _exact(x) -> Any:
  # Values as they are, except where `==` is too coarse for "computes the same":
  # floats (0.0 == -0.0, nan != nan), arrays, and objects compared by identity
  # (jaxprs, rules): those by `id`, which the caller keeps alive.
  if isinstance(x, float):
    return ("f", x.hex())
  if isinstance(x, np.ndarray):
    return ("a", x.dtype.str, x.shape, x.tobytes())
  if isinstance(x, (tuple, list)):
    return (type(x), tuple(_exact(y) for y in x))
  if isinstance(x, (_compat.ClosedJaxpr, _compat.Jaxpr)) or callable(x):
    return ("id", id(x))
  try:
    hash(x)
  except TypeError:
    return ("id", id(x))
  return x


def _literal(v) -> Any:
  val = np.asarray(v.val)
  return ("L", v.aval, val.dtype.str, val.shape, val.tobytes())


def exact_key(eqns, ins, outs) -> tuple:
  """A key two equation clusters share only if they compute the same function.

  Unlike `fingerprint`, literal values and parameters count exactly (objects
  such as jaxprs by identity): a function built from one cluster then
  computes any cluster with an equal key, given that cluster's `ins` in order
  and giving its `outs` in order. Keep the first cluster's equations alive
  while the key is in use (identities are part of it).
  """
  ids = {v: i for i, v in enumerate(ins)}
  Literal = _compat.Literal
  rows = [tuple(v.aval for v in ins)]
  for e in eqns:
    refs = tuple(_literal(v) if isinstance(v, Literal) else ids[v] for v in e.invars)
    for v in e.outvars:
      ids[v] = len(ids)
    rows.append(
      (
        e.primitive,
        refs,
        tuple(v.aval for v in e.outvars),
        tuple((k, _exact(p)) for k, p in _compat.param_items(e)),
        tuple(e.effects) if e.effects else (),
        getattr(e, "ctx", None),
      )
    )
  return tuple(rows), tuple(ids[v] for v in outs)


def value_key(x) -> Any:
  """An array's value as a key (by identity past 4096 elements: kept cheap)."""
  a = np.asarray(x)
  return (a.dtype.str, a.shape, a.tobytes()) if a.size <= 4096 else ("id", id(x))


def _structure_param(p, memo: dict) -> Any:
  if isinstance(p, _compat.JAXPR_TYPES):
    if id(p) not in memo:
      j = p.jaxpr
      memo[id(p)] = (
        "jaxpr",
        structure_key(j.eqns, [*j.constvars, *j.invars], j.outvars, memo),
        tuple(value_key(c) for c in getattr(p, "consts", ())),
      )
    return memo[id(p)]
  if isinstance(p, (tuple, list)):
    return tuple(_structure_param(q, memo) for q in p)
  if isinstance(p, float):
    return ("f", p.hex())
  if isinstance(p, np.ndarray):
    return value_key(p)
  try:
    hash(p)
  except TypeError:
    return ("id", id(p))
  # a custom_vjp's `bwd` is a WrappedFun (not callable, compared by identity): a rule
  rule = (callable(p) and not isinstance(p, type)) or hasattr(p, "call_wrapped")
  return ("fn", type(p).__name__) if rule else p


def structure_key(eqns, ins, outs, memo: dict | None = None) -> tuple:
  """Equal for two equation lists that compute the same function of `ins` -> `outs`.

  Between `fingerprint` and `exact_key`: literal values count, and jaxprs held in
  params (a remat's or a jit's body) by their structure and consts, so the
  separately traced bodies of two layers of a Python loop compare equal.
  Rules (functions in params) count by type only, as in `fingerprint`.
  `memo` caches keys of jaxprs by identity across calls.

  >>> import jax, jax.numpy as jnp
  >>> a = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(x) * 2.0))(1.0).jaxpr
  >>> b = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(x) * 2.0))(1.0).jaxpr
  >>> c = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(x) * 3.0))(1.0).jaxpr
  >>> key = lambda j: structure_key(j.eqns, j.invars, j.outvars)
  >>> key(a) == key(b), key(a) == key(c)
  (True, False)
  """
  memo = {} if memo is None else memo
  ids = {v: i for i, v in enumerate(ins)}
  rows: list = [tuple(v.aval for v in ins)]
  for e in eqns:
    refs = tuple(
      ("L", v.aval, value_key(v.val)) if isinstance(v, _compat.Literal) else ids[v]
      for v in e.invars
    )
    for v in e.outvars:
      ids[v] = len(ids)
    rows.append(
      (
        e.primitive.name,
        refs,
        tuple(v.aval for v in e.outvars),
        tuple((k, _structure_param(p, memo)) for k, p in _compat.param_items(e)),
      )
    )
  return tuple(rows), tuple(ids.get(v, ("L", repr(v))) for v in outs)
