"""Pipeline schedules: bubble and memory from the tables, simulated BERT step
time from the cost model, and measured wall time of the real CPU execution.

  python -m benchmarks.pipeline            # print the tables
  python -m benchmarks.pipeline --write    # and append them to benchmarks/RESULTS.md
  python -m benchmarks.pipeline --no-cpu   # tables and simulation only (no compiles)

Simulated numbers (the BERT table, and the paper-scale one: BERT-24 / BERT-48 on
8-32 stages over 10GbE / 25GbE) come from `passes.cost` (H100 roofline) priced on
the F / B / W phases that `passes.pipeline.execute` cuts from a BERT layer with
the split pass; they are estimates, never measurements. The CPU table is measured
on forced host devices (one process, shared cores): it checks that the programs
run and what the table machinery costs, not GPU speed (benchmarks/pipeline_mp.py
measures one stage per process and core).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import (
  _mlp_model as mlp,  # noqa: E402
  _report,  # noqa: E402
)
from ooojax.passes.cost import CostModel  # noqa: E402
from ooojax.passes.pipeline.execute import make_flavor  # noqa: E402
from ooojax.passes.pipeline.generate import SCHEDULES, generate  # noqa: E402
from ooojax.passes.simulate import LINKS  # noqa: E402

STAGES = (4, 8, 16)
MICROBATCHES = (8, 16, 32, 64)


def _bert_layer(p, x):
  """Post-LN BERT encoder layer (attention + GELU MLP), heads of 64."""
  b, s, d = x.shape
  h = d // 64
  qkv = x @ p["qkv"]
  q, k, v = jnp.split(qkv.reshape(b, s, 3 * h, 64), 3, axis=2)
  att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0, axis=-1)
  o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d) @ p["out"]
  x = mlp.layer_norm(x + o)
  return mlp.layer_norm(x + jax.nn.gelu(x @ p["up"]) @ p["down"])


def bert_costs(hidden=1024, seq=512, micro=4, dtype=jnp.bfloat16, spec="H100"):
  """(F, B, W) seconds of one BERT layer on one microbatch, from the cost model."""
  sd = lambda *s: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
  p = {
    "qkv": sd(hidden, 3 * hidden),
    "out": sd(hidden, hidden),
    "up": sd(hidden, 4 * hidden),
    "down": sd(4 * hidden, hidden),
  }
  fl = make_flavor(
    False, False, _bert_layer, None, None, p, None, sd(micro, seq, hidden), None, None
  )
  cm = CostModel(spec)
  cost = lambda ids: cm.unit_cost([fl.jaxpr.eqns[k] for k in ids]).seconds  # noqa: E731
  act_bytes = micro * seq * hidden * jnp.dtype(dtype).itemsize
  return cost(fl.f_eqns), cost(fl.b_eqns), cost(fl.w_eqns), act_bytes


def table_metrics() -> list[str]:
  lines = [
    "Bubble fraction (F = B = W = 1) / peak activations per stage (max over stages), "
    "from the generated tables (interleaved and zb-v: 2 chunks per device, peak in chunk "
    "activations, each half a stage's).",
    "",
    "| stages | microbatches | " + " | ".join(SCHEDULES) + " |",
    "|---|---|" + "---|" * len(SCHEDULES),
  ]
  for s in STAGES:
    for m in MICROBATCHES:
      cells = []
      for name in SCHEDULES:
        t = generate(name, s, m)
        cells.append(f"{t.bubble_fraction():.3f} / {max(t.peak_activations())}")
      lines.append(f"| {s} | {m} | " + " | ".join(cells) + " |")
  return lines


@functools.lru_cache(maxsize=None)
def _table(name: str, stages: int, micro: int, costs: tuple[float, float, float]):
  # Generated for these costs (as Zero Bubble plans with profiled times); cached
  # because generation (tens of ms to seconds) does not depend on the link.
  return generate(name, stages, micro, costs=dict(zip("FBW", costs)))


def step_times(names, stages: int, micro: int, layer_fbw, k: float, comm: float) -> dict:
  """Simulated seconds per step of each schedule when a whole stage runs `k`
  layers of per-layer (F, B, W) seconds and a transfer takes `comm` seconds."""
  costs = tuple(c * k for c in layer_fbw)
  return {
    n: _table(n, stages, micro, costs).simulate(dict(zip("FBW", costs)), comm).makespan
    for n in names
  }


def table_simulated() -> tuple[list[str], dict]:
  f, b, w, nbytes = bert_costs()
  comm = LINKS["nvlink"].seconds(nbytes)
  lines = [
    f"Simulated step time (ms), BERT-24 / BERT-48 (hidden 1024, seq 512, microbatch 4, "
    f"bf16), per-layer F / B / W = {f * 1e3:.3f} / {b * 1e3:.3f} / {w * 1e3:.3f} ms "
    f"from the H100 cost model, activation transfer {comm * 1e6:.1f} us (NVLink); "
    "tables generated with these costs; in brackets: speedup over GPipe. "
    "**simulated**, not measured.",
    "",
    "| model | stages | microbatches | " + " | ".join(SCHEDULES) + " |",
    "|---|---|---|" + "---|" * len(SCHEDULES),
  ]
  speed = {}
  for layers in (24, 48):
    for s in STAGES:
      for m in (8, 32, 64):
        times = step_times(SCHEDULES, s, m, (f, b, w), layers / s, comm)
        speed[(layers, s, m)] = {n: times["gpipe"] / t for n, t in times.items()}
        speed[(layers, s, m)]["ooo/1f1b"] = times["1f1b"] / times["ooo"]
        cells = [f"{times[n] * 1e3:.1f} ({times['gpipe'] / times[n]:.2f}x)" for n in SCHEDULES]
        lines.append(f"| BERT-{layers} | {s} | {m} | " + " | ".join(cells) + " |")
  return lines, speed


PAPER_SCHEDULES = ("gpipe", "1f1b", "ooo", "zb-h1", "zb-v")


def table_paper_scale(
  stages=(8, 16, 32), links=("10GbE", "25GbE"), micro_per_stage=(2, 4)
) -> tuple[list[str], list[float], list[float]]:
  """Simulated BERT-24 / BERT-48 at the OOO BackProp paper's scale (8-32 GPUs over
  Ethernet). Returns (lines, ooo/gpipe over exact cells, ooo/gpipe over all cells)."""
  f, b, w, nbytes = bert_costs()
  lines = [
    f"Simulated step time (ms) at the paper's scale: BERT-24 / BERT-48 (hidden 1024, "
    f"seq 512, microbatch 4, bf16; per-layer F / B / W = {f * 1e3:.3f} / {b * 1e3:.3f} "
    f"/ {w * 1e3:.3f} ms, H100 cost model), one stage per GPU, each activation "
    f"({nbytes / 2**20:.0f} MiB) crossing "
    + " or ".join(f"{n} ({LINKS[n].seconds(nbytes) * 1e3:.2f} ms)" for n in links)
    + "; in brackets: speedup over GPipe. **simulated**, not measured. "
    "~: the layers do not divide evenly over the stages, every stage priced at the "
    "slowest one's ceil(layers / stages) (an upper bound for all schedules alike); "
    "n/a: fewer layers than (virtual) stages, or zb-v where layers do not divide "
    "evenly over its 2 x stages chunks.",
    "",
    "| model | link | stages | microbatches | " + " | ".join(PAPER_SCHEDULES) + " |",
    "|---|---|---|---|" + "---|" * len(PAPER_SCHEDULES),
  ]
  exact, every = [], []
  for layers in (24, 48):
    for link in links:
      comm = LINKS[link].seconds(nbytes)
      for s in stages:
        for m in (r * s for r in micro_per_stage):
          runnable = [n for n in PAPER_SCHEDULES if _layers_fit(n, layers, s)]
          even = layers % s == 0
          times = step_times(runnable, s, m, (f, b, w), math.ceil(layers / s), comm)
          g = times.get("gpipe")
          if g is not None and "ooo" in times:
            every.append(g / times["ooo"])
            if even:
              exact.append(g / times["ooo"])
          cells = [
            (
              "n/a"
              if n not in times
              else f"{'' if even else '~'}{times[n] * 1e3:.1f} ({g / times[n]:.2f}x)"
            )
            for n in PAPER_SCHEDULES
          ]
          lines.append(f"| BERT-{layers} | {link} | {s} | {m} | " + " | ".join(cells) + " |")
  return lines, exact, every


def _layers_fit(name: str, layers: int, stages: int) -> bool:
  """Whether `layers` can be cut into this schedule's (virtual) stages."""
  if name == "zb-v":
    return layers % (2 * stages) == 0
  return layers >= stages


def paper_scale_summary(exact, every) -> list[str]:
  if not every:
    return ["- (no cell with both gpipe and ooo at the paper's scale)"]
  rng = lambda r: f"{min(r):.2f}x-{max(r):.2f}x" if r else "none"  # noqa: E731
  lines = [
    f"- ooo over GPipe at the paper's scale (simulated, table above): {rng(exact)} where "
    f"the layers divide evenly, {rng(every)} with the ~ cells; the paper measured "
    "1.41-1.99x (8-32 GPUs, its GPipe baseline)."
  ]
  if max(every) < 1:
    lines.append(
      "- Why below 1 here: an activation's transfer over Ethernet takes about as long as a "
      "stage's forward or longer (caption above); the 1F1B family holds at most S - s "
      "microbatches in flight, so each stage waits on round trips that GPipe, with every "
      "microbatch in flight, hides. This simulator prices a transfer as a delay (no "
      "bandwidth shared between concurrent transfers) and the tables are planned without "
      "it, both of which favour GPipe; over NVLink ooo is ahead of GPipe (the BERT table "
      "before this one)."
    )
  return lines


# SpectraX's pipeline benchmark model (benchmarks/_mlp_model.py), its sizes.
BLOCKS, DIM, HIDDEN, BATCH = 8, 256, 1024, 256


def table_cpu(stages=4, micros=(8, 16), batch=BATCH, rounds=7, schedules=SCHEDULES, record=None):
  """Every schedule on `stages` forced CPU devices, alternating with the baselines;
  `record` (a dict) receives every row's per-round ms."""
  from ooojax.passes.pipeline.execute import lower, memory

  devs = jax.devices()[:stages]
  if len(devs) < stages:
    return [f"(CPU table skipped: {len(devs)} devices, need {stages})"]
  mesh = jax.make_mesh((stages,), ("stage",), devices=devs)
  lines = [
    f"Measured on {stages} forced **CPU** host devices in one process (the machine's "
    f"{os.cpu_count()} cores shared by all devices), SpectraX's benchmark model: "
    f"{BLOCKS} residual blocks x + W2 gelu(W1 LN(x)), D {DIM}, H {HIDDEN}, batch {batch}, "
    f"MSE. Rounds alternate over every row; median of {rounds}. 'x unpip.' divides by "
    "`jax.jit(jax.value_and_grad)` of the whole batch on one device; 'x accum.' by the "
    "same model's value_and_grad accumulated over the microbatches on one device (the "
    "pipeline's per-microbatch kernels without a pipeline). Temp: compiled temp bytes "
    "per device; bound: the device's weights + gradient accumulators + peak "
    "activations x (F + B residual record of one microbatch).",
    "",
    "| schedule | microbatches | ticks | step (ms) | x unpip. | x accum. | temp (MB) | "
    "bound (MB) | temp / bound |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  fns, meta = {}, {}
  params = lambda v: jax.tree.map(jnp.asarray, mlp.make_params(v, BLOCKS, DIM, HIDDEN))  # noqa: E731
  x, t = (jnp.asarray(a) for a in mlp.make_batch(batch, DIM))
  p1 = params(stages)

  loss = lambda p: mlp.flat_loss(p, (x, t))  # noqa: E731
  fns["unpipelined"] = (jax.jit(jax.value_and_grad(loss)), (p1,))
  for m in micros:
    fns[f"accum{m}"] = (jax.jit(mlp.accumulated(m)), (p1, (x, t)))
    for name in schedules:
      sched = generate(name, stages, m)
      p = params(sched.virtual_stages)
      step = jax.jit(lower(mlp.stage_fn, mlp.loss_fn, sched, mesh, "stage"))
      temp = step.lower(p, (x, t)).compile().memory_analysis().temp_size_in_bytes
      meta[(name, m)] = (
        sched.ticks,
        temp,
        memory(mlp.stage_fn, mlp.loss_fn, sched, p, (x, t)).bound,
      )
      fns[(name, m)] = (step, (p, (x, t)))
  for f, args in fns.values():
    jax.block_until_ready(f(*args))
  times = {k: [] for k in fns}
  for _ in range(rounds):
    for k, (f, args) in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      times[k].append(time.perf_counter() - t0)
  ms = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
  if record is not None:
    record.update(
      {
        k if isinstance(k, str) else f"{k[0]}/{k[1]}": [x * 1e3 for x in v]
        for k, v in times.items()
      }
    )
  lines.append(
    f"| unpipelined jax.value_and_grad, 1 device | - | - | {ms['unpipelined']:.0f} "
    f"| 1.00 | - | - | - | - |"
  )
  for m in micros:
    acc = ms[f"accum{m}"]
    lines.append(
      f"| accumulated over microbatches, 1 device | {m} | - | {acc:.0f} | "
      f"{acc / ms['unpipelined']:.2f} | 1.00 | - | - | - |"
    )
    for name in schedules:
      ticks, temp, bound = meta[(name, m)]
      v = ms[(name, m)]
      lines.append(
        f"| {name} | {m} | {ticks} | {v:.0f} | {v / ms['unpipelined']:.2f} | "
        f"{v / acc:.2f} | {temp / 1e6:.1f} | {bound / 1e6:.1f} | "
        f"{temp / bound:.2f} |"
      )
  return lines


def summary(speed) -> list[str]:
  ooo = [v["ooo"] for v in speed.values()]
  zb1 = [v["zb-h1"] for v in speed.values()]
  zbv = [v["zb-v"] for v in speed.values()]
  vs1 = [v["ooo/1f1b"] for v in speed.values()]
  ratios = []
  for s in STAGES:
    for m in MICROBATCHES:
      base = generate("1f1b", s, m).bubble_fraction()
      ratios.append(
        (
          generate("ooo", s, m).bubble_fraction() / base,
          generate("zb-h1", s, m).bubble_fraction() / base,
        )
      )
  r_ooo = [r[0] for r in ratios]
  r_zb = [r[1] for r in ratios]
  return [
    f"- ooo (gradient fast-forwarding) over GPipe, simulated BERT rows above: "
    f"{min(ooo):.2f}x-{max(ooo):.2f}x (the paper reports 1.41-1.99x on 8-32 GPUs with its "
    f"baseline GPipe implementation); over 1F1B {min(vs1):.2f}x-{max(vs1):.2f}x; "
    f"ZB-H1 over GPipe {min(zb1):.2f}x-{max(zb1):.2f}x; ZB-V {min(zbv):.2f}x-{max(zbv):.2f}x.",
    f"- Bubble relative to 1F1B's (F = B = W, tables above): ooo {min(r_ooo):.2f}-"
    f"{max(r_ooo):.2f}, ZB-H1 {min(r_zb):.2f}-{max(r_zb):.2f} (Zero Bubble's B/3 = 0.33).",
  ]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--write", action="store_true")
  ap.add_argument("--no-cpu", action="store_true")
  ap.add_argument("--cpu-only", action="store_true", help="only the measured CPU table")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--batch", type=int, default=BATCH)
  ap.add_argument("--schedules", nargs="*", default=list(SCHEDULES))
  ap.add_argument("--json", help="save the CPU table's per-round ms here")
  args = ap.parse_args(argv)
  lines = _report.header("Pipeline schedules (benchmarks/pipeline.py)")
  if not args.cpu_only:
    lines += table_metrics() + [""]
    sim, speed = table_simulated()
    lines += sim + [""] + summary(speed) + [""]
    paper, exact, every = table_paper_scale()
    lines += paper + [""] + paper_scale_summary(exact, every) + [""]
  if not args.no_cpu:
    record: dict = {}
    lines += table_cpu(
      rounds=args.rounds, batch=args.batch, schedules=args.schedules, record=record
    )
    if args.json:
      with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
  _report.emit(lines, args.write)


if __name__ == "__main__":
  main()
