"""The pipeline executor's own cost on one device: a one-stage 1F1B table against
the same model accumulated over the same microbatches (`jax.value_and_grad` in a
scan), on this device, alternating in one process. No parallelism and no link:
the ratio is what the executor's ticks, records and per-phase tracing cost.

  python -m benchmarks.executor_cost                        # this device
  python -m benchmarks.executor_cost --also-with xla_gpu_enable_triton_gemm=false
  python -m benchmarks.executor_cost --compile-only H100    # count kernels, run nothing
  python -m benchmarks.executor_cost --record-writes cond always   # both record writes
  python -m benchmarks.executor_cost --ticks switch select   # both tick loops (lowering.py)
  python -m benchmarks.executor_cost --graphs    # each step again as one CUDA graph
  python -m benchmarks.executor_cost --microbatches 8 --steps accumulated executor \
      --record-writes cond always --graphs --budget 90   # the H200 follow-up (issue 48)
  python -m benchmarks.executor_cost --microbatches 8 --steps accumulated executor \
      --ticks switch --weight-slices static dynamic hoist --graphs --rounds 5 --budget 80
      # how the ticks read stacked weights (issue 48's second follow-up); --dry: on CPU
  python -m benchmarks.executor_cost --microbatches 8 --steps accumulated executor \
      --recompute auto off --rounds 5   # B and W recomputing F's LayerNorm statistics

Besides the times it counts the weight-slice copies in the compiled step: the
stacked model's stage function indexes each layer's weights out of its stack
(`p["w1"][j]`), and where the backend makes that a copy kernel (XLA:CPU; XLA:GPU
before a Triton GEMM fusion) the executor makes it in F and again in B, where
the accumulated scan's forward and backward share one (XLA's CSE). On the
compile-only H100 with cuBLAS GEMMs the slices fold into the GEMM calls
(dynamic-slice fusion) and no copy is left. The same blocks as a flax Python
loop (the `loop` rows), pipelined by automatic cutting, keep each layer's
weights arrays of their own (`passes.pipeline.state.columns`): no copy anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import time

import jax
import numpy as np

import ooojax as ooo
from benchmarks import _mlp_model as model, _report
from ooojax._hlo_cli import parse_kv
from ooojax.passes.hlo.kernels import kernels
from ooojax.passes.hlo.schedule import parse
from ooojax.passes.pipeline.lowering import GRAPHS, TICKS
from ooojax.passes.pipeline.tick_options import RECOMPUTE, RECORD_WRITES, WEIGHT_SLICES

_MOVES = {"slice", "dynamic-slice", "bitcast", "copy", "parameter", "reshape", "transpose", "tuple"}
_SCALAR_INDEX = re.compile(r"= (?:s32|u32|s64|pred)\[\]")
_FILL = {"broadcast", "constant", "parameter", "bitcast", "reshape"}


def _op(line: str) -> str | None:
  m = re.search(r"= (?:\([^)]*\)|\S+) ([\w-]+)\(", line)  # a tuple result too
  return m.group(1) if m else None


def weight_slice_copies(hlo: str, dim: int, hidden: int) -> int:
  """Kernels that only copy out one layer's weight matrix, (dim, hidden) or
  (hidden, dim) with leading 1s: a slice or copy instruction, or a fusion whose
  every instruction moves data (XLA:GPU's `wrapped_slice`, XLA:CPU's
  `slice_bitcast_fusion`), outside fused computations; not a copy of a broadcast
  constant (a gradient accumulator's zeros). A GEMM that reads its slice in place
  (a dynamic-slice fusion around a cuBLAS call) has none."""
  bodies: dict[str, list[str]] = {}  # computation -> its instruction lines
  name = None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
    if head:
      name = head.group(1)
      bodies[name] = []
    elif line.startswith("}"):
      name = None
    elif name:
      bodies[name].append(line)
  calls = lambda ln: re.findall(r"calls=%([\w.-]+)", ln)  # noqa: E731
  loops = {"while", "conditional", "call"}  # their computations run kernels of their own
  fused = {c for ls in bodies.values() for ln in ls if _op(ln) not in loops for c in calls(ln)}
  # one matrix, or a tuple of them (XLA:GPU copies sibling dynamic slices in one kernel)
  shape = re.compile(rf"= \(?f32\[(?:1,)*(?:{dim},{hidden}|{hidden},{dim})\]\{{")
  # a fusion's ops, but for scalar index arithmetic (a dynamic slice's offset)
  inner = lambda ln: {  # noqa: E731
    _op(x) for c in calls(ln) for x in bodies.get(c, ["?"]) if not _SCALAR_INDEX.search(x)
  }
  by_name = {
    m.group(1): ln
    for ls in bodies.values()
    for ln in ls
    if (m := re.match(r"\s*(?:ROOT )?%(\S+) = ", ln))
  }

  def fill(name: str) -> bool:  # a broadcast constant (an accumulator's zeros), not weights
    ln = by_name.get(name, "")
    op = _op(ln)
    if op == "copy":
      return all(fill(a) for a in re.findall(r"%([\w.-]+)", ln.split("copy(", 1)[1].split(")")[0]))
    return op in ("broadcast", "constant") or (op == "fusion" and inner(ln) <= _FILL)

  n = 0
  for comp, lines in bodies.items():
    for ln in lines if comp not in fused else ():
      op = _op(ln)
      if not shape.search(ln) or op is None:
        continue
      moves = op in ("slice", "dynamic-slice", "copy") or (op == "fusion" and inner(ln) <= _MOVES)
      n += moves and not fill(re.match(r"\s*(?:ROOT )?%(\S+) = ", ln).group(1))
  return n


def loop_copies(hlo: str) -> int:
  """Copy kernels in the step's loop bodies (what runs per tick, or per scan
  step), branches included: `copy` instructions and fusions that only slice
  (XLA:GPU's `wrapped_slice`: a memcpy; a dynamic slice's fusion with its
  offset's scalar arithmetic; sibling slices copied in one multi-output fusion). On the H200 these ran as the
  `memcpy32_post` / `memcpy128` kernels (RESULTS, issue 48)."""
  s = parse(hlo)
  moves = {"slice", "dynamic-slice", "bitcast", "parameter", "tuple"}
  n = 0
  for c in s.loop_bodies():
    for i in s.computations[c]:
      inner = s.computations.get(i.calls[0], ()) if i.op == "fusion" and i.calls else ()
      index = lambda x: re.match(r"(s32|u32|s64|pred)\[\]", x.shape)  # noqa: E731
      n += i.op == "copy" or bool(inner) and all(x.op in moves or index(x) for x in inner)
  return n


def loop_kernels(hlo: str) -> int:
  """Kernels the step's top-level loops launch per iteration, each branch of
  their conditionals counted once (`passes.hlo.kernels`): for the executor's
  one-stage 1F1B table, the tick body and one F, one B and one W; for the
  accumulated scan, one microbatch's forward and backward."""
  s = parse(hlo)
  bodies = [i.calls[-1] for i in s.computations[s.entry_name] if i.op == "while"]
  return sum(kernels(dataclasses.replace(s, entry_name=b)).n for b in bodies)


def steps(m: int, mesh, params, batch) -> dict:
  """`{name: (step, args)}`: the stacked model (the explicit form, `p["w1"][j]` per
  layer) and the same blocks as a flax Python loop (the automatic form, each layer
  its own leaves), each accumulated and pipelined."""
  sched = ooo.pipeline.schedule("1f1b", stages=1, microbatches=m)
  ex = ooo.pipeline.value_and_grad(
    model.stage_fn, model.loss_fn, mesh=mesh, axis_name="stage", schedule=sched
  )
  loss, flax_params = model.flax_loop(params)
  auto = ooo.pipeline.value_and_grad(
    loss, mesh=mesh, axis_name="stage", schedule=sched, microbatches=m
  )
  loop_args = (flax_params, *batch)
  return {
    f"accumulated/{m}": (model.accumulated(m), (params, batch)),
    f"executor/{m}": (ex, (params, batch)),
    f"loop accumulated/{m}": (model.accumulated_loss(loss, m), loop_args),
    f"loop automatic/{m}": (auto, loop_args),
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--microbatches", type=int, nargs="*", default=[8, 16])
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--hidden", type=int, default=1024)
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--also-with", nargs="*", default=[], metavar="OPTS", help="a=1,b=2 each")
  ap.add_argument("--compile-only", metavar="GPU", help="compile for this GPU; run nothing")
  ap.add_argument(
    "--record-writes",
    nargs="+",
    default=["auto"],
    choices=["auto", "cond", "always"],
    help="the executor's record writes (OOOJAX_RECORD_WRITES; auto: always on a GPU, "
    "cond on CPU): each mode's pipelined rows, alternating with the rest",
  )
  ap.add_argument(
    "--ticks",
    nargs="+",
    default=["auto"],
    choices=["auto", "switch", "select"],
    help="the executor's tick loop (OOOJAX_TICKS): each one's pipelined rows",
  )
  ap.add_argument(
    "--weight-slices",
    nargs="+",
    default=["auto"],
    choices=["auto", "static", "dynamic", "hoist"],
    help="how the ticks read the stacked layers' weights (OOOJAX_WEIGHT_SLICES; auto: "
    "dynamic on a GPU, static on CPU): each mode's pipelined rows",
  )
  ap.add_argument(
    "--recompute",
    nargs="+",
    default=["auto"],
    choices=["auto", "fused", "arith", "off"],
    help="what B and W recompute of F's values instead of reading the records "
    "(OOOJAX_RECOMPUTE; auto: fused on a GPU, arith on CPU; off: F saves all): each "
    "mode's pipelined rows",
  )
  ap.add_argument(
    "--steps",
    nargs="+",
    default=["accumulated", "executor", "loop accumulated", "loop automatic"],
    help="which steps (names before the '/'): e.g. accumulated executor",
  )
  ap.add_argument(
    "--graphs",
    action="store_true",
    help="also each step compiled with CUDA-graph conditionals and loops "
    "(passes.pipeline.lowering.GRAPHS): a tick loop captured whole never returns to the host",
  )
  ap.add_argument(
    "--budget",
    type=float,
    default=0.0,
    help="seconds: compile no new variant after 60%% of them (the rest say 'skipped')",
  )
  ap.add_argument(
    "--dry",
    action="store_true",
    help="a dry run (on CPU): tiny sizes, 4 microbatches, one round of one call",
  )
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  if a.dry:
    a.layers, a.dim, a.hidden, a.batch, a.microbatches = 2, 16, 32, 16, [4]
    a.rounds = a.iters = 1
  option_sets = [("", {})] + [(f" [{o}]", parse_kv(o.split(","))) for o in a.also_with]
  # graphs first: under a --budget their rows are what a run is for (issue 48)
  option_sets = ([(" [graphs]", GRAPHS)] if a.graphs else []) + option_sets
  start = time.perf_counter()
  params = model.make_params(1, a.layers, a.dim, a.hidden)
  batch = model.make_batch(a.batch, a.dim)
  if a.compile_only:
    from ooojax import gpu_hlo

    mesh = gpu_hlo.mesh(a.compile_only, 1, ("stage",))
    to_arg = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    device = f"compile-only {a.compile_only} (nothing ran)"
  else:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("stage",))
    to_arg = jax.numpy.asarray
    device = jax.devices()[0].device_kind
  fns, copies, conds, moves, kerns, skipped = {}, {}, {}, {}, {}, {}
  # `select` writes every record (its ticks have no cond): one record mode for it
  modes = list(itertools.product(a.ticks, a.record_writes, a.weight_slices, a.recompute))
  modes = [(t, r, h, c) for t, r, h, c in modes if t != "select" or r == a.record_writes[0]]
  # option sets outermost: under a --budget each set's rows (and their ratios) come whole
  for m in a.microbatches:
    for suffix, opts in option_sets:
      for ticks, mode, slices, rc in modes:
        os.environ[RECORD_WRITES] = mode  # read while the executor traces
        os.environ[TICKS] = ticks
        os.environ[WEIGHT_SLICES] = slices
        os.environ[RECOMPUTE] = rc
        for name, (f, args) in steps(m, mesh, params, batch).items():
          if name.split("/")[0] not in a.steps:
            continue
          if (ticks, mode, slices, rc) != modes[0]:
            if "accumulated" in name:  # no executor: the first mode's row stands
              continue
            name += f" [records: {mode}]" if mode != a.record_writes[0] else ""
            name += f" [ticks: {ticks}]" if ticks != a.ticks[0] else ""
            name += f" [slices: {slices}]" if slices != a.weight_slices[0] else ""
            name += f" [recompute: {rc}]" if rc != a.recompute[0] else ""
          key = name + suffix
          if a.budget and time.perf_counter() - start > 0.6 * a.budget:
            skipped[key] = "skipped (budget)"
            continue
          args = jax.tree.map(to_arg, args)
          t0 = time.perf_counter()
          if a.compile_only:
            hlo = gpu_hlo.compile_text(
              f, *args, gpu=a.compile_only, mesh=mesh, compiler_options=opts
            )
          else:
            exe = jax.jit(f).lower(*args).compile(compiler_options=opts)
            fns[key] = lambda exe=exe, args=args: exe(*args)
            hlo = exe.as_text()
          print(f"{key}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
          copies[key] = weight_slice_copies(hlo, a.dim, a.hidden)
          conds[key] = len(re.findall(r" conditional\(", hlo))
          moves[key] = loop_copies(hlo)
          kerns[key] = loop_kernels(hlo)
  times, failed = _report.compile_then_alternate(fns, (), a.rounds, a.iters)
  failed.update(skipped)
  lines = _report.header("Pipeline executor's own cost, one device (benchmarks/executor_cost.py)")
  lines += [
    f"Device: {device}. Model: {a.layers} residual blocks x + gelu(LN(x) W1) W2, D={a.dim}, "
    f"H={a.hidden}, batch {a.batch}, float32. The executor runs a one-stage 1F1B table; "
    "the accumulated step is jax.value_and_grad in a scan over the same microbatches. "
    "Stacked: the explicit form's stage function, `p['w1'][j]` per layer; loop: the same "
    "blocks as a flax Python loop, pipelined by automatic cutting (each layer's weights "
    "arrays of their own). "
    + (
      ""
      if a.compile_only
      else f"Median of {a.rounds} rounds x {a.iters} calls, all variants alternating. "
    )
    + "Weight-slice copies: kernels in the compiled step that copy out one layer's "
    "weight matrix (per loop body where the step loops). Conditionals: in the compiled "
    "step (XLA:GPU reads each one's branch index back on the host); `[records: always]`: "
    "every tick writes its records, a trash slot for ticks with none "
    "(OOOJAX_RECORD_WRITES=always), where the default writes them under a cond; "
    "`[ticks: select]`: every tick runs every action, the row's kept by `where` (no "
    "conditional; OOOJAX_TICKS=select, passes.pipeline.lowering); `[records: auto]`: "
    "always on a GPU, cond on CPU. Loop copies: copy kernels per loop iteration (copies "
    "and slice-only fusions in the loop body and its branches). `[graphs]`: compiled with "
    "CUDA-graph conditionals and loops (`xla_gpu_enable_command_buffer` + CONDITIONAL, "
    "WHILE). `[slices: static]`: each F, B and W slices the stacked layers' weights "
    "(a copy kernel before a Triton GEMM); `dynamic` (the GPU default, "
    "OOOJAX_WEIGHT_SLICES=auto): dynamic slices, which XLA:GPU copies in one kernel per "
    "stacked weight and phase; `hoist`: sliced "
    "once before the ticks (passes.pipeline.weight_slices). `[recompute: off]`: F saves "
    "every value B and W read (LayerNorm statistics, GELU's factors), where the default "
    "(OOOJAX_RECOMPUTE=auto) has B and W recompute the cheap ones (passes.pipeline.recompute). "
    "Loop kernels: per loop iteration, each "
    "branch once (the executor: its tick body plus one F, one B and one W).",
    "",
    "| step | ms (median) | pipelined / accumulated | weight-slice copies | conditionals "
    "| loop copies | loop kernels |",
    "|---|---|---|---|---|---|---|",
  ]
  base = {"executor/": "accumulated/", "loop automatic/": "loop accumulated/"}
  for key in [*copies, *skipped]:
    if key in skipped:
      lines.append(f"| {key} | {skipped[key]} |  |  |  |  |  |")
      continue
    n = copies[key]
    ms = f"{np.median(times[key]) * 1e3:.2f}" if key in times else failed.get(key, "-")
    pre = next((p for p in base if key.startswith(p)), None)
    acc = (
      re.sub(r" \[(records|ticks|slices|recompute): \w+\]", "", key.replace(pre, base[pre]))
      if pre
      else None
    )
    ratio = (
      f"{np.median(times[key]) / np.median(times[acc]):.2f}x"
      if acc and key in times and acc in times
      else ""
    )
    lines.append(f"| {key} | {ms} | {ratio} | {n} | {conds[key]} | {moves[key]} | {kerns[key]} |")
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
