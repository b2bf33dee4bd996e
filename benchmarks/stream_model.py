"""The cost model's GPU terms against both GPU runs (issue 50): each measured cell
beside the model's prediction, and what the shipped calibrations plan now.

Predicted step = jax.grad's measured step + calls x the device's per-call cost
(pinned for `single_gpu`, unpinned for `ordering="none"`) + the kernels and bytes
the variant runs beyond jax.grad's (compile-only H100 counts, `benchmarks.kernel_parity`;
a kernel in a command buffer at 1 us, bytes at the device's bandwidth) - the
concurrency gain (`passes.stream_cost`; 0 here: the measured trace shows none,
busy 10.91 vs 10.82 ms on ResNet-50). Per-call costs come from the calibration files
(`ooojax/calibration/`), one pair per device, the same for every model.

  python -m benchmarks.stream_model             # the tables (no compile, no GPU)
  python -m benchmarks.stream_model --plans     # + the three models planned with the
                                                #   shipped calibrations (traces them)
"""

from __future__ import annotations

import argparse

from ooojax.passes import calibration, cost, stream_cost

# Measured, untraced alternating steps, batch 32, jax 0.11.2 (benchmarks/RESULTS.md):
# jax.grad's ms, then the ratio (jax.grad / variant, as reported) of in_order,
# single_gpu (ordering="none": unpinned calls) and single_gpu (pinned windows).
RUNS = {
  "H100": {
    "run": "first GPU run, H100 80GB HBM3, 2026-11-27, commit 69c257e",
    "demo CNN": (0.45, 0.967, 0.925, 0.512),
    "MobileNetV3-small": (4.41, 0.994, 0.875, 0.550),
    "ResNet-50": (15.07, 0.998, 0.870, 0.718),
  },
  "H200": {
    "run": "second GPU run, H200, 2026-11-28, commit d6658ea",
    "demo CNN": (0.56, 0.915, 0.990, 0.387),
    "MobileNetV3-small": (4.50, 0.964, 0.925, 0.584),
    "ResNet-50": (13.84, 0.987, 0.969, 0.794),
  },
}
# The plans those commits compiled (batch 32): stream calls; extra kernels and MB
# beyond jax.grad's for (in_order, single_gpu), compile-only H100 (RESULTS.md, "Kernel
# parity"; 69c257e's ResNet-50 is the "before" row; its demo and MobileNet extras
# were not counted: 0 here).
PLANS = {
  "H100": {
    "demo CNN": (4, (0, 0.0), (0, 0.0)),
    "MobileNetV3-small": (53, (16, 0.0), (0, 0.0)),
    "ResNet-50": (58, (43, 0.0), (206, 573.1)),
  },
  "H200": {
    "demo CNN": (4, (0, 0.0), (1, 0.0)),
    "MobileNetV3-small": (49, (16, 0.0), (14, 19.9)),
    "ResNet-50": (47, (43, 0.0), (4, 90.1)),
  },
}
KERNEL_SECONDS = 1e-6  # one more kernel in a command buffer


def rows(device: str) -> list[str]:
  cal = calibration.load(calibration.SHIPPED / f"{device.lower()}.json")
  bw = cost.DEVICE_SPECS[device].bandwidth
  out = []
  for model, (grad, m_in, m_none, m_pin) in ((k, v) for k, v in RUNS[device].items() if k != "run"):
    calls, (k_in, mb_in), (k_s, mb_s) = PLANS[device][model]
    t = grad * 1e-3

    def pred(n, c, k, mb):
      return t / stream_cost.predict_step(t, n, c, k, mb * 1e6, bw, KERNEL_SECONDS)

    p_in = pred(0, 0.0, k_in, mb_in)
    p_none = pred(calls, cal.call_seconds, k_s, mb_s)
    p_pin = pred(calls, cal.pinned_call_seconds, k_s, mb_s)
    err = (p_none - m_none) / m_none * 100
    order_p = p_in >= p_none > p_pin
    order_m = m_in >= m_none > m_pin
    out.append(
      f"| {device} | {model} | {calls} | {p_in:.3f} / {m_in:.3f} | {p_none:.3f} / {m_none:.3f} "
      f"({err:+.0f}%) | {p_pin:.3f} / {m_pin:.3f} | {'yes' if order_p else 'no'} / "
      f"{'yes' if order_m else 'no'} |"
    )
  return out


def table() -> list[str]:
  lines = [
    "Ratios are jax.grad's step / the variant's (predicted / measured); per call: "
    + "; ".join(
      f"{d} {c.call_seconds * 1e6:.1f} us unpinned, {c.pinned_call_seconds * 1e6:.1f} us pinned"
      for d in RUNS
      for c in [calibration.load(calibration.SHIPPED / f"{d.lower()}.json")]
    )
    + ".",
    "",
    "| GPU | model | calls | in_order | unpinned (error) | pinned | in_order >= unpinned > pinned |",
    "|---|---|---|---|---|---|---|",
  ]
  for d in RUNS:
    lines += rows(d)
  return lines


def plans(devices=("H100", "H200")) -> list[str]:
  import jax

  import ooojax as ooo
  from benchmarks.step_time import case

  lines = [
    "",
    "| GPU | model (batch 32) | single_gpu calls | single_gpu / in_order (predicted) | auto runs |",
    "|---|---|---|---|---|",
  ]
  for name in ("demo_cnn", "mobilenet_v3_small", "resnet50"):
    loss, args, kw, _ = case(name, 32)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    for d in devices:
      vg = ooo.value_and_grad(loss, mode="single_gpu", device=d, **kw)
      s = vg.abstract_plan(*args).schedule
      auto = ooo.value_and_grad(loss, mode="auto", device=d, **kw)
      from ooojax.passes.schedule import schedule

      p = auto.abstract_plan(*args)
      a = schedule(p.split, cost.CostModel(d), 2, ooo.Options().min_speedup())
      runs = "two streams" if a.calls else "in order"
      lines.append(
        f"| {d} | {name} | {len(s.calls)} | {s.predicted_speedup:.3f}x | {runs} "
        f"({a.predicted_speedup:.3f}x) |"
      )
  return lines


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--plans", action="store_true")
  a = ap.parse_args(argv)
  lines = table()
  if a.plans:
    lines += plans()
  print("\n".join(lines))


if __name__ == "__main__":
  main()
