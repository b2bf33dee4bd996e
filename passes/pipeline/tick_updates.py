"""pipeline.tick_updates: a tiled table's optimizer updates inside the tick loop.

Contract: `owner_groups(owners, n_shared) -> groups`; `update(r, w, o, acc,
updater, chunks, groups, axis_name, select, data_axis) -> (w, o, acc)`, run by each tick
of `ticks.tick_loop` with an updater; `broadcast_owned(groups, axis_name, key,
x)` after the loop. `groups`: None (weights read by the first and the last
stage, tied: updated at `sync` ticks on every device) or an owner's virtual
stage -> (device, chunk, shared leaf indices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ooojax.passes.pipeline import plan as plan_pass

__all__ = ["broadcast_owned", "owner_groups", "tree_where", "update"]


def owner_groups(owners, n_shared: int) -> dict:
  """Shared leaf j's group: `owners[j]` = (device, chunk, virtual stage) or None."""
  groups: dict = {}
  for j, own in enumerate(owners or [None] * n_shared):
    key, d, c = (None, 0, 0) if own is None else (own[2], own[0], own[1])
    groups.setdefault(key, (d, c, []))[2].append(j)
  return groups


def broadcast_owned(groups, axis_name, key, x):
  """`x` as the owner of group `key` holds it, on every device."""
  if key is None:
    return x
  mine = lax.axis_index(axis_name) == groups[key][0]
  return lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis_name)


def _when(pred, f, args, select: bool):
  """`f(args)` if `pred`, else `args`: a `cond`, or with `select` both
  computed and one kept (a psum inside runs on every tick, on every device)."""
  if select:
    return tree_where(pred, f(args), args)
  return lax.cond(pred, f, lambda a: a, args)


def tree_where(pred, new, old):
  """`new` where the scalar `pred` holds, else `old` (pytrees; a leaf both share stays)."""
  return jax.tree.map(lambda a, b: b if a is b else lax.select(pred, a, b), new, old)


def update(r, w, o, acc, updater, chunks: int, groups, axis_name, select: bool, data_axis=None):
  """Each chunk whose bit is set in `upd`: its update on its summed gradients
  (all of its step's W ran by this tick), then a zero accumulator. At a
  `sync` tick (the same on every device, so the psum inside the cond is
  collective), the shared weights' update on their gradient summed over
  the stages. With a `data_axis`, the gradients' mean over the data replicas
  (each ran the table on its rows; the replicas of a stage share its table row,
  so all of them take this update's branch together)."""
  F = plan_pass.F

  def rep_mean(gs):
    return gs if data_axis is None else [lax.pmean(g, data_axis) for g in gs]

  (ws, sh), (oc, orep), gp = (list(w[0]), w[1]), (list(o[0]), o[1]), list(acc["gp"])
  for c in range(chunks):

    def apply(args, c=c):
      wc, occ, orp, gc = args
      wc, occ, orp = updater.chunk(c, wc, rep_mean(gc), occ, orp)
      return list(wc), occ, orp, [jnp.zeros_like(g) for g in gc]

    ws[c], oc[c], orep, gp[c] = _when(
      ((r[F["upd"]] >> c) & 1) == 1, apply, (ws[c], oc[c], orep, gp[c]), select
    )
  gsh = acc["gsh"]
  for key, (d, c, js) in groups.items():  # the owner's update, or all at a sync

    def shared_update(args, key=key, js=js):
      shl, orp, g = list(args[0]), args[1], list(args[2])
      gj = rep_mean([g[j] if key is not None else lax.psum(g[j], axis_name) for j in js])
      new, orp = updater.shared(key, js, [shl[j] for j in js], gj, orp)
      for j, x in zip(js, new):
        shl[j], g[j] = x, jnp.zeros_like(g[j])
      return shl, orp, g

    pred = (
      r[F["sync"]] == 1
      if key is None
      else (((r[F["upd"]] >> c) & 1) == 1) & (lax.axis_index(axis_name) == d)
    )
    sh, orep, gsh = _when(pred, shared_update, (sh, orep, gsh), select)
  return (ws, sh), (oc, orep), {"gp": gp, "gsh": gsh}
