"""split: trace forward + vjp into one flat jaxpr and classify each equation.

Contract: `split(flat_fun, in_avals, n_grads, param_names) -> Split`.

`flat_fun(ct, *leaves)` must return `(value, *aux, *grads)` with the `n_grads`
parameter gradients last, where every backward equation depends on the scalar
cotangent `ct`. Equations are then classified:

* FORWARD: does not depend on `ct`.
* DX: depends on `ct` and reaches two or more gradient outputs. This is the
  critical path: the next layer's backward is waiting for it.
* DW: depends on `ct` and reaches exactly one gradient output. Nothing else is
  waiting for it, so it may run out of order (a "cluster" per parameter).
* DEAD: depends on `ct` and reaches no gradient output (DCE'd when emitted).

Call-like equations (`jit`/`pjit`, `closed_call`, `custom_jvp_call`,
`custom_vjp_call`, `checkpoint`) that read the cotangent are inlined first so
that their insides are classified too (the others are all FORWARD and stay
whole: fewer equations to re-bind and lower); a backward `scan` is split into
a B-scan and W-scans (`REWRITE_RULES`, filled by `passes.scan`); other
higher-order equations (while, cond, scans that do not split) are kept whole
and reported in `Split.opaque`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from ooojax.passes import _compat
from ooojax.passes.ir import Cluster, Kind, Split

# --- rewrite rules for backward equations: primitive name -> eqn -> new eqns ---
# Filled by the packages that own them: `passes.scan` registers "scan" (a
# backward scan becomes a B-scan for the dX chain and W-scans for the dW).
RewriteRule = Callable[[Any], "Sequence[Any] | None"]
REWRITE_RULES: dict[str, RewriteRule] = {}


def _needs_inline(jaxpr) -> bool:
  return any(_compat.is_call(e) for e in jaxpr.eqns)


def _eval_inlined(jaxpr, consts, args, stats: dict) -> list[Any]:
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, _compat.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    call = _compat.call_body(eqn)
    if call is not None:
      inner, inner_consts, prevent = call
      if prevent is True:
        invals = list(jax.lax.optimization_barrier(invals))
      elif isinstance(prevent, tuple) and any(prevent):
        barred = jax.lax.optimization_barrier([x for x, p in zip(invals, prevent) if p])
        it = iter(barred)
        invals = [next(it) if p else x for x, p in zip(invals, prevent)]
      outs = _eval_inlined(inner, inner_consts, invals, stats)
      stats["inlined"] = stats.get("inlined", 0) + 1
    else:
      outs = _compat.bind_eqn(eqn, invals)
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, _compat.DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


class _NeedsRetrace(Exception):
  """An inline needs new equations (remat's CSE barrier): re-trace instead."""


def _inline_by_substitution(closed, stats: dict):
  jaxpr = closed.jaxpr
  const_vars, const_vals = list(jaxpr.constvars), list(closed.consts)
  eqns: list = []

  # A call that does not depend on the cotangent is all FORWARD: classifying
  # needs nothing inside it, so it stays one equation (fewer to re-bind and lower).
  tainted = {jaxpr.invars[0]}

  def walk(inner, sub: dict, fresh: bool):
    for eqn in inner.eqns:
      invars = [sub.get(v, v) if isinstance(v, _compat.Var) else v for v in eqn.invars]
      bwd = any(isinstance(v, _compat.Var) and v in tainted for v in invars)
      call = _compat.call_body(eqn) if bwd else None
      if call is None:
        outvars = eqn.outvars
        if fresh:
          outvars = [
            v if isinstance(v, _compat.DropVar) else _compat.new_var(v.aval) for v in eqn.outvars
          ]
          sub.update(zip(eqn.outvars, outvars))
        if bwd:
          tainted.update(outvars)
        same = not fresh and all(a is b for a, b in zip(invars, eqn.invars))
        eqns.append(eqn if same else eqn.replace(invars=invars, outvars=outvars))
        continue
      body, body_consts, prevent = call
      if prevent is True or (isinstance(prevent, tuple) and any(prevent)):
        raise _NeedsRetrace
      m: dict = {}
      for v, c in zip(body.constvars, body_consts):
        nv = _compat.new_var(v.aval)
        const_vars.append(nv)
        const_vals.append(c)
        m[v] = nv
      m.update(zip(body.invars, invars))
      walk(body, m, True)
      for ov, iv in zip(eqn.outvars, body.outvars):
        sub[ov] = m.get(iv, iv) if isinstance(iv, _compat.Var) else iv
      stats["inlined"] = stats.get("inlined", 0) + 1

  top: dict = {}
  walk(jaxpr, top, False)
  walk = None  # noqa: F841 - its self-reference kept `eqns` (every equation) alive until a GC
  ct, *rest = jaxpr.invars
  outvars = [top.get(v, v) if isinstance(v, _compat.Var) else v for v in jaxpr.outvars]
  flat = _compat.open_jaxpr(
    [],
    [ct, *const_vars, *rest],
    outvars,
    eqns,
    jaxpr.effects,
    _compat.flat_debug_info(jaxpr, len(const_vars)),
  )
  return _compat.closed(flat), tuple(const_vals)


def _inline_by_retrace(closed, stats: dict):
  jaxpr, consts = closed.jaxpr, list(closed.consts)
  # the inputs' own types: under shard_map(check_vma=True) they say what varies
  ct_aval, *rest = [_compat.shape_dtype(v.aval) for v in jaxpr.invars]
  const_avals = [_compat.shape_dtype(v.aval) for v in jaxpr.constvars]

  def flat(ct, consts_, *args):
    return _eval_inlined(jaxpr, consts_, [ct, *args], stats)

  return jax.make_jaxpr(flat)(ct_aval, const_avals, *rest), tuple(consts)


def inline_calls(closed, stats: dict | None = None):
  """Returns `(jaxpr, const_values)`: a flat jaxpr taking `(ct, *consts, *rest)`.

  The closed jaxpr's consts become ordinary inputs after `ct`, so the result
  can be re-bound in any trace (consts may be tracers of an outer trace).
  Inlining substitutes variables (cheap); a remat that must keep its CSE
  barrier is inlined by re-tracing instead, which inserts the barrier.
  """
  stats = {} if stats is None else stats
  if not closed.consts and not _needs_inline(closed.jaxpr):
    return closed, ()
  try:
    return _inline_by_substitution(closed, stats)
  except _NeedsRetrace:
    stats.clear()
    return _inline_by_retrace(closed, stats)


# --- classification ----------------------------------------------------------
_MANY = -2  # reaches two or more gradients


def _join(a: int, b: int) -> int:
  if a == -1:
    return b
  if b == -1 or a == b:
    return a
  return _MANY


def classify(jaxpr, n_grads: int) -> tuple[tuple[Kind, ...], tuple[int, ...]]:
  """Per-equation kinds and, for DW equations, the gradient leaf they feed."""
  ct = jaxpr.invars[0]
  tainted = {ct}
  bwd = []
  for eqn in jaxpr.eqns:
    b = any(isinstance(v, _compat.Var) and v in tainted for v in eqn.invars)
    if b:
      tainted.update(eqn.outvars)
    bwd.append(b)

  # reach[v]: -1 none, i one gradient leaf, _MANY several.
  reach: dict[Any, int] = {}
  first = len(jaxpr.outvars) - n_grads
  for i, v in enumerate(jaxpr.outvars[first:]):
    if isinstance(v, _compat.Var):
      reach[v] = _join(reach.get(v, -1), i)
  eqn_reach = [-1] * len(jaxpr.eqns)
  for k in range(len(jaxpr.eqns) - 1, -1, -1):
    eqn = jaxpr.eqns[k]
    r = -1
    for v in eqn.outvars:
      r = _join(r, reach.get(v, -1))
    eqn_reach[k] = r
    if r != -1:
      for v in eqn.invars:
        if isinstance(v, _compat.Var):
          reach[v] = _join(reach.get(v, -1), r)

  kinds, leaf = [], []
  for eqn, b, r in zip(jaxpr.eqns, bwd, eqn_reach):
    if not b:
      kinds.append(Kind.FORWARD)
      leaf.append(-1)
    elif r == _MANY or (r == -1 and eqn.effects):
      kinds.append(Kind.DX)
      leaf.append(-1)
    elif r == -1:
      kinds.append(Kind.DEAD)
      leaf.append(-1)
    else:
      kinds.append(Kind.DW)
      leaf.append(r)
  return tuple(kinds), tuple(leaf)


def split(
  flat_fun: Callable[..., Sequence[Any]],
  in_avals: Sequence[Any],
  n_grads: int,
  param_names: Sequence[str],
) -> Split:
  """Traces `flat_fun(ct, *leaves)` and classifies its equations.

  Args:
    flat_fun: `(ct, *leaves) -> (value, *aux, *grads)`; see the module docstring.
    in_avals: abstract values (`jax.ShapeDtypeStruct`) of `(ct, *leaves)`.
    n_grads: how many trailing outputs are parameter gradients.
    param_names: one readable name per gradient leaf.

  Returns:
    A `Split`. Example:

    >>> import jax, jax.numpy as jnp
    >>> def f(ct, w, x):
    ...   y, vjp = jax.vjp(lambda w: jnp.sum(jnp.tanh(x @ w)), w)
    ...   return (y, *vjp(ct))
    >>> avals = [jax.ShapeDtypeStruct((), jnp.float32),
    ...          jax.ShapeDtypeStruct((3, 2), jnp.float32),
    ...          jax.ShapeDtypeStruct((4, 3), jnp.float32)]
    >>> s = split(f, avals, n_grads=1, param_names=["w"])
    >>> len(s.clusters)
    1
  """
  closed = jax.make_jaxpr(flat_fun)(*in_avals)
  stats: dict = {}
  flat, consts = inline_calls(closed, stats)
  return from_flat(flat, consts, n_grads, param_names, stats.get("inlined", 0))


def _vars(atoms):
  return [v for v in atoms if isinstance(v, _compat.Var)]


def rewrite(flat, stats: dict | None = None, rules: dict[str, RewriteRule] | None = None):
  """Applies `rules` (default `REWRITE_RULES`) to the backward equations of a flat jaxpr.

  A backward equation is one that depends on the cotangent (`invars[0]`).
  Deterministic: structurally equal inputs give structurally equal outputs,
  so a cached split's equation indices hold for a re-traced equal program.

  Args:
    flat: a closed jaxpr whose first input is the loss cotangent.
    stats: if given, `stats["loops_split"]` counts rewritten equations and
      `stats["split_eqns"]` collects the ids of the equations they became.
    rules: primitive name -> equation -> replacement equations (None: keep).

  Returns:
    A closed jaxpr with the same inputs and outputs.
  """
  rules = REWRITE_RULES if rules is None else rules
  jaxpr = flat.jaxpr
  if not any(e.primitive.name in rules for e in jaxpr.eqns):
    return flat  # nothing to rewrite: skip the taint walk
  tainted = {jaxpr.invars[0]}
  eqns, n = [], 0
  made: set[int] = set()
  for e in jaxpr.eqns:
    bwd = any(v in tainted for v in _vars(e.invars))
    if bwd:
      tainted.update(e.outvars)
    rule = rules.get(e.primitive.name) if bwd else None
    new = rule(e) if rule is not None else None
    if new is None:
      eqns.append(e)
      continue
    n += 1
    eqns.extend(new)
    made.update(id(x) for x in new)
  if not n:
    return flat
  if stats is not None:
    stats["loops_split"] = stats.get("loops_split", 0) + n
    stats.setdefault("split_eqns", set()).update(made)
  return _compat.closed(jaxpr.replace(eqns=eqns), flat.consts)


def from_flat(
  flat, consts: Sequence[Any], n_grads: int, param_names: Sequence[str], inlined: int = 0
) -> Split:
  """Classifies an already traced and inlined `(flat, consts)` (see `inline_calls`).

  Backward scans are split into B-scans and W-scans first (`REWRITE_RULES`).
  """
  stats: dict = {"inlined": inlined}
  flat = rewrite(flat, stats)  # B-scan / W-scans
  jaxpr = flat.jaxpr
  kinds, leaf = classify(jaxpr, n_grads)

  by_leaf: dict[int, list[int]] = {}
  for k, (kind, l) in enumerate(zip(kinds, leaf)):
    if kind is Kind.DW:
      by_leaf.setdefault(l, []).append(k)
  clusters, cluster_of = [], [-1] * len(kinds)
  for ci, l in enumerate(sorted(by_leaf, key=lambda l: by_leaf[l][0])):
    clusters.append(
      Cluster(ci, param_names[l], len(jaxpr.outvars) - n_grads + l, tuple(by_leaf[l]))
    )
    for k in by_leaf[l]:
      cluster_of[k] = ci
  made = stats.get("split_eqns", set())
  opaque = tuple(
    e.primitive.name
    for e in jaxpr.eqns
    if e.primitive.name not in _COMBINER_PRIMS
    and id(e) not in made
    and not _compat.is_call(e)  # forward-only calls
    and _has_subjaxpr(e)
  )
  return Split(
    flat,
    tuple(consts),
    kinds,
    tuple(cluster_of),
    tuple(clusters),
    len(jaxpr.outvars) - n_grads,
    stats.get("inlined", 0),
    opaque,
    stats.get("loops_split", 0),
  )


# Their sub-jaxprs are scalar combiners, not program regions to look inside.
_COMBINER_PRIMS = frozenset(
  {
    "scatter",
    "scatter-add",
    "scatter_add",
    "scatter-mul",
    "scatter_mul",
    "scatter-min",
    "scatter_min",
    "scatter-max",
    "scatter_max",
    "reduce",
    "reduce_window",
    "select_and_scatter",
    "argsort",
    "sort",
  }
)


# primitive -> whether its equations hold jaxprs. Looked up once per primitive: a
# primitive's params have one schema (a scan always has a body, an add never does).
_SUBJAXPRS: dict = {}


def _has_subjaxpr(eqn) -> bool:
  known = _SUBJAXPRS.get(eqn.primitive)
  if known is None:
    known = _SUBJAXPRS[eqn.primitive] = any(True for _ in _compat.subjaxprs(eqn))
  return known
