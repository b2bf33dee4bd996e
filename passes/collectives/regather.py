"""collectives.regather: ZeRO-3, each parameter gathered where it is used, and again in the backward.

Contract: `regather(flat, first_dyn, gather, axis_name) -> ClosedJaxpr`;
`regathered(flat, n_consts, dyn, gathered, axis_name)` finds the leaves by
identity among the traced dynamic leaves (`ooojax._dp_gspmd`).

`flat` is the inlined forward + vjp jaxpr (`passes.split.inline_calls`:
inputs `(ct, *consts, *dyn)`), traced with some parameters at their full
(gathered) shape. `gather` maps those dynamic leaves' positions to
`Gather(dim, shard)`: the dimension they are split over on `axis_name` and
the struct of one device's shard. The result takes the shards in their
place and all-gathers each one at its *sites*:

* in the forward, just before the first equation that reads it (XLA's
  latency-hiding scheduler starts the async all-gather under the previous
  layer's GEMMs, as it does for a plain sharded jit);
* in the backward, just before the first backward equation that reads it,
  again: the full weight is not kept from the forward, which is what holds
  1/N of the parameters;
* a weight read again after `GAP` other sites (a tied embedding: the
  lookup, then the output projection) is gathered again there.

Sites whose readers read one input (a layer's q, k and v projections) form
a *group*. Each group's gathers are tied (`collectives.emit.chain_after`: a
barrier and an exact zero taken from the value, a data edge XLA keeps) to
the previous group's input (an activation in the forward, a cotangent in the
backward) and to its last gathered weight. So a group's gather may start
while the previous group's GEMMs run (prefetch, one group ahead: XLA's
latency-hiding scheduler puts them in its window) but no earlier; XLA's
all-gather combiner cannot merge two groups' gathers (it merges only
independent ones); CSE cannot merge the backward's gather with the
forward's; and the backward's gathers read the cotangent, which makes them
backward work.

Cheap forward equations of one gathered value alone (a cast, a transpose,
a reshape) are recomputed at each site instead of being saved for the
backward. The gradient outputs keep their full shape: the bucket emitter
reduce-scatters them (`passes.collectives.emit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ooojax.passes import _compat
from ooojax.passes.collectives.emit import chain_after

# a value last gathered more than this many sites ago is gathered again
GAP = 4


@dataclasses.dataclass(frozen=True)
class Gather:
  """One FSDP leaf: the dimension split over the data axis, and its shard's struct."""

  dim: int
  shard: Any  # jax.ShapeDtypeStruct


@dataclasses.dataclass
class _Site:
  backward: bool
  opened: int  # the site counter when it was opened
  vals: dict  # var (the root or a chain value) -> its value at this site


@dataclasses.dataclass
class _Group:
  """Consecutive sites whose readers read one input (a layer's q, k and v)."""

  key: Any  # that input's var, or None
  ties: list  # what the group's gathers wait for
  anchor: Any  # that input's value: the next group's gathers wait for it
  last: Any = None  # the group's last gathered value: so does the next group


def _reader_input(reader, owner, on_ct):
  """The var of `reader`'s first input that is not a gathered value (with `on_ct`:
  that reads the cotangent), or None."""
  if reader is None:
    return None
  for v in reader.invars:
    if isinstance(v, _compat.Var) and v not in owner and (on_ct is None or v in on_ct):
      return v
  return None


def _tied(shard, ties):
  """`shard`, data-dependent on each of `ties` (an exact zero from each added, behind
  a barrier: `collectives.emit.chain_after`)."""
  for t in ties:
    (shard,) = chain_after([t], [shard])
  return shard


def _classify(jaxpr):
  """Per equation, whether it reads the cotangent (backward work)."""
  dep = {jaxpr.invars[0]}
  out = []
  for e in jaxpr.eqns:
    b = any(isinstance(v, _compat.Var) and v in dep for v in e.invars)
    if b:
      dep.update(e.outvars)
    out.append(b)
  return out, dep


def _chains(jaxpr, roots, backward):
  """var -> its root, for the roots and the values forward equations make from
  one root alone (casts, transposes, ...): recomputed at each site. Also
  var -> the equation index that makes it."""
  owner = {r: r for r in roots}
  made = {}
  for k, e in enumerate(jaxpr.eqns):
    if backward[k] or len(e.outvars) != 1 or e.effects or any(True for _ in _compat.subjaxprs(e)):
      continue
    ins = [v for v in e.invars if isinstance(v, _compat.Var)]
    if len(ins) == 1 and ins[0] in owner:
      owner[e.outvars[0]] = owner[ins[0]]
      made[e.outvars[0]] = k
  return owner, made


def regather(flat, first_dyn: int, gather: dict, axis_name):
  """`flat` taking shards for the leaves in `gather` (position -> `Gather`), each
  all-gathered at its sites (module docstring). Returns `flat` unchanged when
  `gather` is empty."""
  if not gather:
    return flat
  jaxpr = flat.jaxpr
  roots = {jaxpr.invars[first_dyn + i]: g for i, g in gather.items()}
  backward, on_ct = _classify(jaxpr)
  owner, made = _chains(jaxpr, roots, backward)
  chain_eqns = set(made.values())
  in_structs = [_compat.shape_dtype(v.aval) for v in jaxpr.invars]
  for i, g in gather.items():
    in_structs[first_dyn + i] = g.shard

  def run(*args):
    env: dict = dict(zip(jaxpr.constvars, flat.consts))
    env.update(zip(jaxpr.invars, args))
    sites: dict = {}  # root -> its current _Site
    count = [0]
    groups: dict = {False: None, True: None}  # phase -> its current _Group

    def read(v):
      return v.val if isinstance(v, _compat.Literal) else env[v]

    def group_for(is_bwd, reader) -> _Group:
      g = groups[is_bwd]
      key = _reader_input(reader, owner, on_ct if is_bwd else None)
      if g is not None and key is not None and g.key is key:
        return g
      if g is not None:  # after the previous group's input and gathered weights
        ties = [g.anchor, g.last]
      elif is_bwd and key is not None:  # the first backward group: its own cotangent
        ties = [env[key]]
      else:  # the first forward group: free
        ties = []
      g = groups[is_bwd] = _Group(key, ties, env[key] if key is not None else None)
      return g

    def open_site(root, is_bwd, reader):
      g = group_for(is_bwd, reader)
      shard = _tied(env[root], g.ties)
      full = jax.lax.all_gather(shard, axis_name, axis=roots[root].dim, tiled=True)
      g.last = full
      s = sites[root] = _Site(is_bwd, count[0], {root: full})
      count[0] += 1
      return s

    def value(v, s):
      if v not in s.vals:
        e = jaxpr.eqns[made[v]]
        ins = [
          value(u, s) if isinstance(u, _compat.Var) and u in owner else read(u) for u in e.invars
        ]
        s.vals[v] = _compat.bind_eqn(e, ins)[0]
      return s.vals[v]

    def site_read(v, is_bwd, reader):
      root = owner[v]
      s = sites.get(root)
      if s is None or s.backward != is_bwd or count[0] - s.opened > GAP:
        s = open_site(root, is_bwd, reader)
      return value(v, s)

    run_eqns: list = []
    for k, e in enumerate(jaxpr.eqns):
      if k in chain_eqns:
        continue
      if not any(isinstance(v, _compat.Var) and v in owner for v in e.invars):
        run_eqns.append(e)
        continue
      _compat.emit_eqns(run_eqns, env)
      run_eqns = []
      ins = [
        site_read(v, backward[k], e) if isinstance(v, _compat.Var) and v in owner else read(v)
        for v in e.invars
      ]
      for v, x in zip(e.outvars, _compat.bind_eqn(e, ins)):
        if not isinstance(v, _compat.DropVar):
          env[v] = x
    _compat.emit_eqns(run_eqns, env)
    return [
      site_read(v, True, None) if isinstance(v, _compat.Var) and v in owner else read(v)
      for v in jaxpr.outvars
    ]

  out = jax.make_jaxpr(run)(*in_structs)
  if out.consts:  # pragma: no cover - the emitted equations made constants: keep the flat form
    return flat
  return out


def regathered(flat, n_consts: int, dyn: list, gathered: dict, axis):
  """ZeRO-3: `(flat, dyn)` with the gathered leaves replaced by their shards, each
  all-gathered where the forward and again where the backward reads it
  (`passes.collectives.regather`). Leaves traced without the data axis in their
  type (the untyped fallback of `ooojax._dp.traced`) keep the gather at the start."""
  first = 1 + n_consts
  pos, dyn = {}, list(dyn)
  for i, x in enumerate(dyn):
    hit = gathered.get(id(x))
    if hit is None or hit[0] is not x:
      continue
    _, shard, dim = hit
    if axis not in _compat.varying_axes(flat.jaxpr.invars[first + i].aval):
      continue
    pos[i] = Gather(dim, _compat.shape_dtype(jax.typeof(shard)))
    dyn[i] = shard
  return regather(flat, first, pos, axis), dyn
