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
  r = ooo.explain(loss_fn, *args, has_aux=True, mode="single_gpu", device="H100", ordering="none")
  c = r.compiled("H100")
  side = r.on_stream(1)
  assert [u.unit for u in c.units if u.predicted_stream == 1] == side and len(side) >= 4
  assert all(u.xla_call and u.xla_stream == "1" for u in c.units if u.predicted_stream == 1)
  # one conv/matmul dW per call: on a GPU the light dW (biases, BatchNorm) stay
  # on stream 0, fused into the dX chain's kernels (`Schedule.kept`)
  calls = {}
  for u in c.units:
    if u.xla_call:
      calls.setdefault(u.xla_call, []).append(u.unit)
  assert calls and all(len(v) == 1 for v in calls.values())
  assert r.schedule.kept and not {n for n, _ in r.schedule.kept} & set(side)
  heavy = {u.label for u in c.units if u.heavy}
  kernels = {f"['{m}']['kernel']" for m in ("Conv_0", "Conv_1", "Conv_2", "Dense_0", "Dense_1")}
  assert kernels <= heavy
  first = next(u for u in c.units if u.label == "['Conv_0']['kernel']")
  assert first.predicted_stream == 0 and first.xla_call is None  # nothing left to hide it
  assert c.heavy_overlap == c.hlo.heavy_overlap()
  assert set(c.mismatches()) == {u for u in c.units if u.predicted_overlap != u.xla_overlapped}
  assert "heavy dW calls overlapped" in c.summary() and "<pre>" in c._repr_html_()
  axes = r.plot(compiled=c)
  axes[0].figure.savefig(tmp_path / "both.png")
  assert len(axes) == 2 and (tmp_path / "both.png").stat().st_size > 1000
  with pytest.raises(ValueError, match="ooo.explain"):
    type(r)(r.split, r.schedule, r.mode).compiled()


def _deep(n=6, d=512):
  params = {f"l{i}": jnp.zeros((d, d)) for i in range(n)}

  def loss(p, x):
    for i in range(n):
      x = jnp.tanh(x @ p[f"l{i}"])
    return jnp.mean(x**2)

  return loss, params, jnp.zeros((64, d))


def test_explain_defer_shows_what_is_carried_to_the_next_step(tmp_path):
  import optax
  import pytest

  from ooojax import single_gpu

  loss, params, x = _deep()
  r = ooo.explain(loss, params, x, mode="single_gpu", device="H100", defer="auto")
  c = r.carried
  # the same plan as the train step it explains
  step = single_gpu.make_train_step(loss, optax.sgd(0.1), mode="single_gpu", device="H100")
  step.init(params, x)
  assert c.deferred_paths == step.plan.deferred_paths and c.deferred
  assert c.carried == step.plan.carried and c.simulated == step.plan.simulated
  # the first layer is used first in the forward: nothing hides its dW
  assert "['l0']" not in c.deferred_paths
  # what Pending holds: each deferred layer's input activation and output cotangent
  assert c.carried_bytes == sum(64 * 512 * 4 for _ in c.carried)
  assert len(c.dw_seconds) == len(c.deferred) and min(c.dw_seconds) > 0
  assert c.simulated[1] < c.simulated[0] and c.hidden_seconds > 0
  text = repr(r)
  assert "carried to the next step" in text and f"{c.carried_bytes} bytes" in text
  assert "simulated steady-state step" in text and f"{c.deferred_paths[0]}: dW" in text
  assert "carried in Pending" in r._repr_html_()
  ax = r.plot_carried()
  assert len(ax.get_yticklabels()) == 4 and "steady-state" in ax.get_xlabel()
  ax.figure.savefig(tmp_path / "carried.png")
  # paths and predicates as make_train_step takes them
  assert ooo.explain(loss, params, x, defer=("l4",)).carried.deferred_paths == ("['l4']",)
  assert ooo.explain(loss, params, x, defer=lambda p: "l3" in p).carried.deferred == (3,)
  plain = ooo.explain(loss, params, x)
  assert plain.carried is None
  with pytest.raises(ValueError, match="nothing is carried"):
    plain.plot_carried()
  with pytest.raises(ValueError, match="use argnums=0"):
    ooo.explain(lambda x, p: loss(p, x), x, params, argnums=1, defer="auto")
  with pytest.raises(ValueError, match="cross_step=True"):
    ooo.explain(loss, params, x, mode="data_parallel", axis_name="b", axis_size=2, defer="auto")
