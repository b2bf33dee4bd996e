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
