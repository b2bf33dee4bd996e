"""Peer benchmark: SpectraX's own pipeline-parallel train step on the ooojax pipeline model.

Model (same as ooojax's pipeline comparison): 8 residual blocks
``x + gelu(LN(x) @ W1) @ W2`` (LN = parameter-free layer norm, eps 1e-5), D=256,
H=1024, global batch 256, MSE loss against random targets, float32, split into 4
pipeline stages of 2 blocks on 4 forced host CPU devices.

What runs, per microbatch count:
  * every SpectraX schedule through its true MPMD runtime, the documented
    ``spectrax.runtime.sxcall(PipelineSequential, (x, y), mesh=MpMdMesh, schedule=...,
    loss_fn=...)`` -> (loss, per-stage grads). Virtual-stage schedules (interleaved,
    KimiK2, DualPipeV) get 8 logical stages of 1 block, flat ones 4 stages of 2 blocks;
  * SpectraX's SPMD ``spectrax.runtime.spmd.pipeline_step``: one jit of a vmap over
    microbatches with the stacked stage params sharded over the pp axis, XLA placing
    the work; it reads only ``schedule.microbatches``, so it is one row per m;
  * the unpipelined baseline ``jax.jit(jax.value_and_grad(loss))`` on one device.
Each variant is compiled by one warm-up call and checked against the baseline (loss and
every gradient), then timed for ``--rounds`` rounds; a round calls every variant once,
in a rotated order, and a call is timed to ``block_until_ready`` on loss and grads.
The reported number is the median ms per step.

It lives in its own process (and venv) because spectrax-lib 0.1.4 needs jax 0.10.2,
while ooojax needs jax >= 0.11.2; it imports only jax, numpy, spectrax and stdlib.

  /tmp/vpeer/bin/python benchmarks/peer_spectrax.py --microbatches 8 16 --rounds 7 --out result.json
"""

from __future__ import annotations

import os
import sys

# Running the file puts benchmarks/ first on sys.path; its modules (pipeline.py, ...)
# must not shadow anything jax or spectrax import.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
  sys.path.pop(0)

# Four host devices and CPU only must be fixed before jax is imported.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# SpectraX logs every compile and per-step schedule stats at INFO; keep stdout readable.
os.environ.setdefault("LOGGING_LEVEL_ED", "WARNING")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import spectrax as spx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from spectrax import nn  # noqa: E402
from spectrax.nn import PipelineSequential  # noqa: E402
from spectrax.runtime import (
  schedules as sched,  # noqa: E402
  sxcall,  # noqa: E402
)
from spectrax.runtime.spmd import pipeline_step  # noqa: E402
from spectrax.runtime.types import MpMdMesh  # noqa: E402

STAGES, BLOCKS = 4, 8
# Every schedule SpectraX exports; virtual-stage ones take virtual_stages=2 (as in
# SpectraX's examples/07_mpmd/06_all_schedulers.py and benchmarks/train_pipeline.py).
SCHEDULES = (
  "GPipe",
  "Std1F1B",
  "Eager1F1B",
  "ZeroBubbleH1",
  "InterleavedH1",
  "InterleavedGPipe",
  "Interleaved1F1BPlusOne",
  "KimiK2",
  "DualPipeV",
)
SPMD = "spmd-pipeline_step"


# ---------------------------------------------------------------- model


def layer_norm(x):
  m = x.mean(-1, keepdims=True)
  return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)


def block(w1, w2, x):
  return x + jax.nn.gelu(layer_norm(x) @ w1) @ w2


def mse(out, y):
  return ((out - y) ** 2).mean()


def reference_loss(weights, x, y):
  for w1, w2 in weights:
    x = block(w1, w2, x)
  return mse(x, y)


class Block(spx.Module):
  """One residual block; weights are given so every variant shares the same values."""

  def __init__(self, w1, w2):
    super().__init__()
    self.w1 = spx.Parameter(w1)
    self.w2 = spx.Parameter(w2)

  def forward(self, x):
    return block(self.w1.value, self.w2.value, x)


class Stage(spx.Module):
  """One logical pipeline stage: consecutive blocks."""

  def __init__(self, weights):
    super().__init__()
    self.blocks = nn.Sequential(*[Block(w1, w2) for w1, w2 in weights])

  def forward(self, x):
    return self.blocks(x)


def init_data(d: int, h: int, batch: int):
  rng = np.random.default_rng(0)
  weights = [
    (
      rng.standard_normal((d, h), np.float32) / np.sqrt(d),
      rng.standard_normal((h, d), np.float32) / np.sqrt(h),
    )
    for _ in range(BLOCKS)
  ]
  x = rng.standard_normal((batch, d), np.float32)
  y = rng.standard_normal((batch, d), np.float32)
  return weights, x, y


# ---------------------------------------------------------------- variants


@dataclass
class Variant:
  schedule: str
  microbatches: int | None  # None: the unpipelined baseline
  step: Callable[[], tuple]  # -> (loss, grads as [(w1, w2)] * BLOCKS)
  virtual_stages: int = 1
  compile_s: float = 0.0
  times_ms: list[float] = field(default_factory=list)


def make_schedule(name: str, m: int):
  cls = getattr(sched, name)
  try:
    return cls(microbatches=m, virtual_stages=2)
  except TypeError:  # flat schedules (and DualPipeV, V=2 built in) take no virtual_stages
    return cls(microbatches=m)


def grads_by_block(stage_grads, per_stage: int):
  """Per-logical-stage grad States (logical order) -> [(dW1, dW2)] in block order."""
  out = []
  for g in stage_grads:
    leaves = {path: leaf for _, path, leaf in g.items()}
    out += [(leaves[f"blocks.{j}.w1"], leaves[f"blocks.{j}.w2"]) for j in range(per_stage)]
  return out


def mpmd_variant(name, m, weights, x, y, devices, mesh) -> tuple[Variant, int]:
  s = make_schedule(name, m)
  v = s.virtual_stages_per_rank()
  n_logical = STAGES * v
  per = BLOCKS // n_logical
  owner = {s.logical_at(r, k, STAGES): r for r in range(STAGES) for k in range(v)}
  # sxcall decides which rank owns an argument from the device it lives on, and
  # raises if a rank-0 array is used only by another stage: so build each stage's
  # weights on its rank, feed x to the first stage's rank and y to the loss rank.
  stages = []
  for lg in range(n_logical):
    with jax.default_device(devices[owner[lg]]):
      stages.append(
        Stage([tuple(jnp.asarray(a) for a in w) for w in weights[lg * per : (lg + 1) * per]])
      )
  model = PipelineSequential(*stages)
  xs = jax.device_put(x, devices[owner[0]])
  ys = jax.device_put(y, devices[s.terminal_loc(STAGES)[0]])

  def step():
    return sxcall(model, (xs, ys), mesh=mesh, schedule=s, loss_fn=mse)

  return Variant(name, m, step, virtual_stages=v), per


def spmd_variant(m, weights, x, y, devices) -> tuple[Variant, int]:
  per = BLOCKS // STAGES
  model = PipelineSequential(
    *[
      Stage([tuple(jnp.asarray(a) for a in w) for w in weights[i * per : (i + 1) * per]])
      for i in range(STAGES)
    ]
  )
  mesh = Mesh(devices, ("pp",))
  s = sched.GPipe(microbatches=m)  # only .microbatches is read by the SPMD runtime
  xs, ys = jnp.asarray(x), jnp.asarray(y)

  def step():
    return pipeline_step(model, (xs, ys), mesh=mesh, axis="pp", schedule=s, loss_fn=mse)

  return Variant(SPMD, m, step), per


def baseline_variant(weights, x, y, device) -> Variant:
  w = jax.device_put([tuple(map(jnp.asarray, p)) for p in weights], device)
  xs, ys = jax.device_put(x, device), jax.device_put(y, device)
  fn = jax.jit(jax.value_and_grad(reference_loss))
  return Variant("unpipelined", None, lambda: fn(w, xs, ys))


# ---------------------------------------------------------------- run


def timed(fn):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, (time.perf_counter() - t0) * 1e3


def compare(out, ref) -> dict:
  """Loss and max gradient error against the unpipelined run (float32 tolerance)."""
  (loss, grads), (rloss, rgrads) = out, ref
  gerr = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for p, q in zip(grads, rgrads)
    for a, b in zip(p, q)
  )
  gscale = max(float(np.max(np.abs(np.asarray(b)))) for q in rgrads for b in q)
  lerr = abs(float(loss) - float(rloss))
  return {
    "loss": float(loss),
    "loss_abs_err": lerr,
    "grad_max_abs_err": gerr,
    "grad_rel_err": gerr / gscale,
    "ok": bool(lerr <= 1e-5 * abs(float(rloss)) + 1e-6 and gerr <= 1e-4 * gscale),
  }


def warm_up(variants, per_stage, base) -> tuple[dict, list[Variant]]:
  """Compile every variant with one call, check it, and drop the ones that fail."""
  ref, ms = timed(base.step)
  base.compile_s = ms / 1e3
  checks = {"unpipelined_loss": float(ref[0])}
  kept = []
  for v, per in zip(variants, per_stage):
    key = f"{v.schedule}/m={v.microbatches}"
    try:
      out, ms = timed(v.step)
    except Exception as e:  # noqa: BLE001 - report the schedule as not runnable, go on
      checks[key] = {"error": f"{type(e).__name__}: {e}"[:400]}
      print(f"  {key:34s} ERROR {checks[key]['error']}", flush=True)
      continue
    v.compile_s = ms / 1e3
    checks[key] = compare((out[0], grads_by_block(out[1], per)), ref)
    c = checks[key]
    print(
      f"  {key:34s} compile {v.compile_s:6.1f} s  loss {c['loss']:.7f}  "
      f"|dloss| {c['loss_abs_err']:.1e}  grad rel err {c['grad_rel_err']:.1e}  "
      f"{'ok' if c['ok'] else 'MISMATCH'}",
      flush=True,
    )
    kept.append(v)
  return checks, kept


def time_rounds(variants, rounds: int) -> None:
  """Alternate all variants each round (rotating the start) so drift hits all alike."""
  for r in range(rounds):
    for i in range(len(variants)):
      v = variants[(i + r) % len(variants)]
      _, ms = timed(v.step)
      v.times_ms.append(ms)
    print(f"  round {r + 1}/{rounds} done", flush=True)


def build(args, weights, x, y):
  devices = jax.devices()[:STAGES]
  mesh = MpMdMesh(Mesh(devices, ("pp",)), "pp")
  variants, per_stage = [], []
  for m in args.microbatches:
    for name in args.schedules:
      v, per = (
        spmd_variant(m, weights, x, y, devices)
        if name == SPMD
        else mpmd_variant(name, m, weights, x, y, devices, mesh)
      )
      variants.append(v)
      per_stage.append(per)
  return variants, per_stage, baseline_variant(weights, x, y, devices[0])


def report(variants, base, checks, args) -> dict:
  base_ms = statistics.median(base.times_ms)
  rows = [
    {
      "schedule": v.schedule,
      "microbatches": v.microbatches,
      "runtime": "spmd" if v.schedule == SPMD else "mpmd",
      "virtual_stages": v.virtual_stages,
      "ms": statistics.median(v.times_ms),
      "ms_all": v.times_ms,
      "compile_s": v.compile_s,
      "unpipelined_ms": base_ms,
    }
    for v in variants
  ]
  dev = jax.devices()
  return {
    "jax": jax.__version__,
    "spectrax": spx.__version__,
    "device": f"{len(dev)} forced host {dev[0].platform} devices ({os.cpu_count()} cores shared)",
    "config": {
      "blocks": BLOCKS,
      "stages": STAGES,
      "d": args.d,
      "hidden": args.hidden,
      "batch": args.batch,
      "rounds": args.rounds,
      "dtype": "float32",
    },
    "unpipelined_ms": base_ms,
    "unpipelined_ms_all": base.times_ms,
    "rows": rows,
    "checks": checks,
  }


def print_table(res) -> None:
  print(f"\njax {res['jax']}, spectrax {res['spectrax']}, {res['device']}")
  print(f"unpipelined jit(value_and_grad): {res['unpipelined_ms']:.1f} ms")
  print(f"{'schedule':24s} {'m':>3s} {'V':>2s} {'ms':>8s} {'x unpipelined':>14s}")
  for r in res["rows"]:
    print(
      f"{r['schedule']:24s} {r['microbatches']:3d} {r['virtual_stages']:2d} "
      f"{r['ms']:8.1f} {r['ms'] / r['unpipelined_ms']:14.2f}"
    )


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--out", default=None, help="write the JSON result here")
  p.add_argument(
    "--schedules",
    nargs="+",
    default=[*SCHEDULES, SPMD],
    help="subset to run (default: all SpectraX schedules + SPMD pipeline_step)",
  )
  # Smaller shapes only for quick development runs; the comparison uses the defaults.
  p.add_argument("--d", type=int, default=256)
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--batch", type=int, default=256)
  args = p.parse_args(argv)

  weights, x, y = init_data(args.d, args.hidden, args.batch)
  variants, per_stage, base = build(args, weights, x, y)
  print("warm-up (compile) and check against the unpipelined loss/grads:", flush=True)
  checks, variants = warm_up(variants, per_stage, base)
  print(f"timing {args.rounds} rounds of {len(variants) + 1} variants:", flush=True)
  time_rounds([base, *variants], args.rounds)
  res = report(variants, base, checks, args)
  print_table(res)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(res, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
