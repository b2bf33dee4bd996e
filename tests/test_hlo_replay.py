"""passes.hlo.replay: a scheduled GPU module priced on a compute stream next to one link."""

import jax
import jax.numpy as jnp
import pytest

import ooojax as ooo
from ooojax import gpu_hlo
from ooojax.passes.cost import DeviceSpec
from ooojax.passes.hlo.replay import REPLAY_LINKS, collective_seconds, replay
from ooojax.passes.simulate import Link
from tests.models import tanh_mlp_structs

# Round numbers: a GEMM of 2 * 256^3 FLOPs takes 1 us launch + 33.554 us.
SPEC = DeviceSpec("T", 1e12, 2e12, 1e12, 1e12, 1e-6, 1)
LINK = Link("L", 1e-6, 1e9)
GEMM = (
  'custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":'
  '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
  '"rhs_contracting_dimensions":["0"]}}}'
)
HAND = f"""HloModule t, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%cond (c: (s32[], f32[256,256])) -> pred[] {{
  %c = (s32[], f32[256,256]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

%body (c: (s32[], f32[256,256])) -> (s32[], f32[256,256]) {{
  %c = (s32[], f32[256,256]{{1,0}}) parameter(0)
  %x = f32[256,256]{{1,0}} get-tuple-element(%c), index=1
  %e = f32[256,256]{{1,0}} fusion(%x), kind=kLoop, calls=%add
  %i = s32[] get-tuple-element(%c), index=0
  ROOT %t = (s32[], f32[256,256]{{1,0}}) tuple(%i, %e)
}}

ENTRY %main (p: f32[256,256], w: f32[256,256]) -> f32[64,256] {{
  %p = f32[256,256]{{1,0}} parameter(0)
  %w = f32[256,256]{{1,0}} parameter(1)
  %g0 = f32[256,256]{{1,0}} custom-call(%p, %w), {GEMM}
  %s = f32[256,256]{{1,0}} all-reduce-start(%g0), replica_groups={{{{0,1,2,3}}}}, to_apply=%add
  %g1 = f32[256,256]{{1,0}} custom-call(%p, %w), {GEMM}
  %d = f32[256,256]{{1,0}} all-reduce-done(%s)
  %g2 = f32[256,256]{{1,0}} custom-call(%d, %w), {GEMM}
  %z = s32[] constant(0)
  %init = (s32[], f32[256,256]{{1,0}}) tuple(%z, %g2)
  %loop = (s32[], f32[256,256]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  %y = f32[256,256]{{1,0}} get-tuple-element(%loop), index=1
  ROOT %rs = f32[64,256]{{1,0}} reduce-scatter(%y), replica_groups=[1,4]<=[4], dimensions={{0}}, to_apply=%add
}}
"""


def test_replay_of_a_hand_worked_module():
  r = replay(HAND, 4, LINK, SPEC)
  gemm = 1e-6 + 2 * 256**3 / 1e12  # TF32 peak; 0.79 us of bytes stay under it
  compare = 1e-6 + 1 / 1e12  # the loop condition: one launch, 3 trips
  loop = 1e-6 + 2 * 256 * 256 * 4 / 1e12  # elementwise: bytes in + out
  ar = 6 * 1e-6 + 1.5 * 256 * 256 * 4 / 1e9  # ring: 2(n-1) steps, 2(n-1)/n of the bytes
  rs = 3 * 1e-6 + 0.75 * 256 * 256 * 4 / 1e9  # (n-1) steps, (n-1)/n of the input
  assert r.compute == pytest.approx(3 * gemm + 3 * (compare + loop))
  assert r.comm == pytest.approx(ar + rs)
  # g1 runs inside the all-reduce's window; the done then waits ar - gemm;
  # the synchronous reduce-scatter is exposed whole.
  assert r.exposed == pytest.approx(ar - gemm + rs)
  assert r.step == pytest.approx(r.compute + r.exposed)
  assert r.kernels == 9 and r.reductions == 2
  ar_t, rs_t = r.transfers
  assert (ar_t.kind, ar_t.nbytes, rs_t.kind, rs_t.nbytes) == (
    "all-reduce",
    262144,
    "reduce-scatter",
    262144,
  )
  assert ar_t.start == pytest.approx(gemm) and ar_t.exposed == pytest.approx(ar - gemm)
  # the link serialises: a slower link only adds exposed time here
  slow = replay(HAND, 4, Link("S", 1e-6, 1e8), SPEC)
  assert slow.compute == pytest.approx(r.compute) and slow.exposed > 9 * r.exposed
  assert "exposed" in r.summary()


def test_link_costs_and_errors():
  n, b = 8, 1 << 20
  bw = REPLAY_LINKS["IB400"].bandwidth
  assert collective_seconds("all-reduce", b, 1, LINK) == 0.0
  ar = collective_seconds("all-reduce", b, n, REPLAY_LINKS["IB400"])
  rs = collective_seconds("reduce-scatter", b, n, REPLAY_LINKS["IB400"])
  assert ar == pytest.approx(14 * 3e-6 + 1.75 * b / bw)
  assert rs == pytest.approx(7 * 3e-6 + 0.875 * b / bw)
  assert {"nvlink", "IB100", "IB400", "25GbE"} <= set(REPLAY_LINKS)
  # replica groups in the mesh form XLA prints on 0.11: the named axes' sizes
  two_d = HAND.replace("replica_groups=[1,4]<=[4]", "replica_groups=mesh['d'=2, 'm'=4] {'m'}")
  two_d = two_d.replace("replica_groups={{0,1,2,3}}", "replica_groups=mesh['d'=2, 'm'=4] {'d'}")
  ar, rs = replay(two_d, 8, LINK, SPEC).transfers
  assert ar.end - ar.start == pytest.approx(collective_seconds("all-reduce", ar.nbytes, 2, LINK))
  assert rs.end - rs.start == pytest.approx(
    collective_seconds("reduce-scatter", rs.nbytes, 4, LINK)
  )
  with pytest.raises(ValueError, match="unknown link"):
    replay(HAND, 4, "carrier-pigeon")
  with pytest.raises(ValueError, match="n_devices"):
    replay(HAND, 0)


@pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only H100: {gpu_hlo.unavailable_reason()}",
)
def test_replay_of_the_compiled_plan_agrees_with_the_plan():
  # ooojax's data-parallel plan (cost + link model over the jaxpr) and the
  # replay of the program XLA compiled from it (H100 x8): the same buckets,
  # the same link time, the step within 15%.
  D = 512
  params, loss = tanh_mlp_structs(4, D)

  r = ooo.explain(
    loss,
    params,
    jax.ShapeDtypeStruct((512, D), jnp.float32),
    mode="data_parallel",
    axis_name="batch",
    axis_size=8,
    device="H100",
    link="100GbE",
    bucket_bytes=1 << 20,
  )
  rp = replay(r.compiled("H100").text, 8, r.plan.link, "H100")
  assert len(rp.transfers) == len(r.buckets) >= 2
  assert rp.comm == pytest.approx(r.comm_seconds, rel=0.15)
  assert rp.step == pytest.approx(r.plan.makespan, rel=0.15)
  assert rp.exposed == pytest.approx(r.exposed_seconds, rel=0.15)


def test_replay_calibrated_by_kernel_class():
  """`calibration=`: each kernel costs launch_seconds + scale[its class] * roofline work."""
  from ooojax.passes.calibration import Calibration

  cal = Calibration.from_dict(
    {
      "format": 1,
      "device": "T",
      "jax": "0",
      "kernel_scale": {"gemm": 2.0, "other": 0.5},
      "launch_seconds": 3e-6,
    }
  )
  r = replay(HAND, 4, LINK, SPEC, calibration=cal)
  gemm = 3e-6 + 2.0 * 2 * 256**3 / 1e12
  compare = 3e-6 + 0.5 * 1 / 1e12
  loop = 3e-6 + 0.5 * 2 * 256 * 256 * 4 / 1e12
  assert r.compute == pytest.approx(3 * gemm + 3 * (compare + loop))
  with pytest.raises(ValueError, match="kernel_scale"):
    Calibration.from_dict({"format": 1, "device": "T", "jax": "0", "kernel_scale": {"gemm": 0}})


def test_shipped_h200_calibration_and_its_fit():
  """The shipped H200 calibration holds the replay's kernel factors (benchmarks.dp_calibrate
  --fit) beside the stream-call costs (issue 50); `fit` recovers known factors from
  synthetic kernels."""
  from benchmarks.dp_calibrate import fit
  from ooojax.passes import calibration

  cal = calibration.load(calibration.SHIPPED / "h200.json")
  assert set(cal.kernel_scale) == {"gemm", "other"} and 0 < cal.launch_seconds < 1e-4
  assert 0 < cal.call_seconds < cal.pinned_call_seconds
  works = {"a": [("f.1", False, 1e-3), ("g", True, 2e-3), ("f.2", False, 1e-3)]}
  rec = {"a": {"kernels_s": {"f_1": 1.5e-3}, "kernel_s": 1.5e-3 * 2 + 3 * 2e-3}}
  rec["a"].update(wall_s=rec["a"]["kernel_s"] + 3 * 4e-6, kernels=3)
  got = fit(works, rec)
  assert got["kernel_scale"] == pytest.approx({"gemm": 3.0, "other": 1.5})
  assert got["launch_seconds"] == pytest.approx(4e-6)


def test_one_collective_in_flight_is_the_rule_the_planner_prices():
  """`in_flight=1`: a start forces the previous collective's done (XLA:GPU's default), the
  stall the data-parallel planner prices with the same rule (`costs.one_in_flight`)."""
  from ooojax.passes.collectives.costs import one_in_flight

  ar_ops = "replica_groups={{0,1,2,3}}, to_apply=%add"
  two = HAND.split("ENTRY")[0] + (
    "ENTRY %main (p: f32[256,256], w: f32[256,256]) -> f32[256,256] {\n"
    "  %p = f32[256,256]{1,0} parameter(0)\n"
    "  %w = f32[256,256]{1,0} parameter(1)\n"
    f"  %g0 = f32[256,256]{{1,0}} custom-call(%p, %w), {GEMM}\n"
    f"  %s0 = f32[256,256]{{1,0}} all-reduce-start(%g0), {ar_ops}\n"
    f"  %g1 = f32[256,256]{{1,0}} custom-call(%p, %w), {GEMM}\n"
    f"  %s1 = f32[256,256]{{1,0}} all-reduce-start(%g1), {ar_ops}\n"
    + "".join(f"  %g{i} = f32[256,256]{{1,0}} custom-call(%p, %w), {GEMM}\n" for i in (2, 3, 4))
    + "  %d0 = f32[256,256]{1,0} all-reduce-done(%s0)\n"
    "  ROOT %d1 = f32[256,256]{1,0} all-reduce-done(%s1)\n}\n"
  )
  link = Link("M", 1e-6, 7.5e9)
  gemm = 1e-6 + 2 * 256**3 / 1e12
  ar = 6 * 1e-6 + 1.5 * 256 * 256 * 4 / 7.5e9  # 58 us: longer than a GEMM
  free = replay(two, 4, link, SPEC)  # as printed: both in flight, the link queues them
  assert free.compute == pytest.approx(5 * gemm) and free.exposed == pytest.approx(0.0)
  one = replay(two, 4, link, SPEC, in_flight=1)
  # s1 (after g1) waits for s0's transfer: ar - gemm stalled, the GEMMs after it later
  assert one.exposed == pytest.approx(ar - gemm)
  stall, starts, ends = one_in_flight([(gemm, ar), (2 * gemm, ar)])
  assert stall == pytest.approx(one.exposed)
  assert [t.start for t in one.transfers] == pytest.approx(starts)
  assert [t.end for t in one.transfers] == pytest.approx(ends)
