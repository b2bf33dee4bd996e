"""FSDP within pipeline stages: compiled memory per device, compile-only H100 x8.

  python -m benchmarks.pipeline_fsdp                    # dims 256 and 1024
  python -m benchmarks.pipeline_fsdp --dims 64 --write  # append the table to RESULTS.md

A (2 data x 4 stage) mesh of compile-only H100s with Explicit axes, 8 tanh
layers of `dim x dim` float32 kernels each split over the data axis
(`P(None, "data")`), 1F1B over 4 microbatches, the automatic
`ooo.pipeline.value_and_grad` jitted: XLA's `memory_analysis()` of the compiled
step for `fsdp="regather"` (each action gathers its chunk's split weights, each
W reduce-scatters their gradient) and `fsdp="keep"` (every stage's weights
gathered before the tick loop). Nothing runs: compile-only, no GPU needed
(the CUDA plugin, `ooojax.gpu_hlo`).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs beside a CPU host

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks import _report  # noqa: E402


def _loss(p, x, y):
  for w in p["ws"]:
    s = jax.typeof(x).sharding
    x = jax.sharding.reshard(jnp.tanh(jnp.einsum("bd,de->be", x, w, out_sharding=s)), s)
  return jnp.mean((x - y) ** 2)


def measure(dim: int, layers: int = 8, rows: int = 16) -> dict:
  """{mode: (temp, argument, output bytes, all-gathers, reduce-scatters)} per device."""
  import ooojax as ooo
  from ooojax import gpu_hlo

  g = jax.sharding.Mesh(
    gpu_hlo.mesh("H100", (2, 4), ("data", "stage")).devices,
    ("data", "stage"),
    axis_types=(jax.sharding.AxisType.Explicit,) * 2,
  )

  def sds(shape, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(g, spec))

  p = {"ws": [sds((dim, dim), P(None, "data")) for _ in range(layers)]}
  x = sds((rows, dim), P("data"))
  out = {}
  with jax.set_mesh(g):
    for mode in ("regather", "keep"):
      step = ooo.pipeline.value_and_grad(
        _loss,
        mesh=g,
        axis_name="stage",
        data_axis="data",
        schedule="1f1b",
        microbatches=4,
        fsdp=mode,
      )
      c = jax.jit(step).lower(p, x, x).compile()
      m, text = c.memory_analysis(), c.as_text()
      out[mode] = (
        m.temp_size_in_bytes,
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        text.count("all-gather-start(") + text.count(" all-gather("),
        text.count("reduce-scatter("),
      )
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dims", type=int, nargs="+", default=[256, 1024])
  ap.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
  a = ap.parse_args(argv)
  from ooojax import gpu_hlo

  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    raise SystemExit(f"compile-only GPUs unavailable: {reason}")
  lines = _report.header("FSDP within pipeline stages, compiled memory (compile-only H100 x8)")
  lines += [
    "2 data x 4 stage, Explicit axes, 8 tanh layers (dim x dim float32, each split over "
    "'data'), 1F1B, a batch of 16 rows in 4 microbatches, each split over the 2 replicas; "
    "XLA's memory_analysis() per device (kB), and the all-gather / reduce-scatter "
    "instructions of the compiled program (not executions); nothing ran.",
    "",
    "| dim | fsdp | temporary | arguments | outputs | all-gather instr. | reduce-scatter instr. | temp / keep |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for d in a.dims:
    r = measure(d)
    for mode, (t, arg, o, ag, rs) in r.items():
      lines.append(
        f"| {d} | {mode} | {t / 1e3:.1f} | {arg / 1e3:.1f} | {o / 1e3:.1f} | {ag} | {rs} | "
        f"{t / r['keep'][0]:.2f} |"
      )
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
