"""Tracing the user's loss as one data-parallel shard: its closed-over batch swapped for
the shard (`with_closure`) and its sharding constraints on the manual data axis dropped
(`in_shard`)."""

from __future__ import annotations

import functools
import types

import jax
from jax.sharding import PartitionSpec as P

from ooojax._dp_layout import _spec_axes
from ooojax.passes import _compat


def with_closure(fun, swap: dict, hits: set, depth: int = 4):
  """`fun` with each value in `swap` (id -> (old, new)) it closes over replaced by the new one.

  Follows closure cells, `functools.partial` arguments, bound methods'
  functions and pytrees held there, `depth` functions deep; `hits` collects
  the ids replaced. Anything else reaching an old value is left as it is
  (the caller checks `hits`).
  """

  def leaf(v):
    hit = swap.get(id(v))
    if hit is not None and hit[0] is v:
      hits.add(id(v))
      return hit[1]
    return v

  def value(v, d):
    if callable(v) and not isinstance(v, jax.Array) and not _compat.is_tracer(v):
      return with_closure(v, swap, hits, d - 1) if d > 0 else v
    try:
      return jax.tree_util.tree_map(leaf, v)
    except Exception:  # noqa: BLE001 - not a pytree of leaves we can rebuild
      return v

  if isinstance(fun, functools.partial):
    return functools.partial(
      value(fun.func, depth),
      *(value(a, depth) for a in fun.args),
      **{k: value(v, depth) for k, v in fun.keywords.items()},
    )
  if isinstance(fun, types.MethodType):
    return types.MethodType(value(fun.__func__, depth), value(fun.__self__, depth))
  if not isinstance(fun, types.FunctionType) or not fun.__closure__:
    return fun
  cells, changed = [], False
  for c in fun.__closure__:
    try:
      old = c.cell_contents
    except ValueError:  # an empty cell
      cells.append(c)
      continue
    new = value(old, depth)
    changed |= new is not old
    cells.append(types.CellType(new) if new is not old else c)
  if not changed:
    return fun
  g = types.FunctionType(
    fun.__code__, fun.__globals__, fun.__name__, fun.__defaults__, tuple(cells)
  )
  g.__kwdefaults__, g.__dict__ = fun.__kwdefaults__, dict(fun.__dict__)
  functools.update_wrapper(g, fun, updated=())
  return g


def _drop_axis(spec, axis):
  def entry(e):
    kept = tuple(a for a in _spec_axes(e) if a != axis)
    return None if not kept else kept[0] if len(kept) == 1 else kept

  return P(*(entry(e) for e in spec))


def _in_shard(fun, axis, had_mesh: bool, rows: frozenset = frozenset()):
  """`fun` with sharding constraints on `axis` dropped while it is traced.

  Inside the shard_map the data axis is manual, and each device holds its
  shard: a constraint the model applies for the global view holds there by
  construction, but naming a manual axis in it is an error. Constraints on
  the other axes are kept; so are `reshard`, `out_sharding=` and `auto_axes`
  requests, less the data axis (`_compat.manual_axis_dropped`). Random draws
  over the shard's `rows` (dropout) take this shard's rows of the full
  batch's draw (`_compat.per_example_draws`). Without a context mesh outside (`had_mesh`),
  constraints given as a bare `PartitionSpec` are dropped: the shard_map
  sets a mesh the user's program did not have, and code that constrains
  only when a mesh is set (flax's `nn.with_partitioning` boxes) would
  otherwise apply constraints the user's program never applies.
  """

  @functools.wraps(fun)
  def f(*a, **k):
    orig = jax.lax.with_sharding_constraint

    def constrain(x, shardings):
      if not had_mesh and all(
        isinstance(s, P)
        for s in jax.tree.leaves(
          shardings, is_leaf=lambda s: isinstance(s, (P, jax.sharding.Sharding))
        )
      ):
        return x

      def one(s):
        if isinstance(s, jax.sharding.NamedSharding):
          return jax.sharding.NamedSharding(s.mesh, _drop_axis(s.spec, axis))
        return _drop_axis(s, axis) if isinstance(s, P) else s

      return orig(
        x, jax.tree.map(one, shardings, is_leaf=lambda s: isinstance(s, (P, jax.sharding.Sharding)))
      )

    jax.lax.with_sharding_constraint = constrain
    try:
      with _compat.manual_axis_dropped(axis), _compat.per_example_draws(axis, rows):
        return fun(*a, **k)
    finally:
      jax.lax.with_sharding_constraint = orig

  return f
