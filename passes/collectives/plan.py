"""collectives.plan: data-parallel gradient buckets, reverse first-k, and the link schedule.

Contract: `plan(split, sched, cost, n_devices, link, bucket_bytes=None,
first_k=None) -> CollectivePlan`.

Input is the compute schedule of one device (`passes.schedule`, in-order on
stream 0). This pass

1. **reverse first-k**: moves the dW clusters of the first `k` layers (in
   forward order) after the whole dX chain and runs them in forward order, so
   layer 0's gradient is ready, and reduced, first (the paper's "reverse
   first-k"). A layer is a parameter path without its last key
   (`['params']['Dense_0']` holds `kernel` and `bias`).
2. **buckets**: walks the dW clusters in the order they finish and closes a
   bucket once it holds `bucket_bytes` of gradients (DDP's `bucket_cap_mb`);
   each bucket becomes one all-reduce, a `SEND` unit `S<b>` on a network link,
   issued right after its last dW cluster.
3. **choice**: `bucket_bytes=None` / `first_k=None` are chosen by simulating
   the compute stream next to the link (`passes.simulate`, ring all-reduce
   cost `2 (n-1)/n * bytes / bandwidth + 2 (n-1) * latency`) over a few
   candidates and keeping the shortest step. Ties keep the larger bucket /
   smaller k. Transfers queue on the link (`in_flight=None`, the default) or,
   with `in_flight=1`, follow XLA:GPU's one collective in flight
   (`passes.simulate.LinkQueue`, the replay's rule: a start waits for the
   previous done); then the small last bucket's merge and the loss's
   all-reduce (ahead of the first bucket or after the last) are chosen too.
   Opt-in: see `costs.PLAN_IN_FLIGHT`.
4. **what a bucket costs as XLA compiles it** (`BucketCosts`): each
   all-reduce pays `COLLECTIVE_SECONDS` on the link beyond its ring time; a
   bucket of several leaves is packed on the compute stream before it is
   issued (one concatenation: its bytes read and written), and every bucket
   is unpacked (or scaled) after its done, on the compute stream, before the
   step ends. Read from the replay of compiled programs (issue 53): without
   them the search preferred many small buckets that the compiled program
   pays for.

A stacked per-layer gradient of a split backward scan is not bucketed: the
loop reduces it one layer at a time (`passes.collectives.loops`), priced as
one-layer all-reduces from the loop's start plus the last layer's after it.

All times are cost-model estimates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ooojax.passes.collectives import loops as scan_collectives
from ooojax.passes.collectives.buckets import (  # noqa: F401 - the plan's API, re-exported
  LINK_STREAM,
  Bucket,
  _finishing,
  _grad_bytes,
  _group,
  _link_units,
  _packed,
  _with_loop_units,
  early_bytes,
  early_unit,
  first_k_leaves,
  forward_leaves,
  layer_of,
  layers_forward,
  make_buckets,
  reverse_first_k,
)
from ooojax.passes.collectives.carried import (  # noqa: F401 - re-exported
  carried_buckets,
  carried_order,
  carried_seconds,
  carried_stall,
  forward_starts,
  last_k_leaves,
)
from ooojax.passes.collectives.costs import (  # noqa: F401
  COLLECTIVE_SECONDS,
  COLLECTIVE_SYNC_SECONDS,
  NO_BUCKET_COSTS,
  PLAN_IN_FLIGHT,
  BucketCosts,
  allreduce_seconds,
  bucket_seconds,
  one_in_flight,
  tail as _tail,
)
from ooojax.passes.collectives.loops import LoopReduce
from ooojax.passes.collectives.pricer import Pricer as _Pricer
from ooojax.passes.cost import CostModel
from ooojax.passes.ir import Action, Schedule, Split, Unit
from ooojax.passes.simulate import LINKS, Link, Span, Timeline

REDUCTIONS = ("mean", "sum")
# Bucket candidates when the cost model chooses (bytes); 0 = one per dW cluster.
BUCKET_CANDIDATES = (0, 1 << 20, 4 << 20, 16 << 20, 25 << 20, 64 << 20, 128 << 20, 256 << 20)


def get_link(link: str | Link | None) -> Link:
  """A `Link` by preset name ("nvlink", "100GbE", "25GbE", "10GbE") or passed through."""
  if isinstance(link, Link):
    return link
  if link is None:
    return LINKS["nvlink"]
  for name, l in LINKS.items():
    if name.lower() == str(link).lower():
      return l
  raise ValueError(
    f"unknown link {link!r}; use one of {sorted(LINKS)} or pass a "
    "ooojax.passes.simulate.Link(name, latency_s, bytes_per_s)"
  )


def validate_options(mode: str, axis_name, reduce: str, bucket_bytes, first_k, link) -> None:
  """Raises `ValueError` for data-parallel options that can never work.

  `axis_name=None` with mode="data_parallel" is valid: inside a sharded
  `jax.jit` the data axis is found from the batch's sharding (`ooojax._dp_gspmd`).
  """
  if axis_name is not None and mode != "data_parallel":
    raise ValueError(
      f"axis_name={axis_name!r} applies to mode='data_parallel' only (got mode={mode!r})"
    )
  if reduce not in REDUCTIONS:
    raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
  if bucket_bytes is not None and (
    not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0
  ):
    raise ValueError(
      f"bucket_bytes must be a positive int (bytes per all-reduce bucket) "
      f"or None to let the cost model choose, got {bucket_bytes!r}"
    )
  if first_k is not None and (
    not isinstance(first_k, int) or isinstance(first_k, bool) or first_k < 0
  ):
    raise ValueError(
      f"first_k must be an int >= 0 (layers whose dW runs after the dX "
      f"chain, in forward order) or None to choose, got {first_k!r}"
    )
  get_link(link)


@dataclasses.dataclass(frozen=True)
class CollectivePlan:
  """The compute schedule (first-k reversed) plus buckets on a link."""

  schedule: Schedule  # compute: stream 0 only; emit reads this
  buckets: tuple[Bucket, ...]
  link_actions: tuple[Action, ...]  # S<b>@1, in issue order
  units: tuple[Unit, ...]  # compute units + S units (for simulation/plotting)
  first_k: int
  n_layers: int
  bucket_bytes: int
  link: Link
  n_devices: int
  makespan: float  # simulated, compute + link
  cross_step: float = 0.0  # simulated steady-state step with the first-k reductions
  # deferred into the next step's forward (see `cross_step_time`)
  loops: tuple[LoopReduce, ...] = ()  # leaves reduced per layer inside a scan, not bucketed
  # the loss's all-reduce ahead of the first bucket (True), after the last (False), or
  # not planned (None: `BucketEmitter` combines it early where `early_bytes` allows)
  early: bool | None = None
  in_flight: int | None = PLAN_IN_FLIGHT  # collectives in flight as priced (`build_plan`)
  reduce_dtype: object = None  # the dtype the reductions run in (`wire`); bytes at it
  # leaves carried to the next step besides the first k layers' (`build_plan`'s
  # `carried`: the last layers the forward reads, their dW left in place)
  carried: frozenset[int] = frozenset()

  @property
  def in_loop(self) -> frozenset[int]:
    """Gradient leaf positions the loops that compute them reduce."""
    return frozenset(i for l in self.loops for i in l.grads)

  @property
  def streams(self) -> tuple[tuple[Action, ...], ...]:
    return (self.schedule.streams[0], self.link_actions)

  def timeline(self) -> Timeline:
    return in_flight_timeline(
      self.schedule.streams[0], self.units, self.link_actions, self.in_flight
    )

  def to_text(self) -> str:
    return "\n".join(" ".join(str(a) for a in s) for s in self.streams)


def in_flight_timeline(order, units, s_actions, in_flight: int | None = 1) -> Timeline:
  """The compute order (stream 0) next to its link actions (`LINK_STREAM`) as XLA:GPU
  runs them: kernels back to back, each collective issued once the unit it depends on
  ends, one in flight (`costs.one_in_flight`: a start waits for the previous done, and
  the kernels after it wait with it). `in_flight=None` (no limit) is
  `passes.simulate.simulate` of the two streams."""
  by_name = {u.name: u for u in units}
  ends, t = {}, 0.0
  for a in order:  # alone on the device: slowed only past a full share, as in `simulate`
    u = by_name[a.unit]
    t += u.cost * max(1.0, u.util)
    ends[a.unit] = t
  deps = [max((ends.get(d, 0.0) for d in by_name[a.unit].deps), default=0.0) for a in s_actions]
  _, starts, link_ends = one_in_flight(
    ((d, by_name[a.unit].cost) for d, a in zip(deps, s_actions)), in_flight
  )
  # each issue's stall moves every kernel after it
  # (with a limit a start is issued when the stream is there: start - dep is a stall;
  # queued, the stream never waits)
  issued = sorted(zip(deps, (s - d if in_flight else 0.0 for s, d in zip(starts, deps))))
  spans, shift, j, prev = [], 0.0, 0, 0.0
  for a in order:
    while j < len(issued) and issued[j][0] <= prev + 1e-15:
      shift = max(shift, issued[j][1])
      j += 1
    spans.append(Span(a.unit, 0, prev + shift, ends[a.unit] + shift))
    prev = ends[a.unit]
  spans += [Span(a.unit, LINK_STREAM, s, e) for a, s, e in zip(s_actions, starts, link_ends)]
  return Timeline(tuple(spans), max((sp.end for sp in spans), default=0.0))


def cross_step_time(
  units,
  order,
  s_actions,
  buckets,
  deferred: frozenset[int],
  carried: tuple[float, float] | None = None,
  in_flight: int | None = PLAN_IN_FLIGHT,
) -> float:
  """Steady-state step time when the deferred leaves' reductions finish next step.

  A model, not a measurement: the step ends when the compute and the
  non-deferred reductions are done; the deferred reductions then run from the
  next step's start, layer 0 first, while its forward runs, and the forward
  waits at a layer whose reduction is not done. The link carries every byte of
  every step, so the period is never below the link's busy time, nor below the
  compute. `carried`: `(the forward's wait, the link seconds)` of the carried
  reductions (`carried_seconds`: their own buckets, as `ooojax.data_parallel`
  runs them); None: their in-step buckets' link time, the forward hiding all of it.
  """
  by_name = {u.name: u for u in units}
  late = {f"S{b.index}" for b in buckets if b.grads and set(b.grads) <= deferred}
  kept = tuple(a for a in s_actions if a.unit not in late)
  t_nd = in_flight_timeline(order, units, kept, in_flight).makespan
  t_c = sum(by_name[a.unit].cost for a in order)
  if carried is None:
    comm = sum(by_name[u].cost for u in late)
    fwd = by_name["F0"].cost if "F0" in by_name else 0.0
    stall = comm - fwd
  else:
    stall, comm = carried
  link_busy = sum(by_name[a.unit].cost for a in kept) + comm
  return max(t_c, t_nd, link_busy, max(t_c, t_nd) + stall)


def build_plan(
  split: Split,
  sched: Schedule,
  k: int,
  bucket_bytes: int,
  link: Link,
  n_devices: int,
  in_loop: bool = True,
  cross: bool = True,
  costs: BucketCosts | None = None,
  merge_tail: bool = False,
  early: bool | None = None,
  in_flight: int | None = PLAN_IN_FLIGHT,
  reduce_dtype=None,
  carried: frozenset[int] = frozenset(),
) -> CollectivePlan:
  """The plan for one choice of k and bucket size (what `plan` compares).

  `in_loop=False` buckets a scanned stack's dW too (reduced after its loop):
  the baseline the benchmarks compare the in-loop reductions with.
  `cross=False` leaves `cross_step` at NaN (one simulation less per candidate).
  `costs`: the buckets' pack / unpack on the compute stream (`BucketCosts.of(spec)`;
  None: free). `merge_tail`: a small last bucket joins the one before. `early`: the
  loss's all-reduce (where `early_bytes` allows one) right after the forward, ahead of
  the first bucket (True), or after the last bucket (False); None: none priced.
  `in_flight`: collectives in flight at once (1: XLA:GPU's; None: queued on the link).
  `reduce_dtype`: the dtype the reductions run in; every byte count is the link's
  (`wire.link_bytes`).
  `carried` (with k = 0): leaves the cross-step step carries to the next step with
  their dW left in place (`last_k_leaves`); they get no bucket here, `cross_step`
  prices them next step, and `makespan` stays the step that reduces them in-step.
  """
  if carried:
    full = build_plan(
      split,
      sched,
      k,
      bucket_bytes,
      link,
      n_devices,
      in_loop,
      False,
      costs,
      merge_tail,
      early,
      in_flight,
      reduce_dtype,
    )
  costs = costs or NO_BUCKET_COSTS
  base = sched.units
  order = reverse_first_k(split, base, sched.streams[0], k) if k else tuple(sched.streams[0])
  loops = (
    scan_collectives.loop_reductions(split, sched, first_k_leaves(split, k), reduce_dtype)
    if in_loop
    else ()
  )
  skip = frozenset(i for l in loops for i in l.grads) | carried
  buckets = make_buckets(split, base, order, max(bucket_bytes, 1), skip, merge_tail, reduce_dtype)
  s_units, s_actions = _link_units(buckets, link, n_devices, order)
  s_units, s_actions = _with_loop_units(loops, s_units, s_actions, link, n_devices, order)
  eb = early_bytes(split) if early is not None and n_devices > 1 else None
  if eb is not None:
    u, a = early_unit(eb, early, link, n_devices, order)
    s_units = [*s_units, u]
    s_actions = (a, *s_actions) if early else (*s_actions, a)
  units = _packed(base, buckets, order, costs) + tuple(s_units)
  tl = in_flight_timeline(order, units, s_actions, in_flight)
  end = {sp.unit: sp.end for sp in tl.spans}
  # the compute stream's end: its last kernel, or a start (one in flight: issued when the
  # stream is there) that waited after it
  t_c = max(
    max((end[a.unit] for a in order), default=0.0),
    max((sp.start for sp in tl.spans if sp.stream == LINK_STREAM and in_flight), default=0.0),
  )
  size = {f"S{b.index}": b.nbytes for b in buckets}
  t = max(
    tl.makespan,
    _tail(t_c, [(end[a.unit], size[a.unit]) for a in s_actions if a.unit in size], costs),
  )
  compute = dataclasses.replace(sched, streams=(order,), syncs=(), makespan=t)
  deferred = first_k_leaves(split, k) | carried
  # the step's unpacks; a carried bucket's runs with the next step's update
  unpacks = sum(
    costs.unpack(b.nbytes) for b in buckets if not (b.grads and set(b.grads) <= deferred)
  )
  cross = (
    # the unpacks run after the reductions; deferring never makes the step longer
    min(
      cross_step_time(
        units,
        order,
        s_actions,
        buckets,
        deferred,
        carried_seconds(
          split, base, deferred, link, n_devices, bucket_bytes, costs.sync, reduce_dtype
        ),
        in_flight,
      )
      + unpacks,
      full.makespan if carried else t,
    )
    if cross
    else math.nan
  )
  if carried:  # the plan's step reduces every leaf in-step; `cross_step` carries them
    t = full.makespan
  return CollectivePlan(
    compute,
    buckets,
    s_actions,
    units,
    k,
    len(layers_forward(split)),
    bucket_bytes,
    link,
    n_devices,
    t,
    cross,
    loops,
    early,
    in_flight,
    reduce_dtype,
    carried,
  )


def _last_carried(
  split, sched, ks, sizes, link, n_devices, in_loop, costs, in_flight, reduce_dtype=None
):
  """The fastest cross-step plan carrying the last k layers (`last_k_leaves`); None for a
  split backward scan, whose stacked leaves its loop reduces (not carried that way)."""
  if in_loop:
    return None
  starts = forward_starts(split)
  best = None
  for k in ks:
    if not k:
      continue
    carried = last_k_leaves(split, k, starts)
    for b in sorted(sizes, reverse=True):
      p = build_plan(
        split,
        sched,
        0,
        b,
        link,
        n_devices,
        in_loop,
        costs=costs,
        merge_tail=True,
        in_flight=in_flight,
        carried=carried,
        reduce_dtype=reduce_dtype,
      )
      if best is None or p.cross_step < best.cross_step * (1 - 1e-9):
        best = p
  return best


def plan(
  split: Split,
  sched: Schedule,
  cost: CostModel,
  n_devices: int,
  link: str | Link | None = None,
  bucket_bytes: int | None = None,
  first_k: int | None = None,
  cross_step: bool = False,
  loss: bool = False,
  in_flight: int | None = PLAN_IN_FLIGHT,
  reduce_dtype=None,
) -> CollectivePlan:
  """Reverse first-k, buckets and the link schedule; see the module docstring.

  Args:
    split: from `passes.split.split`.
    sched: an in-order compute schedule of `split` (one stream).
    cost: prices the candidate schedules (its spec names the device).
    n_devices: size of the data-parallel axis.
    link: the network the all-reduces run on (a preset name or a `Link`).
    bucket_bytes: bytes per bucket; None chooses from `BUCKET_CANDIDATES`.
    first_k: layers to reverse; None chooses.
    cross_step: choose by `cross_step_time` (the first-k reductions finish in
      the next step, as in `ooojax.data_parallel`) instead of the makespan.
    loss: the caller all-reduces the value and aux leaves too (`BucketEmitter`'s
      `early`): its place, ahead of the first bucket or after the last, is chosen.
    in_flight: collectives in flight as candidates are priced: 1 is XLA:GPU's rule
      (a start waits for the previous done); the default, None, queues them on the
      link (see `costs.PLAN_IN_FLIGHT` for why).
    reduce_dtype: the dtype the gradients are reduced in (`Options.reduce_dtype`):
      buckets, their sizes and link costs count the bytes at it (`wire.link_bytes`).

  Returns:
    A `CollectivePlan`. Example:

    >>> import jax, jax.numpy as jnp
    >>> from ooojax.passes import split as sp, schedule as sc
    >>> def f(ct, w0, w1, x):
    ...   y, vjp = jax.vjp(lambda w0, w1: jnp.sum(jnp.tanh(x @ w0) @ w1), w0, w1)
    ...   return (y, *vjp(ct))
    >>> avals = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(), (3, 3), (3, 3), (4, 3)]]
    >>> s = sp.split(f, avals, n_grads=2, param_names=["['a']['w']", "['b']['w']"])
    >>> cm = CostModel("H100")
    >>> p = plan(s, sc.schedule(s, cm, streams=1), cm, 8, bucket_bytes=1, first_k=1)
    >>> [b.grads for b in p.buckets]
    [(1,), (0,)]
  """
  link = get_link(link)
  n_layers = len(layers_forward(split))
  if first_k is not None and first_k > n_layers:
    raise ValueError(
      f"first_k={first_k} is larger than the number of layers with weight "
      f"gradients ({n_layers}); use first_k <= {n_layers}"
    )
  sizes = (bucket_bytes,) if bucket_bytes is not None else BUCKET_CANDIDATES
  if first_k is not None:
    ks: Sequence[int] = (first_k,)
  else:
    step = max(1, math.ceil(n_layers / 12))
    ks = sorted(set(range(0, n_layers + 1, step)) | {n_layers})
  # a model with no fused scan has no in-loop reductions for any k: look once
  in_loop = bool(scan_collectives.loop_reductions(split, sched))
  # one device reduces nothing: no pack, no collective
  costs = BucketCosts.of(cost.spec) if n_devices > 1 else NO_BUCKET_COSTS
  # The small last bucket joined or apart and the loss reduced early or late are priced
  # with one collective in flight, which is what makes them cost. Queued on the link,
  # the search prices the tail apart and the plan then joins it, and the loss goes
  # first (`BucketEmitter`): the compiled programs' evidence (issue 53; priced joined,
  # nanodo D 1024 x8 chose 128 MB buckets, 3.92 ms replayed against 3.37).
  merges = (True, False) if in_flight else (False,)
  earlies = (True, False) if loss and in_flight else (None,)
  if len(sizes) == len(ks) == 1:
    # the small last bucket joined or apart, the loss reduced early or late: whichever
    # simulates faster (ties: joined, early)
    score = (lambda p: p.cross_step) if cross_step else (lambda p: p.makespan)
    best = None
    for m, e in ((m, e) for m in merges for e in earlies):
      p = build_plan(
        split,
        sched,
        ks[0],
        sizes[0],
        link,
        n_devices,
        in_loop,
        costs=costs,
        merge_tail=m or not in_flight,
        early=e,
        in_flight=in_flight,
        reduce_dtype=reduce_dtype,
      )
      if best is None or score(p) < score(best) * (1 - 1e-9):
        best = p
    return best
  # Every candidate is priced by `_Pricer`, exactly as `build_plan` simulates
  # it, in O(units) with what is shared across bucket sizes computed once per k.
  pricer = _Pricer(split, sched, link, n_devices, in_loop, costs, loss, in_flight, reduce_dtype)
  best, best_score = None, 0.0
  for b in sorted(sizes, reverse=True):
    for k in ks:
      # a small last bucket joined to the one before, or apart (`buckets.TRAILING_SHARE`),
      # and the loss reduced early or late: priced, as one collective in flight makes
      # each cost or not
      for merge in merges:
        for early in earlies:
          score = pricer.score(k, b, cross_step, merge, early)
          if best is None or score < best_score * (1 - 1e-9):
            best, best_score = (k, b, merge, early), score
  k, b, merge, early = best
  if cross_step and first_k is None:
    # the last layers the forward reads, carried with their dW in place: their
    # reductions fit under the next forward's earlier layers (a link-bound step,
    # where carrying the first layers would stall the forward at once)
    last = _last_carried(
      split, sched, ks, sizes, link, n_devices, in_loop, costs, in_flight, reduce_dtype
    )
    if last is not None and last.cross_step < best_score * (1 - 1e-9):
      return last
  return build_plan(
    split,
    sched,
    k,
    b,
    link,
    n_devices,
    in_loop,
    costs=costs,
    merge_tail=merge or not in_flight,
    early=early,
    in_flight=in_flight,
    reduce_dtype=reduce_dtype,
  )
