"""collectives.pricer: the closed-form price of each (k, bucket size) candidate of
`collectives.plan`, equal to `build_plan`'s simulation (`tests/test_dp_plan.py`)."""

from __future__ import annotations

import dataclasses

from ooojax.passes.collectives import loops as scan_collectives
from ooojax.passes.collectives.buckets import (
  _grad_bytes,
  _group,
  _link_units,
  _with_loop_units,
  early_bytes,
  early_unit,
  first_k_leaves,
  layer_of,
  layers_forward,
  make_buckets,
  reverse_first_k,
)
from ooojax.passes.collectives.carried import carried_order, carried_stall, forward_starts
from ooojax.passes.collectives.costs import (
  NO_BUCKET_COSTS,
  bucket_seconds,
  one_in_flight,
  tail as _tail,
)


class Pricer:
  """The simulated step of each (k, bucket size) candidate without building its plan.

  With one compute stream and the link, `simulate` runs the compute back to
  back (each unit after the previous one, its deps earlier in the order) and
  each transfer at `max(link free, its compute dep done)`: a closed form,
  one pass over the buckets, with what does not depend on the bucket size
  computed once per k (from per-action facts computed once).
  `tests/test_dp_plan.py` checks it against `build_plan`'s simulation.
  """

  def __init__(
    self,
    split,
    sched,
    link,
    n_devices,
    in_loop,
    costs=None,
    loss=False,
    in_flight=None,
    reduce_dtype=None,
  ):
    self.in_flight = in_flight
    self.reduce_dtype = reduce_dtype  # bytes on the link at this dtype (`wire`)
    self.split, self.sched, self.link, self.n = split, sched, link, n_devices
    self.in_loop = in_loop
    self.costs = costs or NO_BUCKET_COSTS
    self.by_k: dict = {}
    self.by_name = {u.name: u for u in sched.units}
    self.fwd = self.by_name["F0"].cost if "F0" in self.by_name else 0.0
    # the loss's all-reduce (`build_plan`'s `early`), where one is priced
    eb = early_bytes(split) if loss and n_devices > 1 else None
    self.early_cost = None if eb is None else bucket_seconds(link, eb, n_devices)
    self.starts = forward_starts(split)  # `carried_seconds`
    self.nbytes = _grad_bytes(split, reduce_dtype)  # the link's bytes (`wire`)
    if in_loop:
      return
    # per action of the in-order schedule: name, seconds, and for dW its leaf and layer rank
    rank = {l: i for i, l in enumerate(layers_forward(split))}
    leaf_of = {c.index: c.grad_out - split.grad_out_start for c in split.clusters}
    self.acts = []
    for a in sched.streams[0]:
      u = self.by_name[a.unit]
      w = a.kind == "W"
      # alone on the device: slowed only past a full share, as in `simulate`
      self.acts.append(
        (
          a.unit,
          u.cost * max(1.0, u.util),
          leaf_of[u.index] if w else -1,
          rank[layer_of(u.label)] if w else -1,
        )
      )
    self.leaf_rank = {
      c.grad_out - split.grad_out_start: rank[layer_of(c.param)] for c in split.clusters
    }

  def _per_k(self, k):
    got = self.by_k.get(k)
    if got is not None:
      return got
    if self.in_loop:
      sched = self.sched
      order = (
        reverse_first_k(self.split, sched.units, sched.streams[0], k)
        if k
        else tuple(sched.streams[0])
      )
      deferred = first_k_leaves(self.split, k)
      loops = scan_collectives.loop_reductions(self.split, sched, deferred, self.reduce_dtype)
      ends, t = {}, 0.0
      for a in order:
        u = self.by_name[a.unit]
        t += u.cost * max(1.0, u.util)
        ends[a.unit] = t
      last = order[-1].unit if order else ""
      got = self.by_k[k] = (order, deferred, loops, ends, t, None, last)
      return got
    # `reverse_first_k`: the first k layers' dW after the rest, stable by layer
    kept = [x for x in self.acts if not 0 <= x[3] < k]
    moved = sorted((x for x in self.acts if 0 <= x[3] < k), key=lambda x: x[3])
    ends, t = {}, 0.0
    first: list = []
    last: dict = {}
    for i, (name, sec, leaf, _) in enumerate(kept + moved):
      t += sec
      ends[name] = t
      if leaf >= 0:  # `_finishing`
        if leaf not in last:
          first.append((leaf, name))
        last[leaf] = (i, name)
    ends[""] = t  # issued at the end
    rest = tuple(i for i in range(len(self.nbytes)) if i not in last)
    deferred = frozenset(l for l, r in self.leaf_rank.items() if r < k)
    final = (kept + moved)[-1][0] if kept or moved else ""
    got = self.by_k[k] = (None, deferred, (), ends, t, (first, last, rest, self.nbytes), final)
    return got

  def score(
    self, k: int, bucket_bytes: int, cross_step: bool, merge_tail: bool = False, early=None
  ) -> float:
    """`build_plan(...).makespan`, or `.cross_step` when `cross_step`."""
    _, deferred, _, ends, t_c, finishing, final = self._per_k(k)
    if finishing is None:  # in-loop reductions: the link units as `build_plan` makes them
      return self._score_units(k, bucket_bytes, cross_step, merge_tail, early)
    link, n, costs = self.link, self.n, self.costs
    groups = _group(finishing, max(bucket_bytes, 1), merge_tail)
    # `_packed`: each pack lengthens the unit its bucket is issued after, and so
    # delays everything after it (the issuing units run in bucket order)
    packed, at = 0.0, {}
    for leaves, size, after in groups:
      packed += costs.pack(len(leaves), size)
      at[after or final] = packed
    t_c += packed
    comm = busy = 0.0
    issues, kept = [], []
    for leaves, size, after in groups:
      cost = bucket_seconds(link, size, n)
      ready = ends.get(after or final, 0.0) + at[after or final]
      issues.append((ready, cost))
      busy += cost
      if not (cross_step and leaves and deferred.issuperset(leaves)):
        kept.append((ready, cost))
        comm += cost
    if early is not None and self.early_cost is not None:  # `early_unit`
      loss = (ends.get("F0", 0.0) if early else t_c, self.early_cost)
      busy += self.early_cost
      issues, kept = ([loss, *issues], [loss, *kept]) if early else ([*issues, loss], [*kept, loss])
    if not cross_step:
      stall, _, link_ends = one_in_flight(issues, self.in_flight)
      bucket_ends = link_ends[1:] if early and self.early_cost is not None else link_ends
      done = [(e, size) for e, (_, size, _) in zip(bucket_ends, groups)]
      return max(_tail(t_c + stall, done, costs), max(link_ends, default=0.0))
    stall, _, link_ends = one_in_flight(kept, self.in_flight)
    t_nd = max(t_c + stall, max(link_ends, default=0.0))  # `cross_step_time`'s terms
    unpacks = sum(
      costs.unpack(size)
      for leaves, size, _ in groups
      if not (leaves and deferred.issuperset(leaves))
    )
    wait, carried = self._carried(deferred, bucket_bytes)
    busy = comm + carried
    if early is not None and self.early_cost is not None:
      busy += self.early_cost
    raw = max(t_c, t_nd, busy, max(t_c, t_nd) + wait) + unpacks
    return min(raw, self.score(k, bucket_bytes, False, merge_tail, early))

  def _carried(self, deferred, bucket_bytes):
    """`plan.carried_seconds`: the next forward's wait and the carried link seconds."""
    if not deferred:
      return 0.0, 0.0
    return carried_stall(
      carried_order(self.split, deferred, self.starts),
      self.starts,
      self.fwd,
      self.nbytes,
      max(bucket_bytes, 1),
      self.link,
      self.n,
      self.costs.sync,
    )

  def _score_units(self, k, bucket_bytes, cross_step, merge_tail=False, early=None):
    order, deferred, loops, ends, t_c, _, final = self._per_k(k)
    skip = frozenset(i for l in loops for i in l.grads)
    buckets = make_buckets(
      self.split,
      self.sched.units,
      order,
      max(bucket_bytes, 1),
      skip,
      merge_tail,
      self.reduce_dtype,
    )
    costs = self.costs
    extra: dict = {}
    for b in buckets:  # `_packed`
      extra[b.after or final] = extra.get(b.after or final, 0.0) + costs.pack(
        len(b.grads), b.nbytes
      )
    if any(extra.values()):
      ends, t_c = {}, 0.0
      for a in order:
        u = self.by_name[a.unit]
        t_c += u.cost * max(1.0, u.util) + extra.get(a.unit, 0.0)
        ends[a.unit] = t_c
    s_units, s_actions = _link_units(buckets, self.link, self.n, order)
    s_units, s_actions = _with_loop_units(loops, s_units, s_actions, self.link, self.n, order)
    if early is not None and self.early_cost is not None:
      u, a = early_unit(0, early, self.link, self.n, order)
      s_units = [*s_units, dataclasses.replace(u, cost=self.early_cost)]
      s_actions = (a, *s_actions) if early else (*s_actions, a)
    cost = {u.name: u.cost for u in s_units}
    dep = {u.name: max((ends[d] for d in u.deps if d in ends), default=0.0) for u in s_units}

    def link_end(actions):
      """(the compute stream's end with its stalls, the link's end, each transfer's end)"""
      stall, _, link_ends = one_in_flight(
        ((dep[a.unit], cost[a.unit]) for a in actions), self.in_flight
      )
      done = {a.unit: e for a, e in zip(actions, link_ends)}
      return t_c + stall, max(link_ends, default=0.0), done

    size = {f"S{b.index}": b.nbytes for b in buckets}
    if not cross_step:
      t_s, free, done = link_end(s_actions)
      tail = _tail(t_s, [(done[a.unit], size[a.unit]) for a in s_actions if a.unit in size], costs)
      return max(t_s, free, tail)
    late = {f"S{b.index}" for b in buckets if b.grads and set(b.grads) <= deferred}
    t_nd = max(link_end([a for a in s_actions if a.unit not in late])[:2])
    wait, carried = self._carried(deferred, bucket_bytes)
    link_busy = sum(cost[a.unit] for a in s_actions if a.unit not in late) + carried
    unpacks = sum(costs.unpack(b.nbytes) for b in buckets if f"S{b.index}" not in late)
    raw = max(t_c, t_nd, link_busy, max(t_c, t_nd) + wait) + unpacks
    return min(raw, self._score_units(k, bucket_bytes, False, merge_tail, early))
