"""collectives.costs: what a gradient bucket costs as XLA:GPU compiles it (issue 53).

The ring all-reduce on the link (`allreduce_seconds`), a fixed cost per
all-reduce on the link and on the compute stream, and a bucket's pack / unpack
on the compute stream (`BucketCosts`), all read from the replay of compiled
programs (`passes.hlo.replay`). `collectives.plan` and its closed-form pricer
(`collectives.pricer`) price candidates with them.
"""

from __future__ import annotations

import dataclasses

from ooojax.passes.simulate import Link, LinkQueue


def allreduce_seconds(link: Link, nbytes: float, n_devices: int) -> float:
  """Ring all-reduce of `nbytes` over `n_devices` on `link` (0 on one device)."""
  if n_devices <= 1:
    return 0.0
  steps = 2 * (n_devices - 1)
  return steps * link.latency + steps / n_devices * nbytes / link.bandwidth


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


def tail(t: float, ends_sizes, costs: BucketCosts) -> float:
  """The step's end: each reduced bucket unpacked on the compute stream once both the
  stream (from `t`) and its transfer are done, in link order."""
  for end, nbytes in ends_sizes:
    t = max(t, end) + costs.unpack(nbytes)
  return t


# Collectives the planner lets be in flight when it prices a candidate: None, queued
# on the link (each transfer as soon as the link is free), not XLA:GPU's one
# (`passes.simulate.COLLECTIVES_IN_FLIGHT`). Checked against the compiled programs
# (issue 53, fourth pass), pricing one in flight chose larger buckets that replayed
# slower (nanodo D 1024 x8 NVLink: 128 MB, 3.47 ms planned, 3.92 replayed, against
# 25 MB, 3.56 planned, 3.37 replayed): XLA's scheduler does not keep the planned
# windows, it starts each all-reduce about as late as its own estimate allows.
PLAN_IN_FLIGHT = None


def one_in_flight(issues, in_flight: int | None = 1) -> tuple[float, list[float], list[float]]:
  """Transfers issued at the given compute-clock times (as if nothing stalled, in issue
  order), `(time, seconds)` each, as XLA:GPU runs them: one collective in flight
  (`passes.simulate.LinkQueue`, the rule the replay of a compiled program holds), so a
  start first waits for the previous transfer's done and every later kernel moves by
  that stall (`in_flight`: that many; None: no limit, queued on the link). Returns
  (the compute stream's total stall, each start, each end)."""
  q, shift, starts, ends = LinkQueue(in_flight), 0.0, [], []
  for t, seconds in issues:
    issued, start, end = q.start(t + shift, seconds)
    shift = issued - t
    starts.append(start)
    ends.append(end)
  return shift, starts, ends
