"""collectives.carried: what `dp.make_train_step(cross_step=True)` carries into the next step.

The carried gradients are reduced at the next step's start in buckets of the plan's
size (`carried_buckets`), chained, in the order the next forward reads them
(`carried_order`, from `forward_starts`); the forward waits at a leaf whose bucket is
not done (`carried_stall`). `collectives.plan` prices a candidate with
`carried_seconds` and may carry the last layers the forward reads (`last_k_leaves`).
"""

from __future__ import annotations

from ooojax.passes._compat import Var
from ooojax.passes.collectives.buckets import (
  _grad_bytes,
  forward_leaves,
  layer_of,
)
from ooojax.passes.collectives.costs import bucket_seconds
from ooojax.passes.cost import estimate
from ooojax.passes.ir import Kind, Split


def carried_buckets(order, nbytes, bucket_bytes: int) -> list[tuple[tuple[int, ...], int]]:
  """The carried leaves' all-reduces in the next step (`ooojax.data_parallel`):
  `order` (forward order, layer 0 first) cut into buckets that close once they hold
  `bucket_bytes`, as the step's own buckets do; `(leaves, bytes)` each."""
  out, cur, size = [], [], 0
  for leaf in order:
    cur.append(leaf)
    size += nbytes[leaf]
    if size >= bucket_bytes:
      out.append((tuple(cur), size))
      cur, size = [], 0
  if cur:
    out.append((tuple(cur), size))
  return out


def forward_starts(split: Split) -> dict[int, float]:
  """Per gradient leaf, the share of the forward (its FLOPs, `passes.cost.estimate`)
  that runs before the forward first reads the leaf: when the next step needs it
  updated. A tied embedding is read by the lookup as the forward starts, though its
  layer comes last in `layers_forward` (its dW meets the head first). Leaves the
  forward does not read get 1 (needed at its end)."""
  jaxpr = split.jaxpr.jaxpr
  n_grads = len(jaxpr.outvars) - split.grad_out_start
  # invars: (ct, *consts, *leaves), the differentiated leaves first
  first = 1 + len(split.consts)
  leaf_of = {v: i for i, v in enumerate(jaxpr.invars[first : first + n_grads])}
  starts: dict[int, float] = {}
  t = 0.0
  for eqn, kind in zip(jaxpr.eqns, split.kinds):
    if kind is not Kind.FORWARD:
      continue
    for v in eqn.invars:
      i = leaf_of.get(v) if isinstance(v, Var) else None
      if i is not None and i not in starts:
        starts[i] = t
    t += estimate(eqn).flops
  total = t or 1.0
  return {i: starts.get(i, total) / total for i in range(n_grads)}


def carried_order(split: Split, leaves, starts: dict[int, float]) -> tuple[int, ...]:
  """The carried leaves in the order the next forward needs them (`forward_starts`;
  ties in layer order): their buckets' order in `ooojax.data_parallel`."""
  fwd = forward_leaves(split, leaves)
  rank = {l: j for j, l in enumerate(fwd)}
  return tuple(sorted(fwd, key=lambda l: (starts.get(l, 1.0), rank[l])))


def carried_stall(order, starts, fwd: float, nbytes, bucket_bytes: int, link, n, sync=0.0):
  """`(stall, link seconds)` of the carried reductions in the next step: their buckets
  (`carried_buckets`, forward order) chained on the link from the step's start, and
  the forward waiting at each layer (`starts`: its share of the forward `fwd`) until
  the bucket holding it is done."""
  t = stall = 0.0
  for leaves, size in carried_buckets(order, nbytes, bucket_bytes):
    t += bucket_seconds(link, size, n) + sync
    stall = max(stall, t - fwd * starts.get(leaves[0], 0.0))
  return stall, t


def carried_seconds(
  split: Split,
  units,
  deferred,
  link,
  n_devices,
  bucket_bytes: int,
  sync: float = 0.0,
  reduce_dtype=None,
) -> tuple[float, float]:
  """The deferred leaves' reductions as the cross-step train step runs them
  (`ooojax.data_parallel`): `carried_buckets` of `bucket_bytes`, layer 0 first,
  chained from the next step's start, each with its fixed costs on the link and
  (`sync`) on the compute stream. Returns `(how long the next forward waits for
  them, their link seconds)` (`carried_stall`; the forward is `F0`, each leaf
  needed at its `forward_starts` share of it, reduced in `carried_order`)."""
  if not deferred:
    return 0.0, 0.0
  fwd = next((u.cost for u in units if u.name == "F0"), 0.0)
  starts = forward_starts(split)
  return carried_stall(
    carried_order(split, deferred, starts),
    starts,
    fwd,
    _grad_bytes(split, reduce_dtype),  # the link's bytes (`wire`)
    max(bucket_bytes, 1),
    link,
    n_devices,
    sync,
  )


def last_k_leaves(split: Split, k: int, starts: dict[int, float] | None = None):
  """Gradient leaves of the last `k` layers the forward reads (`forward_starts`)."""
  starts = forward_starts(split) if starts is None else starts
  layer = {c.grad_out - split.grad_out_start: layer_of(c.param) for c in split.clusters}
  first: dict[str, float] = {}
  for leaf, l in layer.items():
    first[l] = min(first.get(l, 1.0), starts.get(leaf, 1.0))
  order = sorted(first, key=lambda l: first[l])
  keep = set(order[len(order) - k :]) if k else set()
  return frozenset(leaf for leaf, l in layer.items() if l in keep)
