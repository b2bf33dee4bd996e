"""collectives.loops: all-reduce a scanned stack's dW one layer at a time, inside the loop.

Contract: `loop_reductions(split, sched, skip) -> tuple[LoopReduce, ...]`
names the gradient leaves that a split backward scan produces stacked over
its layers and that the data-parallel mode reduces per layer from inside the
loop; `passes.collectives.plan` keeps them out of its buckets and
`passes.collectives.emit.BucketEmitter.reduce_ys` issues the reductions.

In data-parallel mode `passes.emit` fuses each split backward scan into one
skewed scan (`passes.scan.skew`): iteration i runs B(i), the dX chain, beside
W(i-1), which makes layer i-1's dW slices (the W-scans' ys). Reducing the whole
stacked dW after the loop leaves nothing to overlap it with but what follows
the stack. Instead, the fused equation hands each layer's ys to `reduce_ys`,
which psums them (one buffer per dtype, `reduce_buffers`) in the iteration
that made them, so layer i-1's all-reduce can run under B(i) and the next
iterations; the epilogue (the last layer) reduces after the loop. The scan's
ys then stack already-reduced slices, and the bucket path never sees those
leaves again (no double reduction). A psum of each slice is the psum of the
stack, element for element, so the result equals the reduce-after-the-loop
gradient exactly.

Which leaves qualify is read from the fusion itself (`scan_skew.fuse`, the
same deterministic rewrite `emit` applies): a gradient output that is a ys
output of a fused W-scan. Accumulator carries (a weight shared by every step,
e.g. an LSTM's) are partial sums until the last step, so they stay on the
bucket path, as do leaves in `skip` (reverse first-k / cross-step deferred).

>>> import jax, jax.numpy as jnp
>>> from ooojax.passes import split as sp, schedule as sc
>>> from ooojax.passes.cost import CostModel
>>> layer = lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None)
>>> def f(ct, w, b, x):
...   y, vjp = jax.vjp(lambda w, b: jnp.sum(jax.lax.scan(layer, x, (w, b))[0]), w, b)
...   return (y, *vjp(ct))
>>> avals = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(), (3, 4, 4), (3, 4), (2, 4)]]
>>> s = sp.split(f, avals, n_grads=2, param_names=["['w']", "['b']"])
>>> [(l.grads, l.trips) for l in loop_reductions(s, sc.schedule(s, CostModel("H100"), 1))]
[((0, 1), 3)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from ooojax.passes import _compat
from ooojax.passes.collectives.wire import link_bytes
from ooojax.passes.ir import Action, Schedule, Split, Unit, UnitKind
from ooojax.passes.scan import skew as scan_skew


@dataclasses.dataclass(frozen=True)
class LoopReduce:
  """Gradient leaves one skewed scan reduces per layer, inside its loop.

  `after` names the compute unit that runs the loop (the B-scan's dX unit in
  the in-order schedule) and `w_units` the dW units of its W-scans (fused
  into it when emitted); `passes.collectives.plan` prices it from them.
  """

  index: int  # its SEND units follow the buckets' (see `link_units`)
  grads: tuple[int, ...]  # gradient leaf positions (0 = first gradient output)
  nbytes: int  # all layers together
  trips: int  # the scan's length: one all-reduce per trip
  after: str
  w_units: tuple[str, ...] = ()


def loop_reductions(
  split: Split, sched: Schedule, skip: Iterable[int] = frozenset(), reduce_dtype=None
) -> tuple[LoopReduce, ...]:
  """The in-loop reductions `emit` will issue for `split` (indices from 0).

  Args:
    split: from `passes.split` (backward scans already split).
    sched: its compute schedule (names the units that run each loop).
    skip: gradient leaf positions to leave to the bucket path.
    reduce_dtype: the dtype the reductions run in (`nbytes` on the link, `wire`).
  """
  skip = frozenset(skip)
  fused, _ = scan_skew.fuse(split, sched, stream=None, pin=False)
  if fused is split:
    return ()
  outs = split.jaxpr.jaxpr.outvars[split.grad_out_start :]
  leaves: dict = {}
  for i, v in enumerate(outs):
    if isinstance(v, _compat.Var):
      leaves.setdefault(v, []).append(i)
  unit_of = {k: u.name for u in sched.units for k in u.eqns}
  index_of = {id(e): k for k, e in enumerate(split.jaxpr.jaxpr.eqns)}
  loops: list[LoopReduce] = []
  for k, e in enumerate(fused.jaxpr.jaxpr.eqns):
    if e.primitive.name != "skewed_scan":
      continue
    grads: list[int] = []
    skew = e.primitive
    for w in skew.w_eqns:
      for v in stacked_grads(w):
        ids = leaves.get(v, ())
        if ids and not skip.intersection(ids):  # a var shared with a skipped leaf stays out
          grads += ids
    if grads:
      w_units = tuple(
        dict.fromkeys(
          unit_of[index_of[id(w)]] for w in skew.w_eqns if index_of.get(id(w)) in unit_of
        )
      )
      nbytes = sum(link_bytes(outs[i].aval, reduce_dtype) for i in grads)
      loops.append(
        LoopReduce(len(loops), tuple(grads), nbytes, skew.length, unit_of.get(k, ""), w_units)
      )
  return tuple(loops)


def stacked_grads(w_eqn) -> list:
  """A W-scan's ys outputs (its per-layer results, stacked), DropVars left out."""
  return [
    v
    for v in w_eqn.outvars[_compat.scan_info(w_eqn).num_carry :]
    if isinstance(v, _compat.Var) and not isinstance(v, _compat.DropVar)
  ]


def link_units(
  loops: Sequence[LoopReduce],
  first_index: int,
  order: Sequence[Action],
  allreduce_seconds: Callable[[float], float],
) -> list[Unit]:
  """Two `SEND` units per loop for the link simulation (a model, cost-model seconds).

  Layers 0..n-2 are reduced while the loop runs: one unit of `trips - 1`
  one-layer all-reduces that may start when the loop starts (optimistic by
  one iteration: the first slice exists after B(0) and W(0)); the last
  layer's all-reduce waits for the loop's end (its W units, in `order`).
  """
  pos = {a.unit: i for i, a in enumerate(order)}
  units, i = [], first_index
  for l in loops:
    at = pos.get(l.after)
    start = order[at - 1].unit if at else (order[0].unit if order else "F0")
    ends = [u for u in (l.after, *l.w_units) if u in pos]
    end = max(ends, key=pos.__getitem__) if ends else start
    one = allreduce_seconds(l.nbytes / l.trips)
    if l.trips > 1:
      units.append(Unit(UnitKind.SEND, i, (), (start,), (l.trips - 1) * one, 0.0, f"loop{l.index}"))
      i += 1
    units.append(Unit(UnitKind.SEND, i, (), (end,), one, 0.0, f"loop{l.index}.last"))
    i += 1
  return units
