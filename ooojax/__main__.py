"""`python -m ooojax demo` / `python -m ooojax hlo` (or the `ooojax` console script).

Importing the `ooojax` package first picks the CPU platform when a CUDA plugin
is installed but no GPU is present (`ooojax/_platform.py`), so `hlo` can
compile for a compile-only GPU and `demo` runs without CUDA noise.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="ooojax", description=__doc__)
  sub = parser.add_subparsers(dest="cmd", required=True)
  demo = sub.add_parser("demo", help="train a small flax CNN with jax.grad and ooo.grad")
  demo.add_argument("--steps", type=int, default=10)
  demo.add_argument("--batch", type=int, default=32)
  demo.add_argument(
    "--spec", default="H100", help="device spec for the predicted schedule (V100, A100, H100, CPU)"
  )
  demo.add_argument("--plot", default=None, help="write the Gantt chart to this PNG")
  from ooojax import _hlo_cli

  _hlo_cli.add_parser(sub)
  args = parser.parse_args(argv)
  if args.cmd == "hlo":
    return _hlo_cli.run(args)
  if args.cmd == "demo":
    from ooojax import demo as demo_mod

    demo_mod.run(args.steps, args.batch, args.spec, args.plot)
  return 0


if __name__ == "__main__":
  sys.exit(main())
