"""Bytes that cross between the stages per pipelined step, counted from the compiled HLO.

  python -m benchmarks.pipeline_bytes                      # every schedule, both layouts
  python -m benchmarks.pipeline_bytes --stages 4 --write   # append the table to RESULTS.md

Compiles `jax.jit(ooo.pipeline.value_and_grad(stage_fn, loss_fn, ...))` of the
2-process benchmark's model (benchmarks/_mlp_model.py, same sizes as
`benchmarks.pipeline_mp`) on `--stages` forced CPU devices, one per stage, as
the 2-process run places them (one device per process: every byte a collective
moves between devices crosses between processes), with the stage stacks
sharded on the stage axis in each `layout` ("virtual": virtual-stage order;
"device": `ooo.pipeline.device_order`). Each collective of the compiled step is
priced by its shape and executions per step:

* collectives in the tick loop run per tick; a lag-0 transfer sits in a branch
  of its ring's pattern switch and runs at the ticks whose pattern it is (the
  plan's `up_pat` / `dn_pat`), a lag-1 ring sends whole every tick;
* the others run once per step;
* bytes over the links, summed over the devices: a collective-permute moves
  its shape once per pair whose source is not its target, an all-gather
  (n - 1) x its result, an all-reduce 2 (n - 1) / n x its shape per device (a
  ring), a reduce-scatter / all-to-all (n - 1) / n x its operand per device.

`traffic(hlo_text, plan, lag)` is the count; tests/test_pipeline_layout.py
reads the same collectives.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

_COLL = ("collective-permute", "all-gather", "all-reduce", "reduce-scatter", "all-to-all")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s"
  r"(?P<op>" + "|".join(_COLL) + r")(?:-start)?\((?P<rest>.*)$"
)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS = re.compile(r"replica_groups=(\{[^=]*?\}\}|\[[^\]]*\]<=\[[^\]]*\]|\{\})")
_WHILE = re.compile(r"\bwhile\(.*body=%?(?P<body>[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CALLS = re.compile(
  r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
  r"=\s*%?([\w.\-]+)"
)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled step and what it moves per step."""

  op: str
  shape: str  # the printed result type
  computation: str
  in_loop: bool  # inside the tick loop
  pairs: tuple  # collective-permute's (source, target) pairs
  runs: int  # executions per step
  bytes: int  # bytes over the links per step, summed over the devices

  @property
  def shapes(self) -> tuple[str, ...]:
    """The result's array types without layouts (`f32[2,8]`; several for a tuple)."""
    return tuple(re.findall(r"\b[a-z]+\d*\[[\d,]*\]", self.shape))


@dataclasses.dataclass(frozen=True)
class Traffic:
  collectives: tuple[Collective, ...]

  @property
  def total(self) -> int:
    return sum(c.bytes for c in self.collectives)

  def of(self, pred) -> int:
    return sum(c.bytes for c in self.collectives if pred(c))

  @property
  def loop(self) -> int:
    """Bytes the tick loop moves: the activations and their gradients."""
    return self.of(lambda c: c.in_loop)

  @property
  def outside(self) -> int:
    """Bytes moved outside the tick loop: reductions, and any layout moves."""
    return self.of(lambda c: not c.in_loop)


def _computations(text: str) -> dict[str, list[str]]:
  comps, cur = {}, None
  for line in text.splitlines():
    m = _HEADER.match(line)
    if m:
      cur = m.group("name")
      comps[cur] = []
    elif cur is not None:
      comps[cur].append(line)
  return comps


def _reach(comps, roots) -> set[str]:
  seen, todo = set(), list(roots)
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for line in comps[c]:
      todo += _CALLS.findall(line)
      for b in _BRANCHES.findall(line):
        todo += [x.strip().lstrip("%") for x in b.split(",")]
  return seen


def _shape_bytes(shape: str) -> int:
  from ooojax.passes.hlo.schedule import shape_bytes

  return shape_bytes(shape)


def _group_size(rest: str, devices: int) -> int:
  m = _GROUPS.search(rest)
  if not m or m.group(1) == "{}":
    return devices
  g = m.group(1)
  if g.startswith("{{"):
    return len(g[2:].split("}")[0].split(","))
  dims = [int(x) for x in g[1 : g.index("]")].split(",")]  # [groups, size]<=[...]
  return dims[-1]


def _pairs(rest: str) -> tuple:
  pm = _PAIRS.search(rest)
  if not pm:
    return ()
  return tuple(
    tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}", pm.group(1))
  )


def traffic(text: str, plan=None, lag: int = 0, devices: int = 2) -> Traffic:
  """Every collective of `text` (a compiled step's HLO) with its bytes per step.

  `plan` (the step's `passes.pipeline.plan.Plan`) gives how many ticks run each
  lag-0 transfer pattern; without it (or for a collective it does not name) an
  in-loop collective counts once per tick (an upper bound). `devices`: the
  group size of a collective that names no replica groups."""
  import numpy as np

  from ooojax.passes.pipeline.link import one_way_groups
  from ooojax.passes.pipeline.plan import F

  comps = _computations(text)
  loops, trips = set(), {}
  for lines in comps.values():
    for line in lines:
      m = _WHILE.search(line)
      if m:
        body = _reach(comps, [m.group("body")])
        t = _TRIP.search(line)
        n = int(t.group(1)) if t else (plan.rows.shape[0] if plan is not None else 1)
        for c in body:
          trips[c] = n
        loops |= body
  runs_of = {}
  if plan is not None and not lag:
    for ring in ("up", "dn"):
      pats = plan.patterns.get(ring, ())
      counts = np.bincount(plan.rows[:, 0, F[f"{ring}_pat"]], minlength=len(pats))
      for p, k in zip(pats, counts):
        # on CPU the executor sends a pattern as one-way permutes (execute.one_way)
        for g in {p, *one_way_groups(p)} if p else ():
          runs_of[frozenset(g)] = runs_of.get(frozenset(g), 0) + int(k)
  found = {}  # pairs -> in-loop permutes sending them (branches of several patterns)
  for cname, lines in comps.items():
    for line in lines:
      m = _INSTR.match(line)
      if m and m.group("op") == "collective-permute" and cname in loops:
        found.setdefault(_pairs(m.group("rest")), []).append((cname, line))
  out = []
  for cname, lines in comps.items():
    for line in lines:
      m = _INSTR.match(line)
      if not m:
        continue
      op, shape, rest = m.group("op"), m.group("type"), m.group("rest")
      if op == "collective-permute":
        pairs = _pairs(rest)
        shape = shape if not shape.startswith("(") else shape[1:].split(", ")[0]
        size = _shape_bytes(shape) * sum(a != b for a, b in pairs)
      else:
        pairs, n, b = (), _group_size(rest, devices), _shape_bytes(shape)
        # all-gather: each of n devices receives (n - 1) / n of its result; all-reduce
        # (a ring): 2 (n - 1) / n of it per device; the others (n - 1) / n per device
        size = 2 * (n - 1) * b if op == "all-reduce" else (n - 1) * b
      in_loop = cname in loops
      runs = 1
      if in_loop:  # a lag-0 pattern's ticks, else every tick
        runs = runs_of.get(frozenset(pairs), trips.get(cname, 1))
        same = found.get(pairs, [(cname, line)])
        if frozenset(pairs) in runs_of and len(same) > 1:  # the pattern's ticks, shared out
          i = same.index((cname, line))
          runs = runs // len(same) + (i < runs % len(same))
      out.append(Collective(op, shape, cname, in_loop, pairs, runs, size * runs))
  return Traffic(tuple(out))


def measure(
  name: str,
  stages: int,
  microbatches: int,
  layout: str,
  layers: int,
  dim: int,
  hidden: int,
  batch: int,
  lag: int = 0,
) -> dict:
  """One schedule's compiled step on `stages` devices: its `Traffic` and the sizes
  to read it by (weights, one activation, the table's transfers)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  import ooojax as ooo
  from benchmarks import _mlp_model as model
  from ooojax.passes.pipeline.program import program

  mesh = jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])
  sched = ooo.pipeline.schedule(name, stages=stages, microbatches=microbatches, lag=lag)
  full = model.make_params(sched.virtual_stages, layers, dim, hidden)
  if layout == "device":
    full = {k: a[ooo.pipeline.device_order(sched)] for k, a in full.items()}
  params = {
    k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P("stage")))
    for k, a in full.items()
  }
  x, t = model.make_batch(batch, dim)
  rep = NamedSharding(mesh, P())
  b = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in (x, t))
  step = jax.jit(
    ooo.pipeline.value_and_grad(
      model.stage_fn, model.loss_fn, mesh=mesh, axis_name="stage", schedule=sched, layout=layout
    )
  )
  text = step.lower(params, b).compile().as_text()
  prog = program(model.stage_fn, model.loss_fn, sched, params, b)
  tr = traffic(text, prog.plan, lag, stages)
  act = int(np.prod(prog.x_aval.shape)) * prog.x_aval.dtype.itemsize
  sends = sum(a.kind in ("SF", "SB") for row in sched.grid for cell in row for a in cell)
  return {
    "schedule": name,
    "layout": layout,
    "traffic": tr,
    "activation": act,
    "weights": sum(a.nbytes for a in full.values()),
    "transfers": sends,
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--stages", type=int, default=2)
  ap.add_argument(
    "--schedules",
    nargs="*",
    default=["gpipe", "1f1b", "ooo", "zb-h1", "zb-h2", "interleaved", "zb-v"],
  )
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--layouts", nargs="*", default=["virtual", "device"])
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--hidden", type=int, default=1024)
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--lag", type=int, default=0)
  ap.add_argument("--write", action="store_true")
  args = ap.parse_args(argv)
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.stages}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from benchmarks import _report

  mb = 1 << 20
  lines = _report.header(
    "Bytes crossing between stages per step, from the compiled HLO (benchmarks/pipeline_bytes.py)"
  )
  lines += [
    f"{args.stages} stages (forced CPU devices, one per stage, as a run with one "
    f"device per process places them), {args.microbatches} microbatches, lag "
    f"{args.lag}; model: {args.layers} residual blocks, D={args.dim}, "
    f"H={args.hidden}, batch {args.batch}, float32. Bytes over the links per step, "
    "summed over the devices (see the module doc for how each collective is priced).",
    "",
    "| schedule | layout | weights (MiB) | in the tick loop (MiB) | transfers x "
    "activation (MiB) | outside the loop (bytes) | collectives outside the loop |",
    "|---|---|---|---|---|---|---|",
  ]
  for name in args.schedules:
    for layout in args.layouts:
      r = measure(
        name,
        args.stages,
        args.microbatches,
        layout,
        args.layers,
        args.dim,
        args.hidden,
        args.batch,
        args.lag,
      )
      tr = r["traffic"]
      out = [c for c in tr.collectives if not c.in_loop]
      what = ", ".join(f"{c.op} {c.shape.split('{')[0]}" for c in out) or "none"
      lines.append(
        f"| {name} | {layout} | {r['weights'] / mb:.1f} | {tr.loop / mb:.2f} | "
        f"{r['transfers'] * r['activation'] / mb:.2f} | {tr.outside:,} | "
        f"{what} |"
      )
      print(lines[-1], flush=True)
  _report.emit(lines, args.write)


if __name__ == "__main__":
  main()
