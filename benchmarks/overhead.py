"""Frontend overhead: trace + split + schedule + lower of ooo.grad vs jax.grad.

Both are lowered (not compiled) under jax.jit, alternating in one process,
fresh function objects each time so no trace cache is hit. Prints a markdown
table; `--write` appends it to benchmarks/RESULTS.md.

  python -m benchmarks.overhead [--depths 26 50 101] [--reps 3] [--write]
  python -m benchmarks.overhead --lm 12 48 --depths --reps 16   # GPT-2-small-width LM only

`--lm` lowers a GPT-style flax LM (d 768, 12 heads, vocab 50257, seq 128,
batch 8) with `value_and_grad` against `jax.value_and_grad` on abstract
arguments (no parameters are allocated), and also reports the peak Python-heap
memory (tracemalloc) of one lowering. Its rounds sweep the caller's offset on
CPython's data stack (`benchmarks/_cpu.py`), so use at least 8 of them.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

import jax
import numpy as np

import ooojax as ooo
from benchmarks import _cpu, _report
from ooojax.models import resnet


def _lowering(make_grad, loss_fn, args):
  """A thunk lowering `make_grad` of a fresh copy of loss_fn (no trace cache
  shared across lowerings), after collecting the previous lowering's garbage."""
  fresh = lambda *a: loss_fn(*a)  # noqa: E731
  gc.collect()  # each lowering pays for its own garbage, not the previous one's
  return lambda: jax.jit(make_grad(fresh)).lower(*args)


def _lower_time(make_grad, loss_fn, args, clock=time.perf_counter) -> float:
  lower = _lowering(make_grad, loss_fn, args)
  t0 = clock()
  lower()
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
  return dict(
    depth=depth,
    mode=mode,
    eqns=n_eqns,
    base=float(np.median(tb)),
    ours=float(np.median(to)),
    plan=t_plan,
  )


def _peak_lower_mb(make_grad, loss_fn, args) -> float:
  """Peak Python-heap memory (tracemalloc, MB) while lowering once: jaxprs, tracers, MLIR objects' Python side."""
  lower = _lowering(make_grad, loss_fn, args)
  tracemalloc.start()
  try:
    lowered = lower()
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  del lowered
  return peak / 2**20


def _lm(layers: int, modes):
  """(loss_fn, abstract args, {name: make_grad}) for the GPT-style LM, caches warmed."""
  import optax

  from ooojax.models.transformer import Stack

  model = Stack(layers, 768, 12, 50257, causal=True)
  tokens = jax.ShapeDtypeStruct((8, 128), np.int32)
  params = jax.eval_shape(
    lambda: model.init(jax.random.PRNGKey(0), jax.numpy.zeros((8, 128), np.int32), train=False)
  )
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
      impls[m] = _in_shard_map(
        lambda f: _pmean_value(
          ooo.value_and_grad(f, mode="data_parallel", axis_name="d", device="H100")
        )
      )
    else:
      impls[m] = lambda f, m=m: ooo.value_and_grad(f, mode=m, device="H100")
  for mk in impls.values():  # warm caches of jnp / flax internals
    _lower_time(mk, loss_fn, args)
  return loss_fn, args, impls


def measure_lm(layers: int, reps: int, modes) -> list[dict]:
  loss_fn, args, impls = _lm(layers, modes)
  base_of = lambda m: "jax_dp" if m == "data_parallel" else "jax"  # noqa: E731
  # Every round lowers at its own offset on CPython's data stack, both sides of
  # a pair at the same one, the offsets spread over one chunk (benchmarks/_cpu.py:
  # over offsets, a 48-layer lowering's system time ranged 0 to 1.1 s by where
  # its hot calls fell, whichever function was lowered).
  grid = _cpu.offset_grid(reps)
  rng = np.random.default_rng(0)
  offsets = [grid[i] for i in rng.permutation(reps)]
  cost: dict = {m: ([], []) for m in modes}  # mode -> (its baseline's CpuTimes, its own)
  for r, slots in enumerate(offsets):
    # Each mode right beside its own baseline, the pair's order alternating
    # round to round and the modes' order shuffled: the host's slow stretches
    # and one lowering's effect on the next (caches, heap) fall on both sides.
    for m in rng.permutation(list(modes)):
      pair = (base_of(m), m) if r % 2 == 0 else (m, base_of(m))
      t = {k: _lower_cpu(impls[k], loss_fn, args, slots) for k in pair}
      cost[m][0].append(t[base_of(m)])
      cost[m][1].append(t[m])
  mem = {k: _peak_lower_mb(mk, loss_fn, args) for k, mk in impls.items()}
  vg = ooo.value_and_grad(loss_fn, mode="in_order", device="H100")
  cell = {}

  def count(*a):  # under a trace: the arguments are abstract
    cell["n"] = len(vg.plan(a, {})[0].split.jaxpr.jaxpr.eqns)
    return 0

  jax.jit(count).trace(*args)
  return [
    dict(
      layers=layers,
      mode=m,
      eqns=cell["n"],
      mem_base=mem[base_of(m)],
      mem_ours=mem[m],
      **_summary(*cost[m], rng),
    )
    for m in modes
  ]


def _lower_cpu(make_grad, loss_fn, args, slots: int) -> _cpu.CpuTimes:
  """User and system CPU time of one `jax.jit(...).lower`, called `slots` deeper on the data stack."""
  lower = _lowering(make_grad, loss_fn, args)
  return _cpu.at_stack_offset(slots, lambda: _cpu.cpu_times(lower)[1])


def _summary(base: list, ours: list, rng) -> dict:
  """Means over the offsets (CPU = user + system), the mean's ratio with a 90%
  bootstrap interval over rounds, and the paired user-time ratios' quartiles."""
  tb = np.array([c.total for c in base])
  to = np.array([c.total for c in ours])
  boot = rng.integers(0, len(tb), size=(2000, len(tb)))
  ratios = to[boot].mean(axis=1) / tb[boot].mean(axis=1)
  user = np.array([o.user / b.user for b, o in zip(base, ours)])
  return dict(
    base=float(tb.mean()),
    ours=float(to.mean()),
    ratio=float(to.mean() / tb.mean()),
    lo=float(np.percentile(ratios, 5)),
    hi=float(np.percentile(ratios, 95)),
    user=float(np.median(user)),
    user_q1=float(np.percentile(user, 25)),
    user_q3=float(np.percentile(user, 75)),
    sys_base=float(np.mean([c.sys for c in base])),
    sys_ours=float(np.mean([c.sys for c in ours])),
  )


def sweep_lm(layers: int, modes, n: int) -> list[str]:
  """One lowering of each function at each of n offsets over a data-stack chunk:
  the evidence that the offset, not the function, moves the system time."""
  loss_fn, args, impls = _lm(layers, modes)
  lines = [
    "| stack offset (slots) | " + " | ".join(f"{k}: user / sys s, faults" for k in impls) + " |",
    "|---" * (len(impls) + 1) + "|",
  ]
  for slots in _cpu.offset_grid(n):
    cells = []
    for mk in impls.values():
      c = _lower_cpu(mk, loss_fn, args, slots)
      cells.append(f"{c.user:.2f} / {c.sys:.2f}, {c.faults}")
    lines.append(f"| {slots} | " + " | ".join(cells) + " |")
    print(lines[-1], flush=True)
  return lines


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
  ap.add_argument(
    "--reps",
    type=int,
    default=None,
    help="rounds (default 3 for ResNet, 16 for --lm: one per stack offset)",
  )
  ap.add_argument("--modes", nargs="+", default=["single_gpu", "in_order"])
  ap.add_argument(
    "--stack-sweep",
    type=int,
    metavar="N",
    default=0,
    help="with --lm: lower each function once at each of N stack offsets and "
    "print user / system time and page faults per offset",
  )
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  if a.stack_sweep:
    for n in a.lm:
      lines = _report.header(f"Lowering CPU time by stack offset, GPT {n} layers") + [
        "One `jax.jit(...).lower` of each function per offset (pointer-sized slots added "
        "below the caller, `benchmarks/_cpu.py`), in one process, in this order; faults = "
        "minor page faults during the lowering.",
        "",
      ]
      _report.emit(lines + sweep_lm(n, a.modes, a.stack_sweep), a.write)
    return
  lines = _report.header("Frontend overhead")
  if a.depths:
    rows = [measure(d, a.reps or 3, m) for d in a.depths for m in a.modes]
    lines += [
      "Lower time (trace + split + schedule + emit + MLIR) under `jax.jit(...).lower`, "
      f"ResNet at batch 2, 64x64 images, median of {a.reps or 3}, alternating in one process.",
      "",
      "| model | mode | jaxpr eqns | jax.grad lower s | ooo.grad lower s | ratio | split+schedule s | µs/eqn (ooo) |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
      lines.append(
        f"| ResNet-{r['depth']} | {r['mode']} | {r['eqns']} | {r['base']:.3f} | "
        f"{r['ours']:.3f} | {r['ours'] / r['base']:.2f}x | {r['plan']:.3f} | "
        f"{1e6 * r['ours'] / r['eqns']:.0f} |"
      )
    lines.append("")
  if a.lm:
    a.reps = a.reps or 16
    rows = [r for n in a.lm for r in measure_lm(n, a.reps, a.modes)]
    lines += [
      "CPU time (user + system, this process) of `jax.jit(...).lower` of `value_and_grad` on abstract arguments, "
      "GPT-style flax LM (d 768, 12 heads, vocab 50257, seq 128, batch 8), "
      f"{a.reps} rounds in one process, each mode lowered right beside its baseline (the pair's "
      "order alternating by round, the modes' order shuffled), each round at its own offset on "
      f"CPython's data stack (a grid of {a.reps} over one 16 KiB chunk, both sides of a pair at the same "
      'offset: `benchmarks/_cpu.py` says why). "CPU s" = mean over the rounds; "overhead" = ratio of '
      'those means, with a 90% bootstrap interval over rounds; "user" = median of the pairs\' user-time '
      'ratios (quartiles), which the stack offset does not move; "sys s" = mean system time (data-stack '
      "page faults, mostly); peak memory = Python-heap peak (tracemalloc) of one more lowering. "
      "data_parallel: both sides under `jax.shard_map` on a 1-device mesh, batch split over its axis, "
      "parameters replicated, vma checked; the baseline `pmean(jax.value_and_grad)`.",
      "",
      "| model | mode | jaxpr eqns | jax CPU s | ooo CPU s | overhead (90% interval) | overhead, user (quartiles) | sys s jax / ooo | jax peak MB | ooo peak MB |",
      "|---|---|---|---|---|---|---|---|---|---|",
    ]
    pct = lambda x: f"{100 * (x - 1):+.0f}%"  # noqa: E731
    for r in rows:
      lines.append(
        f"| GPT {r['layers']} layers | {r['mode']} | {r['eqns']} | {r['base']:.3f} | "
        f"{r['ours']:.3f} | {pct(r['ratio'])} ({pct(r['lo'])}..{pct(r['hi'])}) | "
        f"{pct(r['user'])} ({pct(r['user_q1'])}..{pct(r['user_q3'])}) | "
        f"{r['sys_base']:.2f} / {r['sys_ours']:.2f} | "
        f"{r['mem_base']:.0f} | {r['mem_ours']:.0f} ({pct(r['mem_ours'] / r['mem_base'])}) |"
      )
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
