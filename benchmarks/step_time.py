"""Training-step time of jax.grad vs ooo.grad variants on the current device.

Each variant is a jitted SGD step (gradient + update of the first argument);
variants run alternating in one process, median over rounds. Prints a
markdown table; `--write` appends it to benchmarks/RESULTS.md.

  python -m benchmarks.step_time                       # the demo SmallCNN
  python -m benchmarks.step_time --model mobilenet_v3_small --batch 32
  python -m benchmarks.step_time --model densenet121 --tiny   # a CPU-sized copy
  # each variant also under XLA options, all alternating in one process:
  python -m benchmarks.step_time --variants jax.grad "ooo single_gpu" \
      --also-with xla_gpu_enable_latency_hiding_scheduler=false
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np
import optax

import ooojax as ooo
from benchmarks import _report
from ooojax import demo
from ooojax._calibrate import time_fn
from ooojax.models import ZOO

VARIANTS = {
  "jax.grad": None,
  "ooo auto": {},
  "ooo in_order": {"mode": "in_order"},
  "ooo single_gpu": {"mode": "single_gpu"},  # default ordering: pinned windows
  "ooo single_gpu (control_deps)": {"mode": "single_gpu", "ordering": "control_deps"},
  "ooo single_gpu (scheduling_group)": {"mode": "single_gpu", "ordering": "scheduling_group"},
  "ooo single_gpu (none)": {"mode": "single_gpu", "ordering": "none"},
  # The cost model's stream call (`DeviceSpec.sync`, 2 us) priced at what a call
  # cost on the first H100 (10-40 us unpinned, ResNet-50 the 40): fewer, larger windows.
  "ooo single_gpu (call 40us)": {"mode": "single_gpu", "sync": 40e-6},
}


def _demo_case(batch):
  model = demo.SmallCNN()
  x, y = demo._data(batch)
  v = model.init(jax.random.PRNGKey(0), x)
  _, loss_fn = demo.make_step(jax.grad, model, optax.sgd(0.1))
  return loss_fn, (v["params"], v["batch_stats"], x, y), {"has_aux": True}


def case(model: str, batch: int, tiny: bool = False):
  """`(loss_fn, args, kw, description)` for "demo_cnn" or a zoo model."""
  if model == "demo_cnn":
    return (*_demo_case(batch), f"demo SmallCNN, batch {batch}")
  make, full, small = ZOO[model]
  sizes = dict(small if tiny else full)
  if not tiny:
    sizes["batch"] = batch
  desc = f"{model} ({'tiny' if tiny else 'full'} size), batch {sizes['batch']}"
  return (*make(**sizes), desc)


def variant_grad(name: str):
  """The `jax.grad`-shaped transform a VARIANTS entry names."""
  opts = VARIANTS[name]
  if opts is None:
    return jax.grad
  if "sync" in opts:  # this device's spec with another stream-call price
    from ooojax.passes.cost import get_spec

    opts = {k: v for k, v in opts.items() if k != "sync"}
    opts["device"] = dataclasses.replace(get_spec(None), sync=VARIANTS[name]["sync"])
  return lambda f, **k: ooo.grad(f, **opts, **k)


def sgd_step(grad_fn, loss_fn, kw, compiler_options=None):
  def step(*args):
    g = grad_fn(loss_fn, **kw)(*args)
    g = g[0] if kw.get("has_aux") else g
    return jax.tree.map(lambda p, d: p - 0.01 * d, args[0], g)

  return jax.jit(step, compiler_options=compiler_options or None)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="demo_cnn", choices=["demo_cnn", *ZOO])
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--tiny", action="store_true", help="the zoo model's tiny (CPU) size")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  ap.add_argument(
    "--also-with",
    action="append",
    default=[],
    metavar="NAME=VALUE[,NAME=VALUE]",
    help="also time every variant compiled with these XLA options (repeatable): "
    "the single-GPU mechanisms of docs/guides/single-gpu-on-jax-0.12.md",
  )
  ap.add_argument("--no-sim-check", action="store_true")
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  loss_fn, args, kw, desc = case(a.model, a.batch, a.tiny)
  from ooojax._hlo_cli import parse_kv

  option_sets = [("", {})] + [(f" [{o}]", parse_kv(o.split(","))) for o in a.also_with]
  steps = {}
  for suffix, copts in option_sets:
    for name in a.variants:
      steps[name + suffix] = sgd_step(variant_grad(name), loss_fn, kw, copts)
  times, failed = _report.compile_then_alternate(steps, args, a.rounds, a.iters)
  med = {k: float(np.median(t)) for k, t in times.items()}
  base = med.get("jax.grad")
  lines = _report.header(f"Step time, {desc}") + [
    f"Measured: jitted SGD step, median of {a.rounds} rounds x {a.iters} steps, "
    "variants alternating in one process. Ratio = jax.grad time / variant time "
    "(>1 means faster than jax.grad; a variant in [XLA options] against jax.grad "
    "under the same options).",
    "",
    "| variant | step ms | ratio vs jax.grad |",
    "|---|---|---|",
  ]
  for k, t in med.items():
    # against jax.grad under the same options
    b = med.get("jax.grad" + k[len(k.split(" [")[0]) :], base)
    ratio = f"{b / t:.3f}x" if b else "-"
    lines.append(f"| {k} | {t * 1e3:.2f} | {ratio} |")
  for k, why in failed.items():
    lines.append(f"| {k} | failed to compile or run: {why} | - |")
  if not a.no_sim_check:
    # Calibrated per-unit timings -> simulated in-order gradient time, against
    # the measured jax.grad gradient computation alone.
    measured = ooo.calibrate(loss_fn, *args, **kw)
    pred = ooo.explain(
      loss_fn, *args, mode="in_order", measured=measured, **kw
    ).schedule.in_order_makespan
    real = time_fn(jax.jit(jax.grad(loss_fn, **kw)), args, 20)
    lines += [
      "",
      f"Simulator check: calibrated in-order prediction (simulated) "
      f"{pred * 1e3:.2f} ms vs measured `jit(jax.grad)` {real * 1e3:.2f} ms: "
      f"error {100 * (pred - real) / real:+.0f}% ({len(measured)} units timed "
      "alone; per-unit timing misses cross-unit fusion).",
    ]
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
