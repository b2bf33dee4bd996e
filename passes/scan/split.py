"""scan.split: split a backward scan into a B-scan (the dX chain) and W-scans (dW).

Contract: `split_scan(eqn) -> ScanSplit | None` for one `scan` equation;
registered as `passes.split`'s rewrite rule for backward scans, which it
applies before classifying.

The backward of a scan over layers is one scan (JAX's `_scan_transpose*`)
whose carry holds the cotangent flowing through the layers (dX) and the
accumulated cotangents of non-scanned operands, and whose ys are the
cotangents of the scanned operands: with weights scanned, the stacked
per-layer dW. `split_scan` partitions the body's equations:

* B: the backward slice of the *chain* carries. A carry is a chain carry
  unless its input reaches no output but its own carry output (such a carry
  is an accumulator, e.g. the dW of a weight shared by every step).
* W: everything else that feeds an output, grouped per output; an equation
  two groups share is moved to B (and its result passed on) rather than
  computed twice, unless it reads an accumulator, in which case the groups
  merge.

The B-scan computes B, keeps the chain carries, and emits as extra ys the
values the W groups read (the residuals, e.g. the layer input and the
cotangent of its output); each W-scan is a scan over the same length and
direction with only its own accumulator carries (none when the weights are
scanned: a map over layers) that reads those residuals as xs. Nothing is
computed twice, so recomputed forward work under `jax.checkpoint` stays in
the B-scan once. Both are ordinary `scan` equations: they compose with jit,
vmap and grad like any scan. The cost is memory: the residuals are stacked
over the length (what a layer's dW needs: typically its input and the
cotangent of its output), as when dW of unrolled layers runs late.

>>> import jax, jax.numpy as jnp
>>> def f(w, x):
...   return jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0])
>>> jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(jnp.ones((3, 4, 4)), jnp.ones((2, 4)))
>>> bwd = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"][-1]
>>> s = split_scan(bwd)
>>> from ooojax.passes._compat import scan_info
>>> len(s.w_eqns), scan_info(s.b_eqn).num_carry, scan_info(s.w_eqns[0]).num_carry
(1, 1, 0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ooojax.passes import _compat


@dataclasses.dataclass(frozen=True)
class ScanSplit:
  """One scan equation rewritten as a B-scan followed by W-scans.

  `b_eqn` keeps the chain carries and emits `residuals` (stacked over the
  scan length) as extra ys; each of `w_eqns` reads some of them and produces
  the original equation's remaining outputs. Together they define exactly the
  original equation's outputs (same variables).
  """

  b_eqn: Any
  w_eqns: tuple[Any, ...]
  residuals: tuple[Any, ...]  # outer variables, B-scan -> W-scans

  @property
  def eqns(self) -> tuple[Any, ...]:
    return (self.b_eqn, *self.w_eqns)


class _UnionFind:
  def __init__(self):
    self.parent: dict = {}

  def find(self, x):
    self.parent.setdefault(x, x)
    while self.parent[x] != x:
      self.parent[x] = self.parent[self.parent[x]]
      x = self.parent[x]
    return x

  def union(self, a, b):
    self.parent[self.find(a)] = self.find(b)


def _vars(atoms):
  return [v for v in atoms if isinstance(v, _compat.Var)]


def _slice(eqns, producer, roots, allowed=None) -> set[int]:
  """Indices of equations in the backward slice of `roots` (within `allowed`)."""
  out: set[int] = set()
  stack = [producer[v] for v in _vars(roots) if v in producer]
  while stack:
    k = stack.pop()
    if k in out or (allowed is not None and k not in allowed):
      continue
    out.add(k)
    stack.extend(producer[v] for v in _vars(eqns[k].invars) if v in producer)
  return out


def _inline_body(closed):
  """`closed` with call-like equations (jit, remat, custom_jvp/vjp calls) inlined.

  Inside a scan body a remat's CSE barrier guards nothing (the forward is
  another scan), so it is dropped, as JAX's own scan partial eval does.
  """
  if not any(_compat.is_call(e) for e in closed.jaxpr.eqns):
    return closed
  consts_v, consts_x = list(closed.jaxpr.constvars), list(closed.consts)
  out: list = []

  def walk(jaxpr, sub):
    for e in jaxpr.eqns:
      invars = [sub.get(v, v) if isinstance(v, _compat.Var) else v for v in e.invars]
      call = _compat.call_body(e)
      if call is None:
        outvars = [
          v if isinstance(v, _compat.DropVar) else _compat.new_var(v.aval) for v in e.outvars
        ]
        sub.update(zip(e.outvars, outvars))
        out.append(e.replace(invars=invars, outvars=outvars))
        continue
      inner, inner_consts, _ = call
      m: dict = {}
      for v, c in zip(inner.constvars, inner_consts):
        m[v] = _compat.new_var(v.aval)
        consts_v.append(m[v])
        consts_x.append(c)
      m.update(zip(inner.invars, invars))
      walk(inner, m)
      for ov, iv in zip(e.outvars, inner.outvars):
        sub[ov] = m.get(iv, iv) if isinstance(iv, _compat.Var) else iv

  top = {v: v for v in closed.jaxpr.invars}
  walk(closed.jaxpr, top)
  outvars = [top.get(v, v) if isinstance(v, _compat.Var) else v for v in closed.jaxpr.outvars]
  j = closed.jaxpr.replace(constvars=consts_v, eqns=out, outvars=outvars)
  return _compat.closed(j, consts_x)


def split_scan(eqn) -> ScanSplit | None:
  """Splits one `scan` equation into a B-scan and W-scans; None if nothing splits.

  Args:
    eqn: a `scan` jaxpr equation (typically JAX's transposed scan).

  Returns:
    A `ScanSplit` whose equations replace `eqn` in order, or None when the
    body has effects, has no chain carry, or has no work off the chain.

  >>> import jax, jax.numpy as jnp
  >>> j = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda c, x: (c * 2, x * c), c, xs))
  >>> s = split_scan(j(1.0, jnp.ones(3)).jaxpr.eqns[0])
  >>> from ooojax.passes._compat import scan_info
  >>> [scan_info(e).num_carry for e in s.eqns]
  [1, 0]
  """
  if not _compat.is_scan(eqn) or eqn.effects:
    return None
  info = _compat.scan_info(eqn)
  closed = _inline_body(info.body)
  body = closed.jaxpr
  if body.effects or any(e.effects for e in body.eqns):
    return None
  nc, nk = info.num_consts, info.num_carry
  consts_in, carry_in, xs_in = (body.invars[:nc], body.invars[nc : nc + nk], body.invars[nc + nk :])
  carry_out, ys_out = body.outvars[:nk], body.outvars[nk:]
  eqns = body.eqns
  producer = {v: k for k, e in enumerate(eqns) for v in e.outvars}

  # A carry whose input reaches nothing but its own output is an accumulator
  # (off the chain); every other carry is on the chain.
  chain = []
  for c, v in enumerate(carry_in):
    seen = {v}
    for e in eqns:
      if any(u in seen for u in _vars(e.invars)):
        seen.update(e.outvars)
    touched = {j for j, o in enumerate(body.outvars) if isinstance(o, _compat.Var) and o in seen}
    chain.append(bool(touched - {c}))
  if not any(chain):
    return None
  b_carries = [c for c in range(nk) if chain[c]]
  w_carries = [c for c in range(nk) if not chain[c]]
  b_set = _slice(eqns, producer, [carry_out[c] for c in b_carries])
  w_carry_in = {carry_in[c]: c for c in w_carries}

  # W outputs: ("y", i) or ("c", c); each with its slice of W equations.
  def is_w_value(v):
    return isinstance(v, _compat.Var) and (
      (v in producer and producer[v] not in b_set) or v in w_carry_in
    )

  w_outs = [("c", c) for c in w_carries]
  w_outs += [("y", i) for i, v in enumerate(ys_out) if is_w_value(v)]
  if not w_outs:
    return None
  out_var = {("c", c): carry_out[c] for c in w_carries}
  out_var.update({("y", i): ys_out[i] for i in range(len(ys_out))})
  w_pool = set(range(len(eqns))) - b_set
  slices = {o: _slice(eqns, producer, [out_var[o]], w_pool) for o in w_outs}

  # Which accumulators each W equation depends on (transitively).
  dep: dict[int, set[int]] = {}
  for k in sorted(w_pool):
    d: set[int] = set()
    for v in _vars(eqns[k].invars):
      if v in w_carry_in:
        d.add(w_carry_in[v])
      elif v in producer and producer[v] in dep:
        d |= dep[producer[v]]
    dep[k] = d

  uf = _UnionFind()
  for o in w_outs:
    uf.find(o)
  for c in w_carries:  # an accumulator's group holds every output that reads it
    for o in w_outs:
      if out_var[o] is carry_in[c] or any(c in dep[k] for k in slices[o]):
        uf.union(o, ("c", c))
  owners: dict[int, list] = {}
  for o, s in slices.items():
    for k in s:
      owners.setdefault(k, []).append(o)
  promoted = set()
  for k, os_ in owners.items():
    if len(os_) > 1:
      if dep[k]:
        for o in os_[1:]:
          uf.union(os_[0], o)
      else:
        promoted.add(k)  # shared and accumulator-free: compute once, in B
  b_set |= promoted
  # An output a promoted equation computes is now a B output.
  w_outs = [o for o in w_outs if o[0] == "c" or is_w_value(out_var[o])]
  groups: dict[Any, list] = {}
  for o in w_outs:
    groups.setdefault(uf.find(o), []).append(o)
  groups_list = [sorted(g, key=lambda o: (o[0] != "c", o[1])) for g in groups.values()]
  groups_list.sort(key=lambda g: min(o[1] if o[0] == "y" else -1 - o[1] for o in g))
  w_eqn_sets = [sorted(set().union(*(slices[o] for o in g)) - promoted) for g in groups_list]
  if not any(w_eqn_sets) and not w_carries:
    return None  # all W outputs are B values: nothing off the chain

  # Residuals: values W groups read that B computes (or B carry inputs).
  b_carry_in = {carry_in[c] for c in b_carries}
  consts_pos = {v: i for i, v in enumerate(consts_in)}
  xs_pos = {v: i for i, v in enumerate(xs_in)}

  def reads(ks, outs):
    rd = []
    for k in ks:
      rd += _vars(eqns[k].invars)
    rd += _vars(outs)
    defined = {v for k in ks for v in eqns[k].outvars}
    return [v for v in dict.fromkeys(rd) if v not in defined]

  group_reads = [reads(ks, [out_var[o] for o in g]) for ks, g in zip(w_eqn_sets, groups_list)]
  residuals = [
    v
    for v in dict.fromkeys(v for r in group_reads for v in r)
    if (v in producer and producer[v] in b_set) or v in b_carry_in
  ]

  length = info.length
  outer_in = eqn.invars
  outer_consts, outer_init, outer_xs = (outer_in[:nc], outer_in[nc : nc + nk], outer_in[nc + nk :])
  dbg = getattr(body, "debug_info", None)
  if dbg is not None and hasattr(dbg, "with_unknown_names"):
    dbg = dbg.with_unknown_names()

  def make_scan(b_eqns, consts, carries, xs, outs, outer_ins, outer_outs):
    j = _compat.open_jaxpr(
      body.constvars, [*consts, *carries, *xs], outs, b_eqns, body.effects, dbg
    )
    return _compat.scan_eqn(
      eqn,
      body=_compat.closed(j, closed.consts),
      num_consts=len(consts),
      num_carry=len(carries),
      invars=outer_ins,
      outvars=outer_outs,
    )

  # B-scan.
  b_ks = sorted(b_set)
  b_ys = [i for i in range(len(ys_out)) if ("y", i) not in w_outs]
  b_outs = [carry_out[c] for c in b_carries] + [ys_out[i] for i in b_ys] + residuals
  b_need = set(reads(b_ks, b_outs))
  b_consts = [v for v in consts_in if v in b_need]
  b_xs = [v for v in xs_in if v in b_need]
  res_outer = [_compat.new_var(_compat.stacked_aval(length, v.aval)) for v in residuals]
  b_eqn = make_scan(
    [eqns[k] for k in b_ks],
    b_consts,
    [carry_in[c] for c in b_carries],
    b_xs,
    b_outs,
    [outer_consts[consts_pos[v]] for v in b_consts]
    + [outer_init[c] for c in b_carries]
    + [outer_xs[xs_pos[v]] for v in b_xs],
    [eqn.outvars[c] for c in b_carries] + [eqn.outvars[nk + i] for i in b_ys] + res_outer,
  )

  # W-scans.
  res_outer_of = dict(zip(residuals, res_outer))
  w_eqns = []
  for ks, g, rd in zip(w_eqn_sets, groups_list, group_reads):
    cs = [o[1] for o in g if o[0] == "c"]
    ys = [o[1] for o in g if o[0] == "y"]
    w_consts = [v for v in consts_in if v in rd]
    w_xs = [v for v in xs_in if v in rd]
    w_res = [v for v in residuals if v in rd]
    w_eqns.append(
      make_scan(
        [eqns[k] for k in ks],
        w_consts,
        [carry_in[c] for c in cs],
        w_xs + w_res,
        [carry_out[c] for c in cs] + [ys_out[i] for i in ys],
        [outer_consts[consts_pos[v]] for v in w_consts]
        + [outer_init[c] for c in cs]
        + [outer_xs[xs_pos[v]] for v in w_xs]
        + [res_outer_of[v] for v in w_res],
        [eqn.outvars[c] for c in cs] + [eqn.outvars[nk + i] for i in ys],
      )
    )
  return ScanSplit(b_eqn, tuple(w_eqns), tuple(res_outer))


def split_scan_rule(eqn) -> Sequence[Any] | None:
  """`split_scan` as a `passes.split` rewrite rule: the replacement equations, or None."""
  s = split_scan(eqn)
  return None if s is None else s.eqns
