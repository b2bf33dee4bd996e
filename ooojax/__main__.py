"""`python -m ooojax demo` (or the `ooojax` console script)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="ooojax", description=__doc__)
  sub = parser.add_subparsers(dest="cmd", required=True)
  demo = sub.add_parser("demo", help="train a small flax CNN with jax.grad and ooo.grad")
  demo.add_argument("--steps", type=int, default=10)
  demo.add_argument("--batch", type=int, default=32)
  demo.add_argument("--spec", default="H100",
                    help="device spec for the predicted schedule (V100, A100, H100, CPU)")
  demo.add_argument("--plot", default=None, help="write the Gantt chart to this PNG")
  args = parser.parse_args(argv)
  if args.cmd == "demo":
    from ooojax import demo as demo_mod
    demo_mod.run(args.steps, args.batch, args.spec, args.plot)
  return 0


if __name__ == "__main__":
  sys.exit(main())
