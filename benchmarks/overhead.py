"""Frontend overhead: trace + split + schedule + lower of ooo.grad vs jax.grad.

Both are lowered (not compiled) under jax.jit, alternating in one process,
fresh function objects each time so no trace cache is hit. Prints a markdown
table; `--write` appends it to benchmarks/RESULTS.md.

  python -m benchmarks.overhead [--depths 26 50 101] [--reps 3] [--write]
  python -m benchmarks.overhead --lm 12 48 --depths     # GPT-2-small-width LM only

`--lm` lowers a GPT-style flax LM (d 768, 12 heads, vocab 50257, seq 128,
batch 8) with `value_and_grad` against `jax.value_and_grad` on abstract
arguments (no parameters are allocated), and also reports the peak Python-heap
memory (tracemalloc) of one lowering.
"""
from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

import jax
import numpy as np

import ooojax as ooo
from benchmarks import _report
from benchmarks.models import resnet


def _lower_time(make_grad, loss_fn, args, clock=time.perf_counter) -> float:
  fresh = lambda *a: loss_fn(*a)  # new identity: no cache shared across reps
  gc.collect()  # each lowering pays for its own garbage, not the previous one's
  t0 = clock()
  jax.jit(make_grad(fresh)).lower(*args)
  return clock() - t0


def measure(depth: int, reps: int, mode: str) -> dict:
  loss_fn, args, _ = resnet.make(depth, batch=2, image=64, real_init=False)
  base = lambda f: jax.grad(f, has_aux=True)
  ours = lambda f: ooo.grad(f, has_aux=True, mode=mode, device="H100")
  _lower_time(base, loss_fn, args)  # warm caches of jnp / flax internals
  _lower_time(ours, loss_fn, args)
  tb, to = [], []
  for _ in range(reps):
    tb.append(_lower_time(base, loss_fn, args))
    to.append(_lower_time(ours, loss_fn, args))
  vg = ooo.value_and_grad(loss_fn, has_aux=True, mode=mode, device="H100")
  t0 = time.perf_counter()
  plan, _ = vg.plan(args, {})
  t_plan = time.perf_counter() - t0
  n_eqns = len(plan.split.jaxpr.jaxpr.eqns)
  return dict(depth=depth, mode=mode, eqns=n_eqns, base=float(np.median(tb)),
              ours=float(np.median(to)), plan=t_plan)


def _peak_lower_mb(make_grad, loss_fn, args) -> float:
  """Peak Python-heap memory (tracemalloc, MB) while lowering once: jaxprs, tracers, MLIR objects' Python side."""
  gc.collect()
  fresh = lambda *a: loss_fn(*a)
  tracemalloc.start()
  try:
    lowered = jax.jit(make_grad(fresh)).lower(*args)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  del lowered
  return peak / 2**20


def measure_lm(layers: int, reps: int, modes) -> list[dict]:
  from benchmarks.models.transformer import Stack
  import optax
  model = Stack(layers, 768, 12, 50257, causal=True)
  tokens = jax.ShapeDtypeStruct((8, 128), np.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                             jax.numpy.zeros((8, 128), np.int32),
                                             train=False))
  rng = jax.eval_shape(lambda: jax.random.PRNGKey(2))
  args = (params, tokens, rng)

  def loss_fn(params, tokens, rng):
    logits = model.apply(params, tokens, rngs={"dropout": rng})[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  base = lambda f: jax.value_and_grad(f)
  impls = {"jax": base}
  for m in modes:
    if m == "data_parallel":  # both inside shard_map over a 1-device mesh, vma checked
      impls["jax_dp"] = _in_shard_map(lambda f: _pmean_of(jax.value_and_grad(f)))
      impls[m] = _in_shard_map(lambda f: _pmean_value(ooo.value_and_grad(
          f, mode="data_parallel", axis_name="d", device="H100")))
    else:
      impls[m] = lambda f, m=m: ooo.value_and_grad(f, mode=m, device="H100")
  for mk in impls.values():  # warm caches of jnp / flax internals
    _lower_time(mk, loss_fn, args)
  base_of = lambda m: "jax_dp" if m == "data_parallel" else "jax"  # noqa: E731
  times: dict = {m: ([], []) for m in modes}  # mode -> (its baseline's, its own)
  ratios: dict = {m: [] for m in modes}
  rng = np.random.default_rng(0)
  for r in range(reps):
    # Each mode right beside its own baseline, the pair's order alternating
    # round to round and the modes' order shuffled: the host's slow stretches
    # and one lowering's effect on the next (caches, heap) fall on both sides.
    for m in rng.permutation(list(modes)):
      pair = (base_of(m), m) if r % 2 == 0 else (m, base_of(m))
      # CPU time of this process: lowering is single-threaded Python, and on a
      # shared machine wall time mostly measures the neighbours.
      t = {k: _lower_time(impls[k], loss_fn, args, clock=time.process_time) for k in pair}
      times[m][0].append(t[base_of(m)])
      times[m][1].append(t[m])
      ratios[m].append(t[m] / t[base_of(m)])
  mem = {k: _peak_lower_mb(mk, loss_fn, args) for k, mk in impls.items()}
  vg = ooo.value_and_grad(loss_fn, mode="in_order", device="H100")
  cell = {}

  def count(*a):  # under a trace: the arguments are abstract
    cell["n"] = len(vg.plan(a, {})[0].split.jaxpr.jaxpr.eqns)
    return 0
  jax.jit(count).trace(*args)
  n_eqns = cell["n"]
  # min: contention from other processes only ever adds time (CPU time too, via
  # caches), over the same number of lowerings on each side; paired: the
  # median of the back-to-back pairs' ratios
  return [dict(layers=layers, mode=m, eqns=n_eqns, base=float(np.min(times[m][0])),
               ours=float(np.min(times[m][1])), paired=float(np.median(ratios[m])),
               q1=float(np.percentile(ratios[m], 25)), q3=float(np.percentile(ratios[m], 75)),
               mem_base=mem[base_of(m)], mem_ours=mem[m])
          for m in modes]


def _pmean_of(vg):
  return lambda *a: jax.lax.pmean(vg(*a), "d")


def _pmean_value(vg):  # ooo's gradient is already the mean; the value is per device
  def f(*a):
    v, g = vg(*a)
    return jax.lax.pmean(v, "d"), g
  return f


def _in_shard_map(make_grad):
  """`make_grad(f)(params, tokens, rng)` per device under shard_map on a 1-device mesh.

  The batch (tokens) is split over the axis "d", the parameters replicated:
  data parallelism, whose gradient program varies over "d".
  """
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:1]), ("d",))

  def make(f):
    return jax.shard_map(make_grad(f), mesh=mesh, in_specs=(P(), P("d"), P()), out_specs=P())
  return make


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--depths", type=int, nargs="*", default=[26, 50, 101])
  ap.add_argument("--lm", type=int, nargs="*", default=[], help="LM layer counts, e.g. 12 48")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--modes", nargs="+", default=["single_gpu", "in_order"])
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  lines = _report.header("Frontend overhead")
  if a.depths:
    rows = [measure(d, a.reps, m) for d in a.depths for m in a.modes]
    lines += [
        "Lower time (trace + split + schedule + emit + MLIR) under `jax.jit(...).lower`, "
        f"ResNet at batch 2, 64x64 images, median of {a.reps}, alternating in one process.",
        "",
        "| model | mode | jaxpr eqns | jax.grad lower s | ooo.grad lower s | ratio | split+schedule s | µs/eqn (ooo) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
      lines.append(f"| ResNet-{r['depth']} | {r['mode']} | {r['eqns']} | {r['base']:.3f} | "
                   f"{r['ours']:.3f} | {r['ours'] / r['base']:.2f}x | {r['plan']:.3f} | "
                   f"{1e6 * r['ours'] / r['eqns']:.0f} |")
    lines.append("")
  if a.lm:
    rows = [r for n in a.lm for r in measure_lm(n, a.reps, a.modes)]
    lines += [
        "Lower time (process CPU time) of `value_and_grad` under `jax.jit(...).lower` on abstract arguments, "
        "GPT-style flax LM (d 768, 12 heads, vocab 50257, seq 128, batch 8), "
        f"{a.reps} rounds in one process, each mode lowered right beside its baseline (the pair's "
        "order alternating by round, the modes' order shuffled); \"min\" = min over the rounds of each side of the pair, "
        "\"paired\" = median of the pairs' ooo / jax ratios (their quartiles in brackets: the host's noise); peak memory = Python-heap peak "
        "(tracemalloc) of one more lowering. data_parallel: both sides under `jax.shard_map` "
        "on a 1-device mesh, batch split over its axis, parameters replicated, vma checked; "
        "the baseline `pmean(jax.value_and_grad)`.",
        "",
        "| model | mode | jaxpr eqns | jax lower CPU s | ooo lower CPU s | overhead (min) | overhead (paired) | jax peak MB | ooo peak MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
      lines.append(f"| GPT {r['layers']} layers | {r['mode']} | {r['eqns']} | {r['base']:.3f} | "
                   f"{r['ours']:.3f} | {100 * (r['ours'] / r['base'] - 1):+.0f}% | "
                   f"{100 * (r['paired'] - 1):+.0f}% ({100 * (r['q1'] - 1):+.0f}..{100 * (r['q3'] - 1):+.0f}) | "
                   f"{r['mem_base']:.0f} | {r['mem_ours']:.0f} ({100 * (r['mem_ours'] / r['mem_base'] - 1):+.0f}%) |")
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
