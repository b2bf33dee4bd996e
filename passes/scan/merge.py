"""scan.merge: run independent scans over the same length as ONE scan.

Contract: `merge_scans(eqns) -> eqn | None` for a sequence of `scan`
equations, and `merge_runs(jaxpr, ids) -> (jaxpr, new_index)` merging every
run of consecutive mergeable scans among the equations `ids` of a jaxpr.

`passes.scan.split` turns a backward scan over layers into a B-scan and one
W-scan per stacked parameter (a flax layer has a dozen), each a loop over the
same layers. Where they run together (the W phase of a pipeline stage), one
loop whose step computes every parameter's dW of that layer does the same
work with one loop instead of one per parameter: on a GPU every trip of a
`while` costs a predicate read-back and launch overhead, so this trims
#W-scans x layers trips to layers trips. The merged equation defines exactly
the merged equations' output variables and reads the union of their inputs;
nothing is computed twice or in a different order within a body.

>>> import jax, jax.numpy as jnp
>>> def two(w, v, h):
...   f = lambda h, w: (h * w, jnp.sum(w * h))
...   return jax.lax.scan(f, h, w)[1], jax.lax.scan(f, h, v)[1]
>>> j = jax.make_jaxpr(two)(jnp.ones((3, 2)), jnp.ones((3, 2)), jnp.ones(2)).jaxpr
>>> m = merge_scans(j.eqns)
>>> from ooojax.passes._compat import scan_info
>>> scan_info(m).length, scan_info(m).num_carry, len(m.outvars)
(3, 2, 4)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ooojax.passes import _compat


def _vars(atoms):
  return [v for v in atoms if isinstance(v, _compat.Var)]


def _key(eqn):
  return _compat.scan_info(eqn).loop_key


def mergeable(eqn) -> bool:
  """A scan without effects (its body's equations are free to interleave)."""
  return (
    _compat.is_scan(eqn)
    and not eqn.effects
    and not any(e.effects for e in _compat.scan_info(eqn).body.jaxpr.eqns)
  )


def merge_scans(eqns: Sequence[Any]):
  """One scan equation computing all outputs of `eqns`; None if they cannot merge.

  Args:
    eqns: `scan` equations with equal length, direction and unroll, none
      reading another's outputs, and bodies without effects.

  Returns:
    A `scan` equation whose outvars are the concatenation of the inputs'
    outvars (carries first, then ys, in the order of `eqns`), or None (fewer
    than two equations, or a condition above fails). An outer variable that
    several scans read as a const or xs (W-scans of one split share the
    residuals and the layer weights) is passed once.
  """
  eqns = list(eqns)
  if len(eqns) < 2 or not all(mergeable(e) for e in eqns):
    return None
  if len({_key(e) for e in eqns}) != 1:
    return None
  outs = {v for e in eqns for v in e.outvars}
  if any(v in outs for e in eqns for v in _vars(e.invars)):
    return None  # one reads another: they must run one after the other
  # Bodies are copied with fresh variables (two scans may share one traced body).
  consts: dict = {}  # outer atom -> (merged body var, outer atom)
  xs: dict = {}
  carries: list = []  # (merged body var, outer atom)
  constvars, constvals = [], []
  body_eqns: list = []
  carry_out, ys_out = [], []
  infos = [_compat.scan_info(e) for e in eqns]
  for e, info in zip(eqns, infos):
    cj = info.body
    body = cj.jaxpr
    nc, nk = info.num_consts, info.num_carry
    sub: dict = {}
    for v, c in zip(body.constvars, cj.consts):
      sub[v] = _compat.new_var(v.aval)
      constvars.append(sub[v])
      constvals.append(c)
    for i, (v, a) in enumerate(zip(body.invars, e.invars)):
      if nc <= i < nc + nk:
        sub[v] = _compat.new_var(v.aval)
        carries.append((sub[v], a))
        continue
      pool = consts if i < nc else xs
      key = a if isinstance(a, _compat.Var) else ("literal", len(pool))
      if key not in pool:
        pool[key] = (_compat.new_var(v.aval), a)
      sub[v] = pool[key][0]
    for be in body.eqns:
      ins = [sub.get(v, v) if isinstance(v, _compat.Var) else v for v in be.invars]
      new_outs = [
        v if isinstance(v, _compat.DropVar) else _compat.new_var(v.aval) for v in be.outvars
      ]
      sub.update(zip(be.outvars, new_outs))
      body_eqns.append(be.replace(invars=ins, outvars=new_outs))
    fix = lambda v, sub=sub: sub.get(v, v) if isinstance(v, _compat.Var) else v  # noqa: E731
    carry_out += [fix(v) for v in body.outvars[:nk]]
    ys_out += [fix(v) for v in body.outvars[nk:]]
  first = infos[0].body.jaxpr
  dbg = getattr(first, "debug_info", None)
  if dbg is not None and hasattr(dbg, "with_unknown_names"):
    dbg = dbg.with_unknown_names()
  ins = [*consts.values(), *carries, *xs.values()]
  j = _compat.open_jaxpr(
    constvars, [v for v, _ in ins], [*carry_out, *ys_out], body_eqns, first.effects, dbg
  )
  outvars = [v for e, i in zip(eqns, infos) for v in e.outvars[: i.num_carry]] + [
    v for e, i in zip(eqns, infos) for v in e.outvars[i.num_carry :]
  ]
  return _compat.scan_eqn(
    eqns[0],
    body=_compat.closed(j, constvals),
    num_consts=len(consts),
    num_carry=len(carries),
    invars=[a for _, a in ins],
    outvars=outvars,
  )


def merge_runs(jaxpr, ids: Sequence[int]):
  """Merges each run of consecutive mergeable scans among `jaxpr.eqns[ids]`.

  Args:
    jaxpr: an open Jaxpr.
    ids: equation indices, in execution order, of one phase (e.g. a
      pipeline stage's W phase): only scans adjacent in this list merge.

  Returns:
    `(new_jaxpr, new_index)`: `new_index[k]` is equation k's index in the
    new jaxpr; merged equations all map to the merged one, which takes the
    place of the run's last equation (every input of the run is defined by
    then, and no other equation of the phase sits between them).
  """
  runs: list[list[int]] = []
  for k in ids:
    e = jaxpr.eqns[k]
    if (
      runs
      and mergeable(e)
      and mergeable(jaxpr.eqns[runs[-1][-1]])
      and _key(e) == _key(jaxpr.eqns[runs[-1][-1]])
      and not set(_vars(e.invars)) & {v for i in runs[-1] for v in jaxpr.eqns[i].outvars}
    ):
      runs[-1].append(k)
    else:
      runs.append([k])
  replace: dict[int, Any] = {}
  for run in runs:
    if len(run) < 2:
      continue
    outs = {v for k in run for v in jaxpr.eqns[k].outvars}
    between = set(range(run[0], run[-1])) - set(run)
    if any(outs & set(_vars(jaxpr.eqns[k].invars)) for k in between):
      continue  # an equation of another phase reads an early member's result
    m = merge_scans([jaxpr.eqns[k] for k in run])
    if m is not None:
      replace.update({k: run[-1] for k in run[:-1]})
      replace[run[-1]] = m
  if not replace:
    return jaxpr, {k: k for k in range(len(jaxpr.eqns))}
  eqns, new_index = [], {}
  for k, e in enumerate(jaxpr.eqns):
    if isinstance(replace.get(k), int):
      continue
    new_index[k] = len(eqns)
    eqns.append(replace.get(k, e))
  for k, to in replace.items():
    if isinstance(to, int):
      new_index[k] = new_index[to]
  return jaxpr.replace(eqns=eqns), new_index
