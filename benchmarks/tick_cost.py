"""What one pipeline tick's branching costs on this device: a `lax.scan` of
`--ticks` ticks, each picking one of `--branches` small GEMM actions by a
per-tick index, lowered four ways and timed alternating in one process:

- `plain`: the picked action alone, no branching (the work a tick must do);
- `cond`: a `lax.switch` (XLA:GPU's conditional copies the index to the host
  and waits for the device, every tick);
- `select`: every action runs, the picked one kept by `lax.select_n` (the
  executor's `select` ticks: no conditional, `branches` x the work);
- `cond (command buffer)`: the switch compiled with CUDA-graph conditionals
  (`xla_gpu_enable_command_buffer` with CONDITIONAL and WHILE), which branch on
  the device where the driver allows it (CUDA >= 12.3).

(variant - plain) / ticks is the per-tick price of each way of branching; the
executor's `select` lowering pays off where `select`'s is below `cond`'s
(`passes.pipeline.lowering`, `HOST_SYNC`).

  python -m benchmarks.tick_cost                   # this device
  python -m benchmarks.tick_cost --dims 64 512     # several action sizes
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import _report

COMMAND_BUFFER = {
  "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CONDITIONAL,WHILE",
  "xla_gpu_graph_min_graph_size": 1,
}


def variants(ticks: int, branches: int, dim: int, batch: int):
  """{name: (fn, args, compiler_options)}: the tick loops of the module doc."""
  ks = jax.random.split(jax.random.key(0), 3)
  ws = jax.random.normal(ks[0], (branches, dim, dim), jnp.float32) / np.sqrt(dim)
  x = jax.random.normal(ks[1], (batch, dim), jnp.float32)
  idx = jax.random.randint(ks[2], (ticks,), 0, branches)
  acts = [lambda h, w, k=k: jnp.tanh(h @ w[k]) for k in range(branches)]

  def loop(tick):
    def f(x, ws, idx):
      return lax.scan(lambda h, i: (tick(h, ws, i), None), x, idx)[0]

    return f

  plain = loop(lambda h, w, i: jnp.tanh(h @ lax.dynamic_index_in_dim(w, i, keepdims=False)))
  cond = loop(lambda h, w, i: lax.switch(i, acts, h, w))
  select = loop(lambda h, w, i: lax.select_n(i, *[a(h, w) for a in acts]))
  args = (x, ws, idx)
  return {
    "plain": (plain, args, {}),
    "cond": (cond, args, {}),
    "select": (select, args, {}),
    "cond (command buffer)": (cond, args, COMMAND_BUFFER),
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--ticks", type=int, default=256)
  ap.add_argument("--branches", type=int, default=6)
  ap.add_argument("--dims", type=int, nargs="+", default=[64, 256, 1024])
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  fns, conds = {}, {}
  for d in a.dims:
    for name, (f, args, opts) in variants(a.ticks, a.branches, d, a.batch).items():
      key = f"{name} / D={d}"
      try:
        exe = jax.jit(f).lower(*args).compile(compiler_options=opts)
      except Exception as e:  # noqa: BLE001 - an option this backend lacks: a result
        print(f"{key}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        continue
      fns[key] = lambda exe=exe, args=args: exe(*args)
      conds[key] = exe.as_text().count(" conditional(")
  times, failed = _report.compile_then_alternate(fns, (), a.rounds, a.iters)
  lines = _report.header("One tick's branching on one device (benchmarks/tick_cost.py)")
  lines += [
    f"Device: {jax.devices()[0].device_kind}. A scan of {a.ticks} ticks, each one of "
    f"{a.branches} actions tanh(h W_k) (batch {a.batch}, float32), picked per tick. "
    f"Median of {a.rounds} rounds x {a.iters} calls, alternating; per tick: (variant - "
    "plain) / ticks.",
    "",
    "| variant | ms (median) | us per tick over plain | conditionals |",
    "|---|---|---|---|",
  ]
  for key in conds:
    if key not in times:
      lines.append(f"| {key} | {failed.get(key, '-')} | | {conds[key]} |")
      continue
    t = np.median(times[key])
    base = times.get("plain / D=" + key.split("D=")[1])
    over = f"{(t - np.median(base)) / a.ticks * 1e6:.2f}" if base else ""
    lines.append(f"| {key} | {t * 1e3:.3f} | {over} | {conds[key]} |")
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
