"""Data parallel inside a sharded jit (GSPMD): compiled H100 x8 schedules, and 2 CPU processes.

nanodo's train step (`tests/nanodo.py`: its model, loss closing over the batch,
`_train_step` under `jax.jit(in_shardings=..., out_shardings=...)`,
`optax.MultiSteps(adamw)`), with `jax.value_and_grad` as its authors write it
or `ooo.value_and_grad(mode="data_parallel")` swapped in, nothing else changed.

  python -m benchmarks.dp_gspmd --hlo          # compile-only H100 x8: collectives
  python -m benchmarks.dp_gspmd --mp           # 2 processes on CPU, alternating
  python -m benchmarks.dp_gspmd --mem          # compile-only H100 x8: FSDP temp memory
  python -m benchmarks.dp_gspmd --hlo --mp --write

`--hlo` compiles both steps for 8 compile-only H100s (no GPU runs) and counts
the async reductions, reduce-scatters and all-gathers, and the GEMMs XLA
scheduled inside each start..done window; with FSDP on, where the first
gradient reduce-scatter starts relative to the backward's last GEMM.
`--mem` compiles nanodo's FSDP step at `MEM_CFG` for 8 compile-only H100s
with `jax.value_and_grad`, ooojax's ZeRO-3 (`fsdp="regather"`, the default)
and `fsdp="keep"` (gathered once) and reads XLA's `memory_analysis()`.
`--mp` starts 2 processes (`jax.distributed` + gloo, one CPU device each, each
pinned to its own core) and times both steps, alternating, medians.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time

# nanodo-style sizes (D, H, L, N, V, F), global batch = 8 rows per device
HLO_CFG = dict(D=512, H=8, L=128, N=4, V=2048, F=2048)
MP_CFG = dict(D=128, H=4, L=64, N=2, V=512, F=512)
# FSDP memory (issue 49's size): 8 layers of D 2048, 1.6 GB of float32 parameters
MEM_CFG = dict(D=2048, H=16, L=128, N=8, V=2048, F=8192)


def _abstract_state(cfg, mesh):
  """nanodo's state as ShapeDtypeStructs with its shardings (nothing is allocated)."""
  import jax
  import jax.numpy as jnp
  from flax import linen as nn
  from flax.training.train_state import TrainState

  from tests import nanodo as nd

  module = nd.TransformerDo(cfg)

  def init(rng):
    p = module.init(rng, jnp.ones((1, cfg.L), jnp.int32))
    return TrainState.create(apply_fn=module.apply, params=p["params"], tx=nd.get_optimizer())

  abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
  shardings = nn.get_sharding(abstract, mesh)

  def put(s, a):
    if isinstance(a, nn.Partitioned):
      return a.replace_boxed(jax.ShapeDtypeStruct(a.value.shape, a.value.dtype, sharding=s))
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

  return shardings, jax.tree.map(
    put, shardings, abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned)
  )


def _h100_step(fsdp_enabled: bool, devices: int, sizes: dict, plain: bool, **ooo_options):
  """nanodo's train step on `devices` compile-only H100s, with abstract state and
  batch: `(step, state, batch, mesh)`. `plain`: `jax.value_and_grad`; else
  `ooo.value_and_grad(mode="data_parallel", **ooo_options)`."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  import ooojax as ooo
  from ooojax import gpu_hlo
  from tests import nanodo as nd

  cfg = nd.DoConfig(**sizes, fsdp_enabled=fsdp_enabled)
  mesh = gpu_hlo.mesh("H100", devices, ("data",))
  shardings, state = _abstract_state(cfg, mesh)
  batch = jax.ShapeDtypeStruct((8 * devices, cfg.L), jnp.int32, sharding=NamedSharding(mesh, P()))
  vg = (
    jax.value_and_grad
    if plain
    else functools.partial(
      ooo.value_and_grad, mode="data_parallel", ordering="none", device="H100", **ooo_options
    )
  )
  return nd.make_step(shardings, mesh, value_and_grad=vg), state, batch, mesh


def h100_counts(
  fsdp_enabled: bool,
  variant: str,
  devices: int = 8,
  sizes=None,
  compiler_options=None,
  **ooo_options,
) -> dict:
  """The compiled step's collectives on compile-only H100s (`variant`: "jax" or "ooo";
  `ooo_options` go to `ooo.value_and_grad`)."""
  from ooojax import gpu_hlo
  from ooojax.passes.hlo import schedule as hlo_schedule

  step, state, batch, mesh = _h100_step(
    fsdp_enabled, devices, sizes or HLO_CFG, variant == "jax", **ooo_options
  )
  t0 = time.perf_counter()
  c = gpu_hlo.compiled(step, state, batch, mesh=mesh, compiler_options=compiler_options)
  s = hlo_schedule.parse(c.as_text())
  seconds = time.perf_counter() - t0
  out = {"seconds": seconds, "temp": c.memory_analysis().temp_size_in_bytes}
  entry = [i.name for i in s.entry]
  gemms = [k for k, i in enumerate(s.entry) if i.is_heavy]
  for kind in ("all-reduce", "reduce-scatter", "all-gather"):
    pairs = [p for p in s.pairs_of(kind) if p.computation == s.entry_name]
    out[kind] = [len(p.overlapped_heavy) for p in pairs]
    out[kind + " sync"] = sum(p.sync for p in pairs)
    out[kind + " starts"] = [entry.index(p.start.name) for p in pairs]
    out[kind + " shapes"] = [p.start.shape for p in pairs]
    # ooojax's forward units are named ooo_F<i> (backward ones ooo_X<i>, ooo_W<i>)
    out[kind + " forward"] = [len(p.overlapped_heavy) for p in pairs if "/ooo_F" in p.start.op_name]
  out["last gemm"] = gemms[-1] if gemms else -1
  out["gemms"] = len(gemms)
  return out


def h100_memory(variant: str, devices: int = 8, sizes=None) -> dict:
  """FSDP step's compiled memory per device on compile-only H100s (`variant`: "jax",
  "regather" or "keep"), in bytes."""
  from ooojax import gpu_hlo

  plain = variant == "jax"
  opts = {} if plain else {"fsdp": variant}
  step, state, batch, mesh = _h100_step(True, devices, sizes or MEM_CFG, plain, **opts)
  m = gpu_hlo.compiled(step, state, batch, mesh=mesh).memory_analysis()
  return {"temp": m.temp_size_in_bytes, "arguments": m.argument_size_in_bytes}


def _mem_rows(args) -> list[str]:
  import jax

  cfg = ", ".join(f"{k}={v}" for k, v in MEM_CFG.items())
  lines = [
    f"nanodo FSDP ({cfg}, global batch {8 * args.devices}), compile-only H100 x{args.devices}, "
    f"jax {jax.__version__}, XLA's memory_analysis() per device (MB):",
    "",
    "| step | temporary | arguments (parameters and optimizer state) | temp / plain jit |",
    "|---|---|---|---|",
  ]
  got = {v: h100_memory(v, args.devices) for v in ("jax", "regather", "keep")}
  for v, name in (
    ("jax", "plain jit, jax.value_and_grad"),
    ("regather", "ooo data_parallel, fsdp='regather' (default)"),
    ("keep", "ooo data_parallel, fsdp='keep'"),
  ):
    m = got[v]
    lines.append(
      f"| {name} | {m['temp'] / 1e6:.1f} | {m['arguments'] / 1e6:.1f} | "
      f"{m['temp'] / got['jax']['temp']:.2f} |"
    )
  return lines


def _hlo_rows(args) -> list[str]:
  lines = [
    "| step | variant | async all-reduces (GEMMs in each window) | reduce-scatters "
    "(GEMMs in each) | all-gathers (GEMMs in each) | first reduce-scatter start / "
    "last GEMM (entry position) | compile s |",
    "|---|---|---|---|---|---|---|",
  ]
  for fsdp in (False, True):
    for variant in ("jax", "ooo"):
      c = h100_counts(fsdp, variant, args.devices)
      rs = c["reduce-scatter starts"]
      where = f"{min(rs)} / {c['last gemm']}" if rs else "-"
      show = lambda k, c=c: f"{len(c[k])}: {c[k]}" if c[k] else "0"
      lines.append(
        f"| {'FSDP' if fsdp else 'data parallel'} | "
        f"{'jax.value_and_grad' if variant == 'jax' else 'ooo data_parallel'} | "
        f"{show('all-reduce')} | {show('reduce-scatter')} | {show('all-gather')} | "
        f"{where} | {c['seconds']:.0f} |"
      )
      print(lines[-1], file=sys.stderr, flush=True)
  return lines


# --- 2 processes on CPU -----------------------------------------------------------
def worker(rank: int, port: int, rounds: int, warmup: int, out: str, fsdp: bool = False) -> None:
  """One of 2 processes: both steps, alternating, per-round seconds to `out` (each
  rank its own file: `out` + rank), with the compiled steps' temporary memory and the
  process's peak resident memory."""
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", 2, rank)
  import json

  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import ooojax as ooo
  from tests import nanodo as nd

  cfg = nd.DoConfig(**MP_CFG, fsdp_enabled=fsdp)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  shardings, state = nd.init_train_state(cfg, mesh)
  # nanodo's jit takes the batch replicated (in_shardings P()) and constrains it to P("data")
  full = np.random.default_rng(0).integers(1, cfg.V, (16, cfg.L)).astype(np.int32)
  batch = jax.make_array_from_process_local_data(NamedSharding(mesh, P()), full)
  steps = {
    "jax": nd.make_step(shardings, mesh),
    "ooo": nd.make_step(
      shardings, mesh, value_and_grad=functools.partial(ooo.value_and_grad, mode="data_parallel")
    ),
  }
  temp = {
    k: f.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    for k, f in steps.items()
  }
  times = {k: [] for k in steps}
  states = dict.fromkeys(steps, state)
  for r in range(warmup + rounds):
    for k in ("jax", "ooo") if r % 2 == 0 else ("ooo", "jax"):
      t0 = time.perf_counter()
      states[k], m = steps[k](states[k], batch)
      jax.block_until_ready((states[k], m))
      if r >= warmup:
        times[k].append(time.perf_counter() - t0)
  import resource

  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux: KiB)
  with open(f"{out}{rank}", "w") as f:
    json.dump({"times": times, "devices": jax.device_count(), "temp": temp, "peak": peak}, f)
  jax.distributed.shutdown()


def _mp_rows(args) -> list[str]:
  import json
  import socket

  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  out = tempfile.mktemp(suffix=".json")
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "",
    "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
  }
  cores = os.sched_getaffinity(0)
  procs = []
  for rank in range(2):
    cmd = [
      sys.executable,
      "-m",
      "benchmarks.dp_gspmd",
      "--worker",
      str(rank),
      str(port),
      str(args.rounds),
      str(args.warmup),
      out,
      str(int(args.fsdp)),
    ]
    if len(cores) >= 2:
      cmd = ["taskset", "-c", str(sorted(cores)[rank])] + cmd
    procs.append(subprocess.Popen(cmd, env=env))
  for p in procs:
    if p.wait() != 0:
      raise RuntimeError("a worker failed")
  res = []
  for rank in range(2):
    with open(f"{out}{rank}") as f:
      res.append(json.load(f))
    os.unlink(f"{out}{rank}")
  peaks = [r["peak"] / 1e6 for r in res]
  temp = {k: v / 1e6 for k, v in res[0]["temp"].items()}
  res = res[0]
  med = {k: statistics.median(v) * 1e3 for k, v in res["times"].items()}
  lo = {k: min(v) * 1e3 for k, v in res["times"].items()}
  hi = {k: max(v) * 1e3 for k, v in res["times"].items()}
  cfg = ", ".join(f"{k}={v}" for k, v in MP_CFG.items())
  lines = [
    f"nanodo ({cfg}, {'FSDP, ' if args.fsdp else ''}global batch 16), 2 processes x 1 CPU "
    "device, gloo, "
    f"{args.rounds} alternating rounds after {args.warmup} warm-up, per step (ms):",
    "",
    "| step | median | min | max | compiled temp (MB) |",
    "|---|---|---|---|---|",
  ]
  for k, name in (
    ("jax", "plain jit, jax.value_and_grad"),
    ("ooo", "jit, ooo.value_and_grad(mode='data_parallel')"),
  ):
    lines.append(f"| {name} | {med[k]:.1f} | {lo[k]:.1f} | {hi[k]:.1f} | {temp[k]:.2f} |")
  lines.append(f"\nratio (plain / ooo, medians): {med['jax'] / med['ooo']:.3f}")
  lines.append(
    "peak resident memory per process (both steps in it): "
    + ", ".join(f"{p:.0f} MB" for p in peaks)
  )
  return lines


def main(argv=None):
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.dp_gspmd",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("--hlo", action="store_true")
  ap.add_argument("--mp", action="store_true")
  ap.add_argument("--mem", action="store_true")
  ap.add_argument("--fsdp", action="store_true", help="--mp with nanodo's FSDP rules")
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--rounds", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--write", action="store_true")
  ap.add_argument("--worker", nargs=6, default=None, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.worker:
    rank, port, rounds, warmup, out, fsdp = a.worker
    worker(int(rank), int(port), int(rounds), int(warmup), out, bool(int(fsdp)))
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  from benchmarks import _report

  lines = _report.header("Data parallel inside a sharded jit (GSPMD), nanodo step")
  if a.hlo:
    lines += (
      [
        f"Compile-only H100 x{a.devices} (jax {jax.__version__}, no GPU ran), "
        "default compiler options:",
        "",
      ]
      + _hlo_rows(a)
      + [""]
    )
  if a.mem:
    lines += _mem_rows(a) + [""]
  if a.mp:
    lines += _mp_rows(a)
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
