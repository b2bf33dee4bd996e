"""`DataParallelReport.versus_xla`: ooojax's compiled step next to XLA's own, per link."""

import jax
import jax.numpy as jnp
import pytest

import ooojax as ooo
from ooojax import gpu_hlo
from tests.models import tanh_mlp_structs

pytestmark = pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only H100: {gpu_hlo.unavailable_reason()}",
)

L, D = 3, 256
PARAMS, loss = tanh_mlp_structs(L, D)


def _report(**kw):
  """The data-parallel report of `loss` on 8 compile-only H100s, one all-reduce per leaf."""
  return ooo.explain(
    loss,
    PARAMS,
    jax.ShapeDtypeStruct((128, D), jnp.float32),
    mode="data_parallel",
    axis_name="batch",
    axis_size=8,
    device="H100",
    bucket_bytes=1,
    **kw,
  )


def test_versus_xla_per_link():
  r = _report(link="25GbE")
  assert ".versus_xla()" in r.summary()
  v = r.versus_xla(links=("25GbE", "nvlink"))
  assert [row.link for row in v.rows] == ["25GbE", "nvlink"] and v.devices == 8
  for row in v.rows:
    # one all-reduce per leaf (bucket_bytes=1) against XLA's combined one(s)
    assert row.ooo.reductions == 2 * L > row.xla.reductions >= 1
    assert row.ooo.step >= row.ooo.compute and row.xla.exposed > 0
  slow, fast = v.rows
  assert slow.xla.exposed > fast.xla.exposed  # the same program on a slower link
  assert v.ooo_temp > 0 and v.xla_temp > 0
  assert v.best("nvlink") in ("ooojax", "XLA")
  text = v.summary()
  assert "XLA's own" in text and "not timed" in text and "25GbE" in text
  assert "<pre>" in v._repr_html_()


def test_versus_xla_bucket_size_chosen_on_the_compiled_program():
  r = _report()
  v = r.versus_xla(links=("nvlink",), buckets=(1 << 30,))
  (row,) = v.rows
  assert v.buckets == (1 << 30,) and row.bucket_bytes in (1, 1 << 30)
  # the whole gradient in one bucket: fewer all-reduces, each latency paid once
  assert row.bucket_bytes == 1 << 30 and row.ooo.reductions < 2 * L
  assert "chosen per link on the compiled programs" in v.summary()
  with pytest.raises(ValueError, match="positive"):
    r.versus_xla(buckets=(0,))


def test_planner_bucket_choice_matches_the_compiled_programs():
  """The plan's own bucket size (chosen by its simulator, which prices the packs and each
  all-reduce's fixed cost) replays at least as fast as one leaf per all-reduce and as one
  bucket for everything, each compiled for 8 H100s (the compiled program is ground truth)."""
  params, mlp = tanh_mlp_structs(8, 1024)
  r = ooo.explain(
    mlp,
    params,
    jax.ShapeDtypeStruct((128, 1024), jnp.float32),
    mode="data_parallel",
    axis_name="batch",
    axis_size=8,
    device="H100",
    first_k=0,
  )
  assert "bucket_bytes" in r.chosen
  v = r.versus_xla(links=("nvlink",), buckets=(1, 1 << 30))
  (row,) = v.rows
  assert row.bucket_bytes == r.plan.bucket_bytes, v.summary()
