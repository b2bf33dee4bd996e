"""XLA's latency-hiding scheduler told the link: the data-parallel steps compiled again.

XLA:GPU starts each collective only as early as its own (NVLink-fast) latency
estimate asks; on a slower link its windows cover a fraction of the transfer.
`passes.hlo.pgle` writes the link model's cost of each collective as a profile for
XLA's profile-guided latency estimator. Here each step of `benchmarks.dp_exposed`
is compiled for N compile-only H100s, then compiled again with the profile for one
link, and both programs are replayed on that link (H100 roofline and the shipped
H200 calibration). Replayed from compile-only HLO, not timed.

  python -m benchmarks.dp_pgle --rows "BERT-large-like|8|no|IB400" "nanodo D2048|8|yes|IB400"
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks import dp_exposed as de

DEFAULT_ROWS = ("BERT-large-like|8|no|IB400", "nanodo D2048|8|yes|IB400")
# what is compiled per row: plain jit, ooojax planned for NVLink, ooojax planned for the link
VARIANTS = ("jax", "ooo", "ooo@{link}")


def row(name: str, n: int, fsdp: bool, link: str, layers: int, variants=VARIANTS) -> list[str]:
  out = []
  for v in variants:
    v = v.format(link=link)
    r0 = de.measure(name, v, n, fsdp, layers)
    r1 = de.measure(name, v, n, fsdp, layers, pgle=link)
    cells = []
    for r in (r0, r1):
      a, c = r[link], r["cal"][link]
      cells.append(f"{a['step'] * 1e3:.3f} ({a['exposed'] * 1e3:.3f})")
      cells.append(f"{c['step'] * 1e3:.3f} ({c['exposed'] * 1e3:.3f})")
    out.append(
      f"| {name} | {n} | {'yes' if fsdp else 'no'} | {link} | {v} | " + " | ".join(cells) + " |"
    )
    print(out[-1], file=sys.stderr, flush=True)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.dp_pgle", description=__doc__)
  ap.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), help="model|devices|fsdp|link")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help="jax, ooo, ooo@{link}")
  a = ap.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  lines = [
    f"Replayed from compile-only HLO, not timed (jax {jax.__version__}); step (exposed) ms "
    "on the row's link, without / with the profile, roofline and calibrated:",
    "",
    "| model | H100s | FSDP | link | compiled | roofline | calibrated | roofline, profile "
    "| calibrated, profile |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for spec in a.rows:
    name, n, fsdp, link = spec.split("|")
    lines += row(name, int(n), fsdp == "yes", link, a.layers, a.variants)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
