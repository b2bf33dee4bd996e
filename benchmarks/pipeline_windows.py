"""Which of a lag-1 tick's transfers run beside its action, on a compile-only H100.

  python -m benchmarks.pipeline_windows            # the grid below, jax as installed
  python -m benchmarks.pipeline_windows --write    # append the table to RESULTS.md

For each table (`lag=1`) the explicit MLP stack (`ooojax.models.mlp_stack`) is
compiled for `stages` compile-only H100s (`ooo.pipeline.explain(...).compiled`)
twice: with XLA's default of one collective in flight, and with
`ooo.pipeline.compiler_options(table)` (two). A cell counts the collective-permutes
of the tick loop whose window (start to done) holds the tick's action switch,
the conditional that runs its F/B/W GEMMs. Permutes outside the loop (a
virtual-order stack's weights, moved once per step) are not counted. No GPU
runs: this is XLA's schedule, not a timing.
"""

from __future__ import annotations

import argparse
import os

GRID = (
  ("ooo", 2),
  ("ooo", 4),
  ("1f1b", 4),
  ("zb-h1", 4),
  ("gpipe", 4),
  ("interleaved", 4),
  ("zb-v", 4),
  ("ooo", 8),
  ("zb-h1", 8),
  ("ooo", 16),
)
DEFAULT = {"xla_gpu_experimental_parallel_collective_overlap_limit": 1}


def windows(name: str, stages: int, *, dim: int, hidden: int, batch: int, microbatches: int):
  """(bytes per transfer, in-loop permutes, holding the action by default, with the
  table's options) for `name` on `stages` compile-only H100s at lag 1."""
  import ooojax as ooo
  from ooojax.models import mlp_stack

  sched = ooo.pipeline.schedule(
    name, stages, microbatches, chunks=2 if name == "interleaved" else None, lag=1
  )
  vs = sched.virtual_stages
  stage_fn, loss_fn, params, batch_ = mlp_stack.make(
    vs, layers=vs, dim=dim, hidden=hidden, batch=batch
  )
  r = ooo.pipeline.explain(stage_fn, loss_fn, sched, params, batch_)
  # {}: `compiled` uses compiler_options(sched). The loop's only GEMMs are the
  # action switch's, so a window with GEMM work holds the action.
  loops = [
    [w for w in r.compiled("H100", compiler_options=opts).windows if w.in_loop]
    for opts in (DEFAULT, {})
  ]
  assert len(loops[0]) == len(loops[1])
  nbytes = (batch // microbatches) * dim * 4
  return nbytes, len(loops[1]), *(sum(w.overlapped for w in loop) for loop in loops)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dim", type=int, default=512)
  ap.add_argument("--hidden", type=int, default=2048)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--only", nargs="*", help="name:stages cells (default: the grid)")
  ap.add_argument("--write", action="store_true")
  args = ap.parse_args(argv)
  grid = [(c.split(":")[0], int(c.split(":")[1])) for c in args.only] if args.only else GRID
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max(s for _, s in grid)}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from benchmarks import _report
  from ooojax import gpu_hlo

  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    raise SystemExit(f"cannot compile for a GPU here: {reason}")
  lines = _report.header(
    "Lag-1 transfers beside the action, compile-only H100 (benchmarks/pipeline_windows.py)"
  )
  lines += [
    f"Explicit MLP stack, one layer per virtual stage (D={args.dim}, H={args.hidden}), "
    f"batch {args.batch} in {args.microbatches} microbatches, float32, `lag=1`. "
    "Collective-permutes of the tick loop whose window holds the action switch "
    "(the tick's F/B/W GEMMs); XLA's default keeps one collective in flight, "
    "`ooo.pipeline.compiler_options(table)` two. Compiled, not timed.",
    "",
    "| table | stages | bytes per transfer | permutes in the tick loop | holding the action: "
    "XLA's default | with compiler_options(table) |",
    "|---|---|---|---|---|---|",
  ]
  for name, stages in grid:
    nbytes, n, default, both = windows(
      name,
      stages,
      dim=args.dim,
      hidden=args.hidden,
      batch=args.batch,
      microbatches=args.microbatches,
    )
    lines.append(f"| {name} | {stages} | {nbytes:,} | {n} | {default} | {both} |")
    print(lines[-1], flush=True)
  _report.emit(lines, args.write)


if __name__ == "__main__":
  main()
