"""Simulated single-GPU step with and without next-iteration dW (cost model, not measured).

For each zoo model at full size (batch 32): the in-order step, the same-step
two-stream schedule (`ooo.grad(mode="single_gpu")`), and the steady-state step
with dW clusters left to the next step (`passes.defer`): the clusters the cost
model picks (`choose`) and, for DenseNet-121, the paper's choice (the 32 convs
of the last dense block). All numbers come from the cost model and simulator.

  python -m benchmarks.single_gpu_defer [--models densenet121 resnet50] [--write]
"""

from __future__ import annotations

import argparse
import re
import time

import ooojax as ooo
from benchmarks import _report
from ooojax._hlo_cli import load_model
from ooojax.passes import defer
from ooojax.passes.cost import CostModel


def _plan(name, device, batch):
  loss, args, kw = load_model(name, batch=batch)
  return ooo.value_and_grad(loss, mode="single_gpu", device=device, **kw).abstract_plan(*args)


def paper_leaves(split) -> tuple[int, ...]:
  """DenseNet-121's last dense block: Conv_88 .. Conv_119 (flax numbering)."""
  out = []
  for c in split.clusters:
    m = re.search(r"\['Conv_(\d+)'\]", c.param)
    if m and 88 <= int(m.group(1)) <= 119:
      out.append(c.grad_out - split.grad_out_start)
  return tuple(sorted(out))


def rows(models, device="H100", batch=32):
  out = []
  for name in models:
    t = time.perf_counter()
    plan = _plan(name, device, batch)
    sp, sched = plan.split, plan.schedule
    cm = CostModel(device)
    chosen = defer.choose(sp, sched, cm)
    base = defer.steady_state(sp, sched, cm, ())
    auto = defer.steady_state(sp, sched, cm, chosen)
    f0 = sched.unit("F0")
    row = {
      "model": name,
      "batch": batch,
      "fwd_util": f0.util,
      "clusters": len(sp.clusters),
      "in_order_ms": sched.in_order_makespan * 1e3,
      "single_gpu_ms": base.makespan * 1e3,
      "deferred": len(chosen),
      "defer_auto_ms": auto.makespan * 1e3,
    }
    if name == "densenet121":
      pl = paper_leaves(sp)
      row["paper_deferred"] = len(pl)
      row["defer_paper_ms"] = defer.steady_state(sp, sched, cm, pl).makespan * 1e3
    names = [
      sp.clusters[[c.grad_out - sp.grad_out_start for c in sp.clusters].index(i)].param
      for i in chosen
    ]
    row["chosen"] = names
    row["seconds"] = time.perf_counter() - t
    out.append(row)
  return out


def table(rs) -> str:
  lines = [
    "| model | batch | dW clusters | in-order ms | single_gpu ms | deferred (auto) | with deferral ms | speedup vs single_gpu | paper's choice: deferred, ms |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rs:
    paper = f"{r['paper_deferred']}, {r['defer_paper_ms']:.3f}" if "paper_deferred" in r else "-"
    lines.append(
      f"| {r['model']} | {r['batch']} | {r['clusters']} | {r['in_order_ms']:.3f} | "
      f"{r['single_gpu_ms']:.3f} | {r['deferred']} | {r['defer_auto_ms']:.3f} | "
      f"{r['single_gpu_ms'] / r['defer_auto_ms']:.3f}x | {paper} |"
    )
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", nargs="+", default=["densenet121"])
  ap.add_argument("--device", default="H100")
  ap.add_argument("--batch", type=int, nargs="+", default=[32])
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  rs = [r for b in a.batch for r in rows(a.models, a.device, b)]
  text = table(rs)
  for r in rs:
    print(
      r["model"],
      r["batch"],
      f"forward util {r['fwd_util']:.2f}",
      "auto deferred:",
      r["chosen"][:8],
      "..." if len(r["chosen"]) > 8 else "",
    )
  lines = _report.header(
    "single-GPU next-iteration dW, SIMULATED (cost model and simulator, "
    f"{a.device} spec, steady state)"
  )
  _report.emit([*lines, text], a.write)


if __name__ == "__main__":
  main()
