"""ooojax's pipeline beside SpectraX's on the same model, processes alternating.

  python -m benchmarks.vs_spectrax --peer-python .venv-spectrax/bin/python [--write]

SpectraX (spectrax-lib 0.1.4) needs jax 0.10.2 and ooojax jax >= 0.11.2, so the
two cannot share a process: this driver alternates whole runs, `--repeats`
times each (ooojax's `benchmarks.pipeline --cpu-only`, then
`benchmarks/peer_spectrax.py`, ...), each run timing its own unpipelined
`jax.value_and_grad` baseline in the same process, and reports per schedule
the median over all rounds, and the ratio to the baseline of the same runs.
The peer's venv: `python3.12 -m venv .venv-spectrax && .venv-spectrax/bin/pip
install spectrax-lib==0.1.4 jax==0.10.2 jaxlib==0.10.2` (a benchmark-only
peer, never a dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks import _report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = ("gpipe", "1f1b", "ooo", "zb-h1", "zb-h2", "interleaved", "zb-v")


def _run(cmd: list[str]) -> None:
  p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  if p.returncode:
    raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--peer-python", required=True, help="python of a venv with spectrax-lib")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--write", action="store_true")
  args = ap.parse_args(argv)
  ours: dict[str, list] = {}
  peer: dict[tuple, list] = {}
  peer_base: list = []
  meta = {}
  with tempfile.TemporaryDirectory() as d:
    for r in range(args.repeats):
      out = os.path.join(d, f"ours{r}.json")
      _run(
        [
          sys.executable,
          "-m",
          "benchmarks.pipeline",
          "--cpu-only",
          "--rounds",
          str(args.rounds),
          "--json",
          out,
        ]
      )
      with open(out) as f:
        for k, v in json.load(f).items():
          ours.setdefault(k, []).extend(v)
      out = os.path.join(d, f"peer{r}.json")
      _run(
        [
          args.peer_python,
          "benchmarks/peer_spectrax.py",
          "--microbatches",
          "8",
          "16",
          "--rounds",
          str(args.rounds),
          "--out",
          out,
        ]
      )
      with open(out) as f:
        res = json.load(f)
      meta = {k: res.get(k) for k in ("jax", "spectrax")}
      peer_base.extend(res.get("unpipelined_ms_all") or [])
      for row in res["rows"]:
        peer.setdefault((row["schedule"], row["microbatches"]), []).extend(
          row.get("ms_all") or [row["ms"]]
        )
  med = lambda v: float(np.median(v))  # noqa: E731
  ob, pb = med(ours["unpipelined"]), med(peer_base)
  lines = _report.header("Pipeline: ooojax beside SpectraX (benchmarks/vs_spectrax.py)")
  lines += [
    f"4 forced CPU devices in one process per run (2 shared cores), SpectraX's model "
    f"(benchmarks/_mlp_model.py: 8 residual blocks, D 256, H 1024, batch 256, MSE). "
    f"{args.repeats} runs of each side alternating, {args.rounds} rounds per run; "
    f"medians over all rounds. ooojax on this jax, SpectraX {meta.get('spectrax')} on "
    f"jax {meta.get('jax')} (its own process). Unpipelined jax.value_and_grad in the "
    f"same runs: {ob:.0f} ms (ooojax's runs), {pb:.0f} ms (SpectraX's runs).",
    "",
    "| library | schedule | microbatches | step (ms) | x its unpipelined |",
    "|---|---|---|---|---|",
  ]
  for m in (8, 16):
    for name in OURS:
      if f"{name}/{m}" in ours:
        v = med(ours[f"{name}/{m}"])
        lines.append(f"| ooojax | {name} | {m} | {v:.0f} | {v / ob:.2f} |")
    for (name, mm), ms in sorted(peer.items(), key=lambda kv: med(kv[1])):
      if mm == m:
        lines.append(f"| SpectraX | {name} | {m} | {med(ms):.0f} | {med(ms) / pb:.2f} |")
  best = {
    m: (
      min(med(ours[f"{n}/{m}"]) for n in OURS if f"{n}/{m}" in ours),
      min(med(v) for (n, mm), v in peer.items() if mm == m),
    )
    for m in (8, 16)
  }
  lines += [""] + [
    f"- {m} microbatches: best ooojax schedule {o:.0f} ms, best SpectraX {p:.0f} ms ({p / o:.2f}x)."
    for m, (o, p) in best.items()
  ]
  _report.emit(lines, args.write)


if __name__ == "__main__":
  main()
