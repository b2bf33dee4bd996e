"""passes.hlo.pgle: the link model handed to XLA:GPU's scheduler as a latency profile."""

import jax
import jax.numpy as jnp
import pytest

import ooojax as ooo
from ooojax import gpu_hlo
from ooojax.passes.hlo.pgle import PGLE_OPTION, compiler_options, profile
from ooojax.passes.hlo.replay import replay
from tests.models import tanh_mlp_structs
from tests.test_hlo_replay import HAND


def test_profile_names_each_collective_with_its_link_time(tmp_path):
  # The hand module's two collectives, each at its own time on the link (not queued).
  r = replay(HAND, 4, "IB100")
  text = profile(HAND, 4, "IB100")
  assert text.splitlines() == [
    f'costs {{ name: "{t.name}" cost_us: {(t.end - t.start) * 1e6:.3f} }}' for t in r.transfers
  ]
  assert [t.name for t in r.transfers] == ["s", "rs"]
  opts = compiler_options(HAND, 4, "IB100", str(tmp_path / "p.pbtxt"))
  assert opts == {PGLE_OPTION: str(tmp_path / "p.pbtxt")}
  assert (tmp_path / "p.pbtxt").read_text() == text


@pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only H100: {gpu_hlo.unavailable_reason()}",
)
def test_the_profile_moves_xlas_starts_earlier():
  # A backward long enough to cover the 100GbE transfers: XLA's own estimate
  # (NVLink-fast) starts each bucket's all-reduce late; told the link's cost, it
  # opens every window wider and the replay on that link exposes less.
  D = 1024
  params, loss = tanh_mlp_structs(8, D)
  r = ooo.explain(
    loss,
    params,
    jax.ShapeDtypeStruct((16384, D), jnp.float32),
    mode="data_parallel",
    axis_name="batch",
    axis_size=8,
    device="H100",
    link="100GbE",
    bucket_bytes=4_000_000,
  )
  plain, told = r.compiled("H100"), r.compiled("H100", pgle=True)
  assert len(told.windows) == len(plain.windows) >= 4
  assert sum(w.kernels for w in told.windows) > sum(w.kernels for w in plain.windows)
  a, b = replay(plain.text, 8, r.plan.link), replay(told.text, 8, r.plan.link)
  assert b.compute == pytest.approx(a.compute)
  assert b.exposed < 0.9 * a.exposed


def test_a_bad_link_fails_before_compiling():
  params, loss = tanh_mlp_structs(2, 64)
  r = ooo.explain(
    loss,
    params,
    jax.ShapeDtypeStruct((16, 64), jnp.float32),
    mode="data_parallel",
    axis_name="batch",
    axis_size=8,
  )
  with pytest.raises(ValueError, match="unknown link 'IB999'"):
    r.compiled("H100", pgle="IB999")
