"""`benchmarks.gpu_trace` reads a device trace right (a synthetic one: no GPU here)."""

import pytest
from jax.profiler import ProfileData

from benchmarks import gpu_trace

MS = 10**9  # picoseconds


def _line(i, name, events):
  evs = " ".join(
    f"events {{ metadata_id: {m} offset_ps: {int(s * MS)} duration_ps: {int(d * MS)} }}"
    for m, s, d in events
  )
  return f'lines {{ id: {i} name: "{name}" timestamp_ns: 0 {evs} }}'


def _meta(names):
  return " ".join(
    f'event_metadata {{ key: {k} value {{ id: {k} name: "{n}" }} }}' for k, n in names
  )


def _space(streams, extra=""):
  lines = " ".join(_line(i, n, evs) for i, (n, evs) in enumerate(streams, 1))
  names = _meta([(1, "conv"), (2, "fusion"), (3, "dw_conv"), (4, "module")])
  return ProfileData.from_text_proto(
    f'planes {{ name: "/device:GPU:0" {lines} {names} }} '
    f'planes {{ name: "/host:CPU" {_line(9, "python", [(4, 0, 50)])} {names} }} {extra}'
  )


def test_busy_idle_and_overlap_by_hand():
  # stream 1: conv [0, 2), fusion [5, 6); stream 2: dw_conv [1, 3.5); the derived
  # "XLA Modules" line spans everything and must not count as a stream
  p = _space(
    [
      ("Stream #1(compute)", [(1, 0, 2), (2, 5, 1)]),
      ("Stream #2(compute)", [(3, 1, 2.5)]),
      ("XLA Modules", [(4, 0, 6)]),
    ]
  )
  s = gpu_trace.summarize(p, steps=1)
  assert s.span == pytest.approx(6.0)
  assert s.busy == pytest.approx(4.5)  # [0, 3.5) and [5, 6)
  assert s.idle == pytest.approx(1.5)
  assert s.both == pytest.approx(1.0)  # [1, 2)
  assert s.kernel == pytest.approx(5.5)
  assert [(n, k) for n, k, _ in s.streams] == [("Stream #1(compute)", 2), ("Stream #2(compute)", 1)]
  # per step: two steps traced halve every figure
  assert gpu_trace.summarize(p, steps=2).busy == pytest.approx(2.25)


def test_shared_kernels_and_the_table():
  base = gpu_trace.summarize(_space([("Stream #1", [(1, 0, 2), (2, 2, 1)])]), 1)
  var = gpu_trace.summarize(
    _space([("Stream #1", [(1, 0, 3), (2, 3, 1)]), ("Stream #2", [(3, 0, 2)])]), 1
  )
  assert gpu_trace.shared_ms(var, base, 1) == pytest.approx((3.0, 4.0))  # conv ran slower
  rows = {"jax.grad": (0.004, base), "ooo single_gpu": (0.005, var), "cpu": (0.001, None)}
  text = "\n".join(gpu_trace.table(rows, 1))
  assert gpu_trace.own(var, base, 1) == pytest.approx((1, 2.0))  # dw_conv
  assert (
    "| ooo single_gpu | 5.00 | 4.00 | 4.00 | 0.00 | 2.00 | 6.00 | 4.00 (3.00) | 1, 2.00 |" in text
  )
  assert "| cpu | 1.00 | no GPU stream lines" in text


def test_no_gpu_plane_is_none():
  assert gpu_trace.summarize(_space([]), 1) is None


def test_gaps_are_attributed_to_the_host_events_beside_them():
  from benchmarks import gpu_gaps

  # device: conv [0, 2) on stream 1, dw_conv [5, 6) on stream 2: one 3 ms gap [2, 5);
  # host (CUPTI): a wait [1.5, 4.5) overlaps it by 2.5 ms, a launch [4.5, 5.5) by 0.5 ms
  cupti = (
    f'planes {{ name: "/host:CUPTI" {_line(7, "api", [(1, 1.5, 3), (2, 4.5, 1)])} '
    + _meta([(1, "cuStreamWaitEvent"), (2, "cuLaunchKernel")])
    + " }"
  )
  p = _space([("Stream #1(compute)", [(1, 0, 2)]), ("Stream #2(compute)", [(3, 5, 1)])], cupti)
  g, totals = gpu_gaps.analyse(p, steps=1, min_gap_us=10, top=3)
  assert g["n"] == 1 and g["idle_ms"] == pytest.approx(3.0)
  over = {name: ns / 1e6 for (_, name), ns in g["over"].items()}
  assert over == pytest.approx({"cuStreamWaitEvent": 2.5, "cuLaunchKernel": 0.5})
  ((start, end, before, after),) = g["big"]
  assert before == ("conv", "Stream #1(compute)") and after[0] == "dw_conv"
  assert totals[("/host:CUPTI", "cuStreamWaitEvent")][:2] == [1, pytest.approx(3.0)]
  # the python line (the user's own loop) is not a host event of the step
  assert not any(name == "module" for _, name in totals)
  text = "\n".join(gpu_gaps.report("v", (g, totals), totals, None, 1, 3))
  assert "cuStreamWaitEvent" in text and "dispatched through Python" not in text
  totals[("/host:CPU", "$pjit.py:257 cache_miss")] = [1, 0.5, 500.0]
  text = "\n".join(gpu_gaps.report("v", (g, totals), totals, None, 1, 3))
  assert "jit dispatched through Python 1x a step" in text


def test_host_event_names_drop_their_arguments():
  from benchmarks import gpu_gaps

  assert (
    gpu_gaps._norm("Thunk:#hlo_op=call-start.3,hlo_module=jit_step#") == "Thunk:hlo_op=call-start"
  )
