"""collectives.buckets: reverse first-k and the gradient buckets of one compute order.

What `collectives.plan` builds a candidate from, and `collectives.pricer` prices:
layers and their forward order, the first-k reordering, bucketing leaves in the
order their dW clusters finish, each bucket's `SEND` unit on the link and its
pack on the compute stream.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ooojax.passes.collectives import loops as scan_collectives
from ooojax.passes.collectives.costs import BucketCosts, bucket_seconds
from ooojax.passes.collectives.wire import link_bytes
from ooojax.passes.cost import _nbytes
from ooojax.passes.ir import Action, Split, Unit, UnitKind

LINK_STREAM = 1


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Gradient leaves reduced by one all-reduce, issued after unit `after`."""

  index: int
  grads: tuple[int, ...]  # gradient leaf positions (0 = first gradient output)
  nbytes: int
  after: str  # compute unit after which it is issued ("" = at the end)


def layer_of(param: str) -> str:
  """`['params']['Dense_0']['kernel']` -> `['params']['Dense_0']`.

  nnx paths too: `.blocks[0].attn.kernel.value` -> `.blocks[0].attn`,
  `[1]['l']['kernel'].value` (a `(graphdef, state)` pair) -> `[1]['l']`.
  """
  if param.endswith(".value"):  # an nnx Variable's value
    param = param[: -len(".value")]
  i = param.rfind("[") if param.endswith("]") else param.rfind(".")
  return param[:i] if i > 0 else param


def layers_forward(split: Split) -> list[str]:
  """Layers in forward order: the backward meets the last layer's dW first."""
  seen: dict[str, None] = {}
  for c in split.clusters:
    seen.setdefault(layer_of(c.param), None)
  return list(reversed(seen))


def reverse_first_k(
  split: Split, units: Sequence[Unit], order: Sequence[Action], k: int
) -> tuple[Action, ...]:
  """Moves the first `k` layers' dW actions after the dX chain, in forward order."""
  layers = layers_forward(split)
  if k > len(layers):
    raise ValueError(
      f"first_k={k} is larger than the number of layers with weight "
      f"gradients ({len(layers)}); use first_k <= {len(layers)}"
    )
  rank = {l: i for i, l in enumerate(layers[:k])}
  by_name = {u.name: u for u in units}
  moved = [a for a in order if a.kind == "W" and layer_of(by_name[a.unit].label) in rank]
  out = set(moved)
  kept = [a for a in order if a not in out]
  # stable by layer: a layer's clusters keep their relative order
  moved.sort(key=lambda a: rank[layer_of(by_name[a.unit].label)])
  return tuple(kept) + tuple(moved)


def _grad_bytes(split: Split, reduce_dtype=None) -> list[int]:
  """Per gradient leaf, the bytes its reduction puts on the link (`wire.link_bytes`)."""
  outs = split.jaxpr.jaxpr.outvars[split.grad_out_start :]
  return [link_bytes(v.aval, reduce_dtype) for v in outs]


def make_buckets(
  split: Split,
  units: Sequence[Unit],
  order: Sequence[Action],
  bucket_bytes: int,
  skip: frozenset[int] = frozenset(),
  merge_tail: bool = False,
  reduce_dtype=None,
) -> tuple[Bucket, ...]:
  """Groups gradient leaves into buckets in the order their dW clusters finish.

  Leaves in `skip` (reduced inside a loop) get no bucket. `merge_tail`: a small
  last bucket joins the one before (`_group`). Bytes are the link's: at
  `reduce_dtype` (`wire.link_bytes`).
  """
  groups = _group(_finishing(split, units, order, skip, reduce_dtype), bucket_bytes, merge_tail)
  return tuple(Bucket(i, leaves, size, after) for i, (leaves, size, after) in enumerate(groups))


def _finishing(split: Split, units, order, skip, reduce_dtype=None) -> tuple:
  """What bucketing reads of an order: `(first, last, rest, nbytes)`.

  `first`: (leaf, unit) per gradient leaf, in the order its first dW unit
  runs; `last`: leaf -> (position, unit) of its last dW unit; `rest`: leaves
  no dW unit produces (unused parameters, pass-through gradients).
  """
  nbytes = _grad_bytes(split, reduce_dtype)
  by_name = {u.name: u for u in units}
  leaf_of_cluster = {c.index: c.grad_out - split.grad_out_start for c in split.clusters}
  first: list = []
  last: dict = {}
  for i, a in enumerate(order):
    if a.kind != "W":
      continue
    leaf = leaf_of_cluster[by_name[a.unit].index]
    if leaf in skip:
      continue
    if leaf not in last:
      first.append((leaf, a.unit))
    last[leaf] = (i, a.unit)
  rest = tuple(i for i in range(len(nbytes)) if i not in skip and i not in last)
  return first, last, rest, nbytes


# A last bucket under this share of the bucket size may join the one before it (`_group`):
# with one collective in flight, issued after a large bucket it forces that one's done
# before the backward ends. `collectives.plan` prices both (`costs.one_in_flight`).
TRAILING_SHARE = 0.25


def _group(
  finishing, bucket_bytes: int, merge_tail: bool = False
) -> list[tuple[tuple[int, ...], int, str]]:
  """(leaves, bytes, unit issued after) per bucket; a full bucket closes at its last leaf.
  `merge_tail`: a last bucket under `TRAILING_SHARE` of the size joins the one before."""
  first, last, rest, nbytes = finishing
  out: list = []
  cur: list[int] = []
  size = 0
  for leaf, unit in first:
    cur.append(leaf)
    size += nbytes[leaf]
    if size >= bucket_bytes:
      out.append((tuple(cur), size, unit))
      cur, size = [], 0
  if merge_tail and cur and out and size < TRAILING_SHARE * bucket_bytes:
    # a small last bucket joins the one before: XLA:GPU keeps one collective in flight,
    # so issued after it, it would force that one's done before the backward ends
    leaves, nb, _ = out.pop()
    cur, size = [*leaves, *cur], nb + size
  if cur:  # after the last dW unit of any of its leaves
    out.append((tuple(cur), size, max(last[l] for l in cur)[1]))
  if rest:
    out.append((rest, sum(nbytes[i] for i in rest), ""))
  return out


# The value and aux leaves are combined ahead of the first bucket (`BucketEmitter`'s
# `early`) only when they are a few scalars or small vectors (a loss, token counts):
# ResNet-50's BatchNorm statistics (~100 leaves) tied ahead of it replayed 3 ms slower
# on IB 100.
EARLY_MAX_LEAVES = 8
EARLY_MAX_ELEMENTS = 1024
EARLY_INDEX = -1  # the index of its `SEND` unit (`S-1`) in a plan's units


def early_bytes(split: Split) -> int | None:
  """Bytes of the value and aux leaves one all-reduce combines, where they may be
  combined ahead of the first bucket (few and small); None where they may not."""
  heads = split.jaxpr.jaxpr.outvars[: split.grad_out_start]
  if len(heads) > EARLY_MAX_LEAVES or any(
    math.prod(v.aval.shape) > EARLY_MAX_ELEMENTS for v in heads
  ):
    return None
  return sum(_nbytes(v.aval) for v in heads)


def early_unit(nbytes: int, early: bool, link, n_devices, order) -> tuple[Unit, Action]:
  """The loss's all-reduce on the link: after the forward (`early`), or after the last
  compute unit, once every bucket is issued."""
  dep = "F0" if early else (order[-1].unit if order else "F0")
  cost = bucket_seconds(link, nbytes, n_devices)
  return Unit(UnitKind.SEND, EARLY_INDEX, (), (dep,), cost, 0.0, "loss"), Action(
    "S", EARLY_INDEX, LINK_STREAM
  )


def _link_units(buckets, link, n_devices, order) -> tuple[list[Unit], tuple[Action, ...]]:
  last = order[-1].unit if order else "F0"
  units, actions = [], []
  for b in buckets:
    deps = (b.after or last,)
    units.append(
      Unit(
        UnitKind.SEND,
        b.index,
        (),
        deps,
        bucket_seconds(link, b.nbytes, n_devices),
        0.0,
        f"bucket{b.index}",
      )
    )
    actions.append(Action("S", b.index, LINK_STREAM))
  return units, tuple(actions)


def _with_loop_units(loops, s_units, s_actions, link, n_devices, order):
  """Adds the in-loop reductions' SEND units (`scan_collectives.link_units`), in issue order."""
  if not loops:
    return s_units, s_actions
  ar = lambda nbytes: bucket_seconds(link, nbytes, n_devices)  # noqa: E731
  units = list(s_units) + scan_collectives.link_units(loops, len(s_units), order, ar)
  pos = {a.unit: i for i, a in enumerate(order)}
  dep = {u.name: pos.get(u.deps[0], len(order)) for u in units}
  actions = [Action("S", u.index, LINK_STREAM) for u in units]
  actions.sort(key=lambda a: dep[a.unit])  # stable: buckets keep their order
  return units, tuple(actions)


def _packed(units, buckets, order, costs: BucketCosts) -> tuple[Unit, ...]:
  """`units` with each bucket's pack added to the compute unit it is issued after."""
  extra: dict[str, float] = {}
  last = order[-1].unit if order else ""
  for b in buckets:
    p = costs.pack(len(b.grads), b.nbytes)
    if p:
      key = b.after or last
      extra[key] = extra.get(key, 0.0) + p
  if not extra:
    return tuple(units)
  # `simulate` runs a unit for cost * max(1, util): the pack adds its own seconds
  return tuple(
    dataclasses.replace(u, cost=u.cost + extra[u.name] / max(1.0, u.util)) if u.name in extra else u
    for u in units
  )


def first_k_leaves(split: Split, k: int) -> frozenset[int]:
  """Gradient leaf positions of the first `k` layers (forward order)."""
  first = set(layers_forward(split)[:k])
  return frozenset(
    c.grad_out - split.grad_out_start for c in split.clusters if layer_of(c.param) in first
  )


def forward_leaves(split: Split, leaves) -> tuple[int, ...]:
  """`leaves` (gradient positions) in the forward order of their layers."""
  rank = {l: i for i, l in enumerate(layers_forward(split))}
  names = {c.grad_out - split.grad_out_start: c.param for c in split.clusters}
  return tuple(sorted(leaves, key=lambda i: rank[layer_of(names[i])]))
