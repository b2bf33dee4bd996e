"""Scanned layers: a BERT-like stack as one `nn.scan`, ooojax vs jax.grad.

Three tables (markdown; `--write` appends them to benchmarks/RESULTS.md):

1. Measured on this device: jitted gradient of the scanned stack, jax.grad vs
   ooo.grad variants, alternating in one process, median over rounds.
2. Simulated (cost model, `--sim-device`, default H100): `explain` on a
   `--sim-layers`-layer scanned stack (BERT-base widths by default) and the same
   model unrolled: predicted in-order backward+forward, per-layer dX and dW
   work, and the skewed scan's predicted step (B(i) beside W(i-1)).
3. Compile-only GPU check of the skewed loop body where the CUDA plugin is
   installed: stream-1 calls and GEMMs inside the while body, with the default
   ordering (windows pinned) and with `ordering="none"`.

  python -m benchmarks.scan                     # small CPU sizes, 24-layer simulation
  python -m benchmarks.scan --write
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import ooojax as ooo
from benchmarks import _report
from ooojax.models import scanned
from ooojax.passes.cost import CostModel, get_spec
from ooojax.passes.scan.skew import predict

VARIANTS = {
  "jax.grad": None,
  "ooo in_order (one scan: B(i) and W(i-1) inline)": {"mode": "in_order"},
  "ooo single_gpu (skewed scan, W in a stream call, ordering none)": {
    "mode": "single_gpu",
    "ordering": "none",
  },
}


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=32)
  ap.add_argument("--dim", type=int, default=64)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=256)
  ap.add_argument("--remat", default=None)
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--sim-layers", type=int, default=24)
  ap.add_argument("--sim-device", default="H100")
  ap.add_argument("--sim-sizes", default="batch=8,seq=128,dim=768,heads=12,vocab=30522")
  ap.add_argument("--skip-measure", action="store_true")
  ap.add_argument(
    "--skip-compile-only",
    action="store_true",
    help="leave out the compile-only H100 loop body (gpu.sh's dry run: "
    "tests/test_scan.py checks it)",
  )
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  lines: list[str] = []

  if not a.skip_measure:
    sizes = dict(
      layers=a.layers,
      batch=a.batch,
      seq=a.seq,
      dim=a.dim,
      heads=a.heads,
      vocab=a.vocab,
      remat=a.remat,
    )
    loss, args, _ = scanned.make(**sizes)
    fns = {
      name: jax.jit(jax.grad(loss) if opts is None else ooo.grad(loss, **opts))
      for name, opts in VARIANTS.items()
    }
    times, failed = _report.compile_then_alternate(fns, args, a.rounds, a.iters)
    med = {k: float(np.median(t)) for k, t in times.items()}
    best = {k: float(np.min(t)) for k, t in times.items()}
    base = med.get("jax.grad")
    desc = ", ".join(f"{k} {v}" for k, v in sizes.items())
    lines += _report.header(f"Scanned BERT-like stack, gradient time ({desc})") + [
      f"Measured: jitted gradient, median (and min) of {a.rounds} rounds x {a.iters} calls "
      "(each round's time is a median), variants alternating in one process. Ratio = "
      "jax.grad time / variant time, of the medians and of the mins. On XLA:CPU a "
      "stream-annotated call is a plain call (no second stream), so the skewed variant "
      "measures only its overhead here.",
      "",
      "| variant | median ms | min ms | ratio (median) | ratio (min) |",
      "|---|---|---|---|---|",
    ]
    b_min = best.get("jax.grad")
    for k, t in med.items():
      lines.append(
        f"| {k} | {t * 1e3:.3f} | {best[k] * 1e3:.3f} | "
        f"{f'{base / t:.3f}x' if base else '-'} | "
        f"{f'{b_min / best[k]:.3f}x' if b_min else '-'} |"
      )
    for k, why in failed.items():
      lines.append(f"| {k} | failed: {why} | - |")
    lines.append("")

  # Simulated: 24-layer scanned vs unrolled at BERT-base widths (trace only, nothing runs).
  sim = dict(kv.split("=") for kv in a.sim_sizes.split(","))
  sim = {k: int(v) for k, v in sim.items()}
  spec = get_spec(a.sim_device)
  reports = {}
  for scan in (True, False):
    loss, args, _ = scanned.make(layers=a.sim_layers, scan=scan, remat=a.remat, **sim)
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    t0 = time.perf_counter()
    reports[scan] = ooo.explain(loss, *structs, device=spec, mode="single_gpu")
    print(f"explain scan={scan}: {time.perf_counter() - t0:.1f} s", flush=True)
  rs, ru = reports[True], reports[False]
  ratio = rs.schedule.in_order_makespan / ru.schedule.in_order_makespan
  b_rows = [r for r in rs.loops if r.kind == "DX" and r.primitive == "scan"]
  w_rows = [r for r in rs.loops if r.kind == "DW" and r.primitive == "scan"]
  f_rows = [r for r in rs.loops if r.kind == "FORWARD" and r.primitive == "scan"]
  per = lambda rows: sum(r.per_trip for r in rows) * 1e3
  io, sk = predict(rs.split, CostModel(spec))
  desc = ", ".join(f"{k} {v}" for k, v in sim.items())
  lines += _report.header(
    f"Scanned vs unrolled, {a.sim_layers} layers ({desc}), simulated {spec.name}"
  ) + [
    f"Simulated ({spec.name} cost model; nothing ran). `explain` of the same model with its "
    "layers in one `nn.scan` and unrolled.",
    "",
    "| model | dW clusters | loops split | predicted in-order ms (simulated) | "
    "predicted scheduled ms (simulated) |",
    "|---|---|---|---|---|",
    f"| {a.sim_layers} layers as nn.scan | {len(rs.split.clusters)} | "
    f"{rs.split.loops_split} | {rs.schedule.in_order_makespan * 1e3:.3f} | "
    f"{rs.schedule.makespan * 1e3:.3f} |",
    f"| {a.sim_layers} layers unrolled | {len(ru.split.clusters)} | - | "
    f"{ru.schedule.in_order_makespan * 1e3:.3f} | {ru.schedule.makespan * 1e3:.3f} |",
    "",
    f"Scanned / unrolled predicted in-order cost: {ratio:.3f} (simulated). Per layer "
    f"(simulated): forward {per(f_rows):.4f} ms, dX (B-scan) {per(b_rows):.4f} ms, "
    f"dW ({len(w_rows)} W-scans) {per(w_rows):.4f} ms.",
    f"Skewed scan (B(i) beside W(i-1) on a second stream, processor-sharing model): "
    f"split backward scans {io * 1e3:.3f} ms in order -> {sk * 1e3:.3f} ms skewed "
    f"({io / sk if sk else 1:.3f}x, simulated).",
  ]

  # Compile-only GPU: the skewed loop body.
  from ooojax import gpu_hlo

  reason = "--skip-compile-only" if a.skip_compile_only else gpu_hlo.unavailable_reason()
  if reason is None:
    loss, args, _ = scanned.make(layers=4, batch=8, seq=128, dim=256, heads=4, vocab=1024)
    lines += [
      "",
      "Compile-only H100 (XLA:GPU, nothing ran; 4 scanned layers, dim 256), the skewed loop body:",
      "",
      "| ordering | stream-1 calls in the body | main-stream GEMMs in the body | "
      "GEMMs between call-start and call-done |",
      "|---|---|---|---|",
    ]
    for ordering in ("auto", "none"):  # default (pins) / stream annotations only
      s = gpu_hlo.schedule(
        ooo.grad(loss, mode="single_gpu", ordering=ordering, device="H100"), *args
      )
      bodies = {c for i in s.entry for c in i.calls if i.op == "while"}
      calls = [p for p in s.pairs_of("call") if p.computation in bodies and p.start.stream == "1"]
      gemms = sum(
        i.is_heavy and i.stream is None
        for b in {p.computation for p in calls}
        for i in s.computations[b]
      )  # the skewed body's, not the forward loop's
      lines.append(
        f"| {ordering} | {len(calls)} | {gemms} | {[len(p.overlapped_heavy) for p in calls]} |"
      )
  else:
    lines += ["", f"Compile-only GPU check skipped: {reason}"]
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
