"""GSPMD data parallel and FSDP on a compile-only H100 x8: what XLA:GPU schedules.

nanodo's train step (`tests/nanodo.py`) under its own sharded jit, with
`jax.value_and_grad` (the authors') or `ooo.value_and_grad(mode="data_parallel")`.
No GPU runs: the schedule is read from the compiled HLO (`ooojax.gpu_hlo`).
"""

import functools
import re

import pytest

from ooojax import gpu_hlo

pytestmark = pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only H100: {gpu_hlo.unavailable_reason()}",
)

SIZES = dict(D=256, H=4, L=64, N=2, V=512, F=1024)


@functools.cache  # one compile per (fsdp, variant) in a run
def _counts(fsdp, variant):
  from benchmarks.dp_gspmd import h100_counts

  # the mechanism at a fixed bucket size: at this toy size the planner would step aside
  # (one all-reduce after the backward: nothing to gain, `explain` says)
  opts = {"bucket_bytes": 1 << 20} if variant == "ooo" else {}
  if variant == "ooo" and fsdp:  # the ZeRO-3 mechanism (fsdp="auto" keeps at this size)
    opts["fsdp"] = "regather"
  return h100_counts(fsdp, variant, 8, SIZES, **opts)


def test_data_parallel_reductions_overlap_backward_gemms():
  ours, base = _counts(False, "ooo"), _counts(False, "jax")
  ar = ours["all-reduce"]
  # early bucketed all-reduces, at least half with GEMMs scheduled inside their windows
  assert len(ar) >= 2 and 2 * sum(n > 0 for n in ar) >= len(ar), ours
  # the plain step: XLA's own combined reduction, fewer and larger all-reduces
  assert len(base["all-reduce"]) < len(ar), base


def test_loss_is_reduced_ahead_of_the_first_bucket():
  """The value's (and aux leaves') all-reduce, a few scalars, is chained ahead of the
  first gradient bucket: left after the step, XLA put it between two buckets, where
  (one collective in flight on XLA:GPU) it forced the earlier one's done early."""
  ours = _counts(False, "ooo")
  order = [shape for _, shape in sorted(zip(ours["all-reduce starts"], ours["all-reduce shapes"]))]
  # a scalar's type prints as f32[]; a bucket's as f32[262400]{0}
  small = [k for k, shape in enumerate(order) if not re.search(r"\[\d{3,}", shape)]
  assert len(order) >= 3 and small == [0], order


def test_fsdp_reduce_scatters_start_before_the_backward_ends():
  ours = _counts(True, "ooo")
  starts = ours["reduce-scatter starts"]
  assert len(starts) >= 2, ours
  assert min(starts) < ours["last gemm"], ours
  assert sum(n > 0 for n in ours["reduce-scatter"]) >= len(starts) // 2, ours
  assert ours["all-gather"], ours  # the parameters are gathered, not all-reduced


def test_fsdp_gathers_each_layer_in_the_forward_and_again_in_the_backward():
  """ZeRO-3: per-layer async all-gathers in the forward, each after the previous
  group's GEMMs started (GEMMs inside its window), gathered again in the backward;
  at least as many collectives overlapped as XLA's own step (whose gathers, at this
  size, are synchronous), in at most 1.05x its temporary memory."""
  ours, base = _counts(True, "ooo"), _counts(True, "jax")
  fwd, ag = ours["all-gather forward"], ours["all-gather"]
  assert len(fwd) >= SIZES["N"] + 1, ours  # the embeddings, then each layer
  assert sum(n > 0 for n in fwd) >= SIZES["N"], ours
  # gathered again in the backward; async (jax 0.12's XLA keeps 2 of 24 synchronous)
  assert len(ag) >= 2 * len(fwd) - 1 and ours["all-gather sync"] <= len(ag) // 8, ours
  overlapped = lambda c: sum(
    n > 0 for k in ("all-reduce", "reduce-scatter", "all-gather") for n in c[k]
  )
  assert overlapped(ours) >= overlapped(base), (ours, base)
  # 1/N of the parameters held: compiled temporary memory at most plain jit's
  assert ours["temp"] <= 1.05 * base["temp"], (ours["temp"], base["temp"])
