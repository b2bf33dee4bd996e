import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")

import ooojax as ooo  # noqa: E402
from tests import models  # noqa: E402


def test_report_contents_and_plot(tmp_path):
  loss, args = models.cnn_case()
  r = ooo.explain(loss, *args, has_aux=True, device="H100")
  assert r.counts["DW"] > 0 and r.counts["DX"] > 0
  assert any("Conv_0" in p and "kernel" in p for p in r.clusters)
  text = repr(r)
  assert "cost model, not measured" in text and "stream 0:" in text
  assert "<pre>" in r._repr_html_()
  ax = r.plot()
  ax.figure.savefig(tmp_path / "gantt.png")
  assert (tmp_path / "gantt.png").stat().st_size > 1000
  assert r.schedule.predicted_speedup >= 1.0


def test_explain_accepts_options_and_kwargs():
  f = lambda w, *, scale: jnp.sum(jnp.tanh(w) * scale)
  r = ooo.explain(f, jnp.ones((4, 4)), kwargs={"scale": 2.0}, mode="in_order")
  assert r.mode == "in_order" and r.on_stream(1) == []


def test_compiled_schedule_beside_the_simulated_one(tmp_path):
  # Needs the compile-only GPU (gpu-hlo extra); skipped with the reason otherwise.
  import pytest
  from ooojax import gpu_hlo
  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    pytest.skip(f"compile-only GPU: {reason}")
  from tests.test_gpu_hlo import _demo_cnn
  loss_fn, args = _demo_cnn()  # ShapeDtypeStructs: explain needs shapes only
  r = ooo.explain(loss_fn, *args, has_aux=True, mode="single_gpu", device="H100",
                  ordering="none")
  c = r.compiled("H100")
  side = r.on_stream(1)
  assert [u.unit for u in c.units if u.predicted_stream == 1] == side and len(side) == 16
  assert all(u.xla_call and u.xla_stream == "1" for u in c.units if u.predicted_stream == 1)
  heavy = [u for u in c.units if u.heavy]
  assert sorted(u.label for u in heavy) == sorted(
      f"['{m}']['kernel']" for m in ("Conv_0", "Conv_1", "Conv_2", "Dense_0", "Dense_1"))
  assert c.heavy_overlap == c.hlo.heavy_overlap()
  assert set(c.mismatches()) == {u for u in c.units if u.predicted_overlap != u.xla_overlapped}
  assert "heavy dW calls overlapped" in c.summary() and "<pre>" in c._repr_html_()
  axes = r.plot(compiled=c)
  axes[0].figure.savefig(tmp_path / "both.png")
  assert len(axes) == 2 and (tmp_path / "both.png").stat().st_size > 1000
  with pytest.raises(ValueError, match="ooo.explain"):
    type(r)(r.split, r.schedule, r.mode).compiled()
