"""ooojax's pipeline beside torch.distributed.pipelining, 2 processes, runs alternating.

  python -m benchmarks.vs_torch --peer-python .venv-torch/bin/python [--link-gbit 0.1] [--write]

The peer's venv (a benchmark-only peer, never a dependency):
`python3.11 -m venv .venv-torch && .venv-torch/bin/pip install torch==2.13.0 numpy`.

Both run on `benchmarks/pipeline_mp.py`'s harness: one stage process per core
(pinned), gloo over localhost TCP, the same model (`_mlp_model`: residual GELU
MLP blocks, MSE, float32, the same weights and batch), unshaped and, with
`--link-gbit`, on the loopback shaped by one tbf queue. Whole runs alternate,
`--repeats` times per link: ooojax's workers (`_pipeline_mp_worker`), then
torch's (`peer_torch.py`), each timing `--rounds` rounds that alternate over
its schedules. Each framework's one-process step (unpipelined, and accumulated
over the microbatches) is timed too, before and after, so that a kernel-speed
difference between the two frameworks shows apart from the pipelines'.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from benchmarks import _report
from benchmarks._pipeline_mp_predict import tbf_burst
from benchmarks.pipeline_mp import ROOT, measure, run_baseline, shaped_name

OURS = ("gpipe", "1f1b", "ooo", "interleaved", "zb-v")
PEER = ("gpipe", "1f1b", "interleaved", "zb-v", "zb-interleaved", "dualpipe-v")


def _med(xs) -> float:
  return float(np.median(xs))


def _pool(into: dict, res: dict) -> None:
  for k, r in res.items():
    if not k.startswith("_") and "ms" in r:
      into.setdefault(k, []).extend(r["ms"])


def table(ours: dict, peer: dict, link: str, bases: dict) -> list[str]:
  """Per schedule, ooojax's and torch's medians, and the best of each."""
  lines = [
    f"Link: {link}. Step (ms), median [min-max] over all rounds of all repeats; "
    "torch / ooojax > 1: ooojax faster.",
    "",
    "| schedule | m | ooojax | torch | torch / ooojax |",
    "|---|---|---|---|---|",
  ]
  span = lambda xs: f"{_med(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"  # noqa: E731
  ms = sorted({int(k.split("/")[1]) for k in [*ours, *peer]})
  for m in ms:
    for name in dict.fromkeys([*OURS, *PEER]):
      a, b = ours.get(f"{name}/{m}"), peer.get(f"{name}/{m}")
      if a is None and b is None:
        continue
      ratio = f"{_med(b) / _med(a):.2f}x" if a and b else ""
      lines.append(
        f"| {name} | {m} | {span(a) if a else '-'} | {span(b) if b else '-'} | {ratio} |"
      )
  lines.append("")
  for m in ms:
    best = lambda d: min(  # noqa: E731
      ((_med(v), k.split("/")[0]) for k, v in d.items() if k.endswith(f"/{m}")), default=None
    )
    (a, an), (b, bn) = best(ours), best(peer)
    ob, pb = _med(bases["ours"]["baseline"]), _med(bases["peer"]["baseline"])
    oa, pa = _med(bases["ours"][f"accum/{m}"]), _med(bases["peer"][f"accum/{m}"])
    lines.append(
      f"- {m} microbatches: the best of each, ooojax {an} {a:.1f} ms, torch {bn} {b:.1f} ms: "
      f"**{b / a:.2f}x**. Over its own one-process step (unpipelined / accumulated over "
      f"the microbatches): ooojax {ob / a:.2f}x / {oa / a:.2f}x, torch {pb / b:.2f}x / {pa / b:.2f}x."
    )
  return lines


def predict(peer_runs: list, link: str, gbit) -> list[str]:
  """torch's GPipe and 1F1B replayed by `passes.pipeline.link` in overlap mode (an
  asynchronous runtime: each stage runs its actions in order once their inputs
  have arrived, sends leave at once) with torch's own phase costs and exchange,
  measured in each run (`peer_torch._calibrate`), beside torch's measured steps."""
  import math

  from ooojax.passes.pipeline.generate import generate
  from ooojax.passes.pipeline.link import LinkModel, simulate_link

  rows, hits, n = [], 0, 0
  for name in ("gpipe", "1f1b"):
    for m in sorted({int(k) for r in peer_runs for k in r.get("_calibration", {})}):
      pred, meas = {"overlap": [], "executor": []}, []
      for r in peer_runs:
        c, cell = r.get("_calibration", {}).get(str(m)), r.get(f"{name}/{m}")
        if c is None or cell is None:
          continue
        bw = gbit * 1e9 / 8 if gbit else math.inf
        wire = c["nbytes"] / bw
        lk = LinkModel(
          max(c["exchange"] - wire, 0.0),
          bw,
          c["nbytes"],
          duplex=not gbit,
          burst=tbf_burst(gbit) if gbit else 0.0,
        )
        costs = [{"F": f, "B": b, "W": 0.0} for f, b in c["phases"]]
        sched = generate(name, len(costs), m)
        for mode in pred:
          pred[mode].append(simulate_link(sched, costs, lk, mode).makespan * 1e3)
        meas += cell["ms"]
      if not meas:
        continue
      p, e, med = _med(pred["overlap"]), _med(pred["executor"]), _med(meas)
      ok = abs(p / med - 1) <= 0.15
      hits, n = hits + ok, n + 1
      rows.append(
        f"| {name} | {m} | {p:.1f} | {med:.1f} | {p / med:.2f} | {'yes' if ok else 'no'} | "
        f"{e:.1f} |"
      )
  if not rows:
    return []
  return [
    f"torch's tables replayed in overlap mode with torch's measured phases and exchange "
    f"({link}; simulated, nothing fitted to the steps), beside its measured steps:",
    "",
    "| torch schedule | m | overlap replay (ms) | measured (ms) | replay / measured | "
    "within 15% | executor replay (ms) |",
    "|---|---|---|---|---|---|---|",
    *rows,
    "",
    f"Within 15%: {hits} of {n}.",
  ]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--peer-python", required=True, help="python of a venv with torch")
  ap.add_argument("--microbatches", type=int, nargs="*", default=[8, 16])
  ap.add_argument("--link-gbit", type=float, nargs="*", default=[])
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--rt", type=int, default=0, help="SCHED_FIFO workers (as pipeline_mp --rt)")
  ap.add_argument("--json", help="save all raw timings here")
  ap.add_argument("--write", action="store_true")
  args = ap.parse_args(argv)
  if args.rt:
    os.environ["PIPELINE_MP_RT"] = str(args.rt)
  cfg = {
    "layers": 8,
    "dim": 256,
    "hidden": 1024,
    "batch": 256,
    "rounds": args.rounds,
    "warmup": 2,
    "microbatches": args.microbatches,
    "layout": "device",
    "predict": False,
  }
  ours_cfg = {**cfg, "schedules": list(OURS)}
  peer_cfg = {
    **cfg,
    "schedules": list(PEER),
    "cmd": [args.peer_python, os.path.join(ROOT, "benchmarks", "peer_torch.py")],
  }
  links = [None, *args.link_gbit]
  runs = {shaped_name(g, False) if g else "unshaped localhost": ({}, {}) for g in links}
  raw = {name: [] for name in runs}  # torch's whole runs, with their calibration
  bases = {"ours": {}, "peer": {}}
  meta = {}
  for _ in range(args.repeats):
    _pool(bases["ours"], run_baseline(ours_cfg))
    res = run_baseline(peer_cfg)
    meta = res.get("_meta", meta)
    _pool(bases["peer"], res)
    for g in links:
      name = shaped_name(g, False) if g else "unshaped localhost"
      ours, peer = runs[name]
      _pool(ours, measure(ours_cfg, 2, [0, 1], g))
      raw[name].append(measure(peer_cfg, 2, [0, 1], g))
      _pool(peer, raw[name][-1])
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"runs": runs, "bases": bases, "meta": meta, "peer_raw": raw}, f)
  lines = _report.header(
    "Pipeline: ooojax beside torch.distributed.pipelining (benchmarks/vs_torch.py)"
  )
  lines += [
    f"**Measured**: 2 stage processes, each pinned to its own core, gloo over localhost TCP; "
    f"torch {meta.get('torch')} ({meta.get('threads')} thread per process); the model of "
    "`benchmarks/pipeline_mp.py` (8 residual blocks x + gelu(LN(x) W1) W2, D=256, H=1024, "
    f"batch 256, MSE, float32); {args.repeats} repeats of whole runs alternating "
    f"(ooojax, torch), {args.rounds} rounds each. One process: ooojax's unpipelined "
    f"jax.value_and_grad {_med(bases['ours']['baseline']):.1f} ms, torch's forward + "
    f"backward {_med(bases['peer']['baseline']):.1f} ms.",
    "",
  ]
  for g, (link, (ours, peer)) in zip(links, runs.items()):
    lines += table(ours, peer, link, bases) + [""]
    lines += predict(raw[link], link, g) + [""]
  _report.emit(lines, args.write)


if __name__ == "__main__":
  main()
