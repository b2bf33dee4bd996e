"""What XLA:GPU really schedules for each zoo model, compiled for a compile-only H100.

For each model and variant (`jax.grad`, `ooo.grad(mode="single_gpu")`) it
compiles the gradient with `ooojax.gpu_hlo` (no GPU needed) and counts the
heavy dW calls: stream-annotated calls whose callee holds a conv or GEMM, and
how many of them have a main-stream conv/GEMM kernel scheduled between start
and done. Beside it: the cost model's predicted speedup for the same schedule
(simulated, not measured) and the compile time on this machine.

  python -m benchmarks.gpu_schedule                     # default models and sizes
  python -m benchmarks.gpu_schedule --models resnet50 --batch 32 --write

Full-size models at batch 32 (the size is printed in each row); parameters
are shapes only (`jax.eval_shape`). About 5 min on a loaded 2-core host.
"""

from __future__ import annotations

import argparse
import sys
import time

import ooojax as ooo  # before anything imports jax: picks JAX_PLATFORMS=cpu when no GPU is here
from benchmarks import _report
from ooojax import _hlo_cli, gpu_hlo

# (row name, model, tiny, size overrides): full size, --batch (32). DenseNet-121
# is left out by default: its full-size compile took ~4 min per variant on a
# loaded 2-core host (`--models densenet121` adds it).
DEFAULT = [
  ("demo CNN", "demo", False, {}),
  ("MobileNetV3-small", "mobilenet_v3_small", False, {}),
  ("ResNet-50", "resnet50", False, {}),
  ("BERT block (1 layer)", "bert", False, {"layers": 1}),
]
VARIANTS = ("jax", "single_gpu")


def _compile_here(fn, args, compiler_options):
  """Compiled for this machine's own device (a real GPU: autotuned layouts)."""
  import jax

  from ooojax.passes.hlo import schedule as hlo_schedule

  t0 = time.perf_counter()
  lowered = jax.jit(fn).lower(*args)
  t1 = time.perf_counter()
  text = lowered.compile(compiler_options=dict(compiler_options or {})).as_text()
  return _hlo_cli.CompiledModel(hlo_schedule.parse(text), text, t1 - t0, time.perf_counter() - t1)


def row(title, model, tiny, sizes, batch, variant, gpu, ordering, compiler_options, real=False):
  loss_fn, args, kw = _hlo_cli.load_model(model, tiny=tiny, batch=batch, sizes=sizes)
  fn = _hlo_cli.grad_fn(loss_fn, kw, variant, gpu, ordering)
  sim = None
  if variant != "jax":
    opts = {"ordering": ordering} if ordering else {}
    spec = gpu if gpu in ("H100", "A100") else "H100"
    sim = ooo.explain(
      loss_fn, *args, mode=variant, device=spec, **opts, **kw
    ).schedule.predicted_speedup
  shape = " ".join(f"{k}={v}" for k, v in sorted(sizes.items()))
  out = dict(
    title=title,
    size=f"{'tiny' if tiny else 'full'} b{batch}{' ' + shape if shape else ''}",
    variant="jax.grad"
    if variant == "jax"
    else f"ooo {variant}" + (f" ({ordering})" if ordering else ""),
    sim=sim,
  )
  t0 = time.perf_counter()
  try:
    c = (
      _compile_here(fn, args, compiler_options)
      if real
      else _hlo_cli.compile_model(fn, args, gpu=gpu, compiler_options=compiler_options)
    )
  except Exception as e:  # noqa: BLE001 - a row that says why, not a crash
    out.update(
      error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}", seconds=time.perf_counter() - t0
    )
    return out
  k, n = c.schedule.heavy_overlap()
  out.update(
    k=k,
    n=n,
    calls=len(c.schedule.stream_calls()),
    convs=_convs(c.schedule),
    seconds=c.lower_s + c.compile_s,
  )
  return out


def _convs(schedule) -> str:
  """cuDNN convs as XLA rewrote them: forward / backward-input / backward-filter /
  fused with their epilogue (a pin that hides a pattern changes these)."""
  targets = [i.target for instrs in schedule.computations.values() for i in instrs]
  names = ("convForward", "convBackwardInput", "convBackwardFilter", "convBiasActivationForward")
  return " / ".join(str(targets.count(f"__cudnn${t}")) for t in names)


def main(argv=None):
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.gpu_schedule",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument(
    "--models",
    nargs="+",
    default=None,
    help="model names (demo or zoo); default: " + ", ".join(m for _, m, _, _ in DEFAULT),
  )
  ap.add_argument("--tiny", action="store_true", help="the zoo's tiny sizes")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--gpu", default="H100")
  ap.add_argument("--ordering", default=None, help="ooo.grad ordering (default: ooo's)")
  ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=_hlo_cli.MODES)
  ap.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE")
  ap.add_argument(
    "--real",
    action="store_true",
    help="compile for this machine's own GPU (autotuned) instead of a compile-only one",
  )
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  reason = None if a.real else gpu_hlo.unavailable_reason()
  if reason is not None:
    sys.exit(f"cannot compile for a GPU here: {reason}")
  jobs = (
    [(m, m, a.tiny, {}) for m in a.models]
    if a.models
    else [(t, m, a.tiny or tiny, s) for t, m, tiny, s in DEFAULT]
  )
  rows = []
  for title, model, tiny, sizes in jobs:
    for v in a.variants:
      rows.append(
        row(
          title, model, tiny, sizes, a.batch, v, a.gpu, a.ordering, _hlo_cli.parse_kv(a.opt), a.real
        )
      )
      print(f"{title} / {v}: {rows[-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
  where = "this machine's device, autotuned" if a.real else "compile-only, jaxlib's CUDA plugin"
  lines = _report.header(f"Compiled {'local' if a.real else a.gpu} schedule ({where})") + [
    (
      "Each gradient compiled for this machine's own GPU (autotuned; nothing timed). "
      if a.real
      else f"Each gradient compiled for a compile-only {a.gpu} on this host (no GPU ran). "
    )
    + "'heavy dW calls overlapped' = stream-annotated calls whose callee holds a conv/GEMM "
    "with a conv/GEMM kernel scheduled between start and done / all such calls. "
    "'simulated speedup' is the cost model's in-order / scheduled makespan (not "
    "measured). cuDNN convs: forward / backward-input / backward-filter / fused with "
    "their epilogue, as XLA rewrote them. Compile seconds on this host.",
    "",
    "| model | size | variant | heavy dW calls overlapped | stream calls | cuDNN convs "
    "| simulated speedup | compile s |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    sim = f"{r['sim']:.3f}x (simulated)" if r["sim"] is not None else "-"
    if "error" in r:
      lines.append(
        f"| {r['title']} | {r['size']} | {r['variant']} | compile failed: "
        f"{r['error']} | - | - | {sim} | {r['seconds']:.1f} |"
      )
    else:
      lines.append(
        f"| {r['title']} | {r['size']} | {r['variant']} | {r['k']} / {r['n']} | "
        f"{r['calls']} | {r['convs']} | {sim} | {r['seconds']:.1f} |"
      )
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
