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
   smaller k.
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
from ooojax.passes.collectives.loops import LoopReduce
from ooojax.passes.cost import CostModel, _nbytes
from ooojax.passes.ir import Action, Schedule, Split, Unit, UnitKind
from ooojax.passes.simulate import LINKS, Link, Timeline, simulate

REDUCTIONS = ("mean", "sum")
# Bucket candidates when the cost model chooses (bytes); 0 = one per dW cluster.
BUCKET_CANDIDATES = (0, 1 << 20, 4 << 20, 16 << 20, 25 << 20, 64 << 20, 128 << 20, 256 << 20)
LINK_STREAM = 1
# Seconds each all-reduce costs on the link beyond its ring time, as XLA:GPU
# compiles it (NCCL launch, the start/done pair; XLA keeps few in flight).
# Fitted to the replay of compiled nanodo steps (D 1024 / 2048, 8 H100s, NVLink
# and IB 400): each bucket more cost 30-35 us of step there.
COLLECTIVE_SECONDS = 30e-6
# ... and what each costs the compute stream (its start and done; XLA keeps few in
# flight, so a done waits): in those replays 26 buckets exposed 0.9 ms more than 8,
# about 50 us a bucket of which the link's share above explains 30 us or less.
COLLECTIVE_SYNC_SECONDS = 20e-6


@dataclasses.dataclass(frozen=True)
class BucketCosts:
  """Compute-stream seconds per byte and per kernel of a bucket's pack / unpack."""

  launch: float  # one kernel
  per_byte: float  # one pass over a byte: read or write (1 / memory bandwidth)
  sync: float = 0.0  # the all-reduce's start / done on the compute stream

  @classmethod
  def of(cls, spec) -> BucketCosts:
    return cls(spec.launch, 1.0 / spec.bandwidth, COLLECTIVE_SYNC_SECONDS)

  def pack(self, n_leaves: int, nbytes: int) -> float:
    """The concatenation of a bucket of several leaves (the 1/n scale fused in), and
    the all-reduce's start / done."""
    return self.sync + (self.launch + 2 * nbytes * self.per_byte if n_leaves > 1 else 0.0)

  def unpack(self, nbytes: int) -> float:
    """Its slices back into leaves, or one leaf's scale, after the done."""
    return self.launch + 2 * nbytes * self.per_byte


NO_BUCKET_COSTS = BucketCosts(0.0, 0.0)


def bucket_seconds(link: Link, nbytes: float, n_devices: int) -> float:
  """One bucket's all-reduce on the link as XLA runs it: the ring plus `COLLECTIVE_SECONDS`."""
  return allreduce_seconds(link, nbytes, n_devices) + (COLLECTIVE_SECONDS if n_devices > 1 else 0)


def _tail(t: float, ends_sizes, costs: BucketCosts) -> float:
  """The step's end: each reduced bucket unpacked on the compute stream once both the
  stream (from `t`) and its transfer are done, in link order."""
  for end, nbytes in ends_sizes:
    t = max(t, end) + costs.unpack(nbytes)
  return t


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


def allreduce_seconds(link: Link, nbytes: float, n_devices: int) -> float:
  """Ring all-reduce of `nbytes` over `n_devices` on `link` (0 on one device)."""
  if n_devices <= 1:
    return 0.0
  steps = 2 * (n_devices - 1)
  return steps * link.latency + steps / n_devices * nbytes / link.bandwidth


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Gradient leaves reduced by one all-reduce, issued after unit `after`."""

  index: int
  grads: tuple[int, ...]  # gradient leaf positions (0 = first gradient output)
  nbytes: int
  after: str  # compute unit after which it is issued ("" = at the end)


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

  @property
  def in_loop(self) -> frozenset[int]:
    """Gradient leaf positions the loops that compute them reduce."""
    return frozenset(i for l in self.loops for i in l.grads)

  @property
  def streams(self) -> tuple[tuple[Action, ...], ...]:
    return (self.schedule.streams[0], self.link_actions)

  def timeline(self) -> Timeline:
    return simulate(self.streams, self.units, 0.0, links=(LINK_STREAM,))

  def to_text(self) -> str:
    return "\n".join(" ".join(str(a) for a in s) for s in self.streams)


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


def _grad_bytes(split: Split) -> list[int]:
  outs = split.jaxpr.jaxpr.outvars[split.grad_out_start :]
  return [_nbytes(v.aval) for v in outs]


def make_buckets(
  split: Split,
  units: Sequence[Unit],
  order: Sequence[Action],
  bucket_bytes: int,
  skip: frozenset[int] = frozenset(),
) -> tuple[Bucket, ...]:
  """Groups gradient leaves into buckets in the order their dW clusters finish.

  Leaves in `skip` (reduced inside a loop) get no bucket.
  """
  groups = _group(_finishing(split, units, order, skip), bucket_bytes)
  return tuple(Bucket(i, leaves, size, after) for i, (leaves, size, after) in enumerate(groups))


def _finishing(split: Split, units, order, skip) -> tuple:
  """What bucketing reads of an order: `(first, last, rest, nbytes)`.

  `first`: (leaf, unit) per gradient leaf, in the order its first dW unit
  runs; `last`: leaf -> (position, unit) of its last dW unit; `rest`: leaves
  no dW unit produces (unused parameters, pass-through gradients).
  """
  nbytes = _grad_bytes(split)
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


def _group(finishing, bucket_bytes: int) -> list[tuple[tuple[int, ...], int, str]]:
  """(leaves, bytes, unit issued after) per bucket; a full bucket closes at its last leaf."""
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
  if cur:  # after the last dW unit of any of its leaves
    out.append((tuple(cur), size, max(last[l] for l in cur)[1]))
  if rest:
    out.append((rest, sum(nbytes[i] for i in rest), ""))
  return out


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


def cross_step_time(units, order, s_actions, buckets, deferred: frozenset[int]) -> float:
  """Steady-state step time when the deferred buckets' reductions finish next step.

  A model, not a measurement: the step ends when the compute and the
  non-deferred reductions are done; the deferred reductions (layer 0 first)
  then start once both the compute and the link are free and run while the
  next step's forward runs; only the part longer than that forward is
  exposed. The link carries every byte of every step, so the period is never
  below the link's busy time, nor below the compute.
  """
  by_name = {u.name: u for u in units}
  late = {f"S{b.index}" for b in buckets if b.grads and set(b.grads) <= deferred}
  kept = tuple(a for a in s_actions if a.unit not in late)
  t_nd = simulate((order, kept), units, 0.0, links=(LINK_STREAM,)).makespan
  t_c = sum(by_name[a.unit].cost for a in order)
  comm = sum(by_name[u].cost for u in late)
  fwd = by_name["F0"].cost if "F0" in by_name else 0.0
  link_busy = sum(by_name[a.unit].cost for a in s_actions)
  return max(t_c, t_nd, link_busy, max(t_c, t_nd) + comm - fwd)


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
) -> CollectivePlan:
  """The plan for one choice of k and bucket size (what `plan` compares).

  `in_loop=False` buckets a scanned stack's dW too (reduced after its loop):
  the baseline the benchmarks compare the in-loop reductions with.
  `cross=False` leaves `cross_step` at NaN (one simulation less per candidate).
  `costs`: the buckets' pack / unpack on the compute stream (`BucketCosts.of(spec)`;
  None: free).
  """
  costs = costs or NO_BUCKET_COSTS
  base = sched.units
  order = reverse_first_k(split, base, sched.streams[0], k) if k else tuple(sched.streams[0])
  loops = (
    scan_collectives.loop_reductions(split, sched, first_k_leaves(split, k)) if in_loop else ()
  )
  skip = frozenset(i for l in loops for i in l.grads)
  buckets = make_buckets(split, base, order, max(bucket_bytes, 1), skip)
  s_units, s_actions = _link_units(buckets, link, n_devices, order)
  s_units, s_actions = _with_loop_units(loops, s_units, s_actions, link, n_devices, order)
  units = _packed(base, buckets, order, costs) + tuple(s_units)
  tl = simulate((order, s_actions), units, 0.0, links=(LINK_STREAM,))
  end = {sp.unit: sp.end for sp in tl.spans}
  t_c = max((end[a.unit] for a in order), default=0.0)
  size = {f"S{b.index}": b.nbytes for b in buckets}
  t = max(
    tl.makespan,
    _tail(t_c, [(end[a.unit], size[a.unit]) for a in s_actions if a.unit in size], costs),
  )
  compute = dataclasses.replace(sched, streams=(order,), syncs=(), makespan=t)
  deferred = first_k_leaves(split, k)
  # the step's unpacks; a carried bucket's runs with the next step's update
  unpacks = sum(
    costs.unpack(b.nbytes) for b in buckets if not (b.grads and set(b.grads) <= deferred)
  )
  cross = (
    # the unpacks run after the reductions; deferring never makes the step longer
    min(cross_step_time(units, order, s_actions, buckets, first_k_leaves(split, k)) + unpacks, t)
    if cross
    else math.nan
  )
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
  )


def plan(
  split: Split,
  sched: Schedule,
  cost: CostModel,
  n_devices: int,
  link: str | Link | None = None,
  bucket_bytes: int | None = None,
  first_k: int | None = None,
  cross_step: bool = False,
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
  if len(sizes) == len(ks) == 1:
    return build_plan(split, sched, ks[0], sizes[0], link, n_devices, in_loop, costs=costs)
  # Every candidate is priced by `_Pricer`, exactly as `build_plan` simulates
  # it, in O(units) with what is shared across bucket sizes computed once per k.
  pricer = _Pricer(split, sched, link, n_devices, in_loop, costs)
  best, best_score = None, 0.0
  for b in sorted(sizes, reverse=True):
    for k in ks:
      score = pricer.score(k, b, cross_step)
      if best is None or score < best_score * (1 - 1e-9):
        best, best_score = (k, b), score
  return build_plan(split, sched, best[0], best[1], link, n_devices, in_loop, costs=costs)


class _Pricer:
  """The simulated step of each (k, bucket size) candidate without building its plan.

  With one compute stream and the link, `simulate` runs the compute back to
  back (each unit after the previous one, its deps earlier in the order) and
  each transfer at `max(link free, its compute dep done)`: a closed form,
  one pass over the buckets, with what does not depend on the bucket size
  computed once per k (from per-action facts computed once).
  `tests/test_dp_plan.py` checks it against `build_plan`'s simulation.
  """

  def __init__(self, split, sched, link, n_devices, in_loop, costs=None):
    self.split, self.sched, self.link, self.n = split, sched, link, n_devices
    self.in_loop = in_loop
    self.costs = costs or NO_BUCKET_COSTS
    self.by_k: dict = {}
    self.by_name = {u.name: u for u in sched.units}
    self.fwd = self.by_name["F0"].cost if "F0" in self.by_name else 0.0
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
    self.nbytes = _grad_bytes(split)

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
      loops = scan_collectives.loop_reductions(self.split, sched, deferred)
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

  def score(self, k: int, bucket_bytes: int, cross_step: bool) -> float:
    """`build_plan(...).makespan`, or `.cross_step` when `cross_step`."""
    _, deferred, _, ends, t_c, finishing, final = self._per_k(k)
    if finishing is None:  # in-loop reductions: the link units as `build_plan` makes them
      return self._score_units(k, bucket_bytes, cross_step)
    link, n, costs = self.link, self.n, self.costs
    groups = _group(finishing, max(bucket_bytes, 1))
    # `_packed`: each pack lengthens the unit its bucket is issued after, and so
    # delays everything after it (the issuing units run in bucket order)
    packed, at = 0.0, {}
    for leaves, size, after in groups:
      packed += costs.pack(len(leaves), size)
      at[after or final] = packed
    t_c += packed
    free = free_nd = comm = busy = 0.0
    done = []
    for leaves, size, after in groups:
      cost = bucket_seconds(link, size, n)
      ready = ends.get(after or final, 0.0) + at[after or final]
      free = max(free, ready) + cost
      done.append((free, size))
      busy += cost
      if cross_step and leaves and deferred.issuperset(leaves):
        comm += cost
      else:
        free_nd = max(free_nd, ready) + cost
    if not cross_step:
      return _tail(t_c, done, costs)
    t_nd = max(t_c, free_nd)  # `cross_step_time`'s terms
    unpacks = sum(
      costs.unpack(size)
      for leaves, size, _ in groups
      if not (leaves and deferred.issuperset(leaves))
    )
    raw = max(t_c, t_nd, busy, max(t_c, t_nd) + comm - self.fwd) + unpacks
    return min(raw, self.score(k, bucket_bytes, False))

  def _score_units(self, k, bucket_bytes, cross_step):
    order, deferred, loops, ends, t_c, _, final = self._per_k(k)
    skip = frozenset(i for l in loops for i in l.grads)
    buckets = make_buckets(self.split, self.sched.units, order, max(bucket_bytes, 1), skip)
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
    cost = {u.name: u.cost for u in s_units}
    dep = {u.name: max((ends[d] for d in u.deps if d in ends), default=0.0) for u in s_units}

    def link_end(actions):
      free, done = 0.0, {}
      for a in actions:
        free = done[a.unit] = max(free, dep[a.unit]) + cost[a.unit]
      return free, done

    size = {f"S{b.index}": b.nbytes for b in buckets}
    if not cross_step:
      free, done = link_end(s_actions)
      tail = _tail(t_c, [(done[a.unit], size[a.unit]) for a in s_actions if a.unit in size], costs)
      return max(t_c, free, tail)
    late = {f"S{b.index}" for b in buckets if b.grads and set(b.grads) <= deferred}
    t_nd = max(t_c, link_end([a for a in s_actions if a.unit not in late])[0])
    comm = sum(cost[u] for u in late)
    link_busy = sum(cost[a.unit] for a in s_actions)
    unpacks = sum(costs.unpack(b.nbytes) for b in buckets if f"S{b.index}" not in late)
    raw = max(t_c, t_nd, link_busy, max(t_c, t_nd) + comm - self.fwd) + unpacks
    return min(raw, self._score_units(k, bucket_bytes, False))
