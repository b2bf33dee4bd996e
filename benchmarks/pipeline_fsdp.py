"""FSDP within pipeline stages: compiled memory per device, compile-only H100 x8.

  python -m benchmarks.pipeline_fsdp                    # dims 256, 1024 and 65536
  python -m benchmarks.pipeline_fsdp --dims 64 --write  # append the table to RESULTS.md

A (2 data x 4 stage) mesh of compile-only H100s with Explicit axes, 8 tanh
layers of `dim x dim` float32 kernels each split over the data axis
(`P(None, "data")`), 1F1B over 4 microbatches, the automatic
`ooo.pipeline.value_and_grad` jitted: XLA's `memory_analysis()` of the compiled
step for `fsdp="regather"` (each action gathers its chunk's split weights, each
W reduce-scatters their gradient), `fsdp="keep"` (every stage's weights
gathered before the tick loop) and `fsdp="auto"` (the default: keep unless a
device's stages gathered are over a quarter of its memory; at dim 65536 a
stage's two kernels are 34 GB), for `value_and_grad` and for `make_train_step`
(Adam; its state holds the kernels split in every mode). Nothing runs:
compile-only, no GPU needed (the CUDA plugin, `ooojax.gpu_hlo`).
"""

from __future__ import annotations

import argparse
import os
import re

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


_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}
_REDUCE = re.compile(r" = (.*?) (all-reduce|reduce-scatter)(-start)?\(")


def _bytes(types: str) -> int:
  """The bytes of the arrays an HLO type names ("(f32[2,8]{1,0}, f32[])")."""
  total = 0
  for t, dims in re.findall(r"\b(f32|bf16|f16|s32)\[([\d,]*)\]", types):
    n = _BYTES[t]
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n
  return total


def _data(m) -> int:
  """The bytes an all-reduce or reduce-scatter reduces (its operands)."""
  types = m.group(1)
  if m.group(3):  # async start: ((operands), results)
    return _bytes(types[1 : types.index(")")])
  return _bytes(types) * (2 if m.group(2) == "reduce-scatter" else 1)  # 2 replicas


def reductions(text: str) -> tuple[int, int, float]:
  """(all-reduces of arrays, reduce-scatters, bytes a device sends for them outside
  the tick loop) in a compiled program's text, 2 data replicas, ring: an all-reduce
  sends its bytes, a reduce-scatter half; the loss's scalar all-reduce left out."""
  ar = rs = 0
  for m in map(_REDUCE.search, text.split("\n")):
    if m and _data(m) > 4:
      ar, rs = ar + (m.group(2) == "all-reduce"), rs + (m.group(2) == "reduce-scatter")
  entry = text[text.index("ENTRY") :]
  entry = entry[: entry.index("\n}")]
  sent = 0.0
  for m in map(_REDUCE.search, entry.split("\n")):
    if m and _data(m) > 4:
      sent += _data(m) / (1 if m.group(2) == "all-reduce" else 2)
  return ar, rs, sent


def measure(dim: int, layers: int = 8, rows: int = 16, train: bool = True) -> dict:
  """{(form, fsdp): (temp, argument, output bytes, all-gathers, reduce-scatters, mode run,
  all-reduces of arrays, bytes the reductions outside the tick loop send)} per device;
  form "value_and_grad" or "train step" (`make_train_step`, Adam)."""
  import optax

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
  kw = dict(mesh=g, axis_name="stage", data_axis="data", schedule="1f1b", microbatches=4)
  out = {}

  def row(c, mode):
    m, text = c.memory_analysis(), c.as_text()
    ar, rs, sent = reductions(text)
    return (
      m.temp_size_in_bytes,
      m.argument_size_in_bytes,
      m.output_size_in_bytes,
      text.count("all-gather-start(") + text.count(" all-gather("),
      rs,
      mode,
      ar,
      sent,
    )

  with jax.set_mesh(g):
    for fsdp in ("regather", "keep", "auto"):
      step = ooo.pipeline.value_and_grad(_loss, fsdp=fsdp, **kw)
      r = ooo.pipeline.explain(_loss, p, x, x, fsdp=fsdp, **kw)  # the mode it runs
      out["value_and_grad", fsdp] = row(jax.jit(step).lower(p, x, x).compile(), r.fsdp.mode)
    for fsdp in ("regather", "keep", "auto") if train else ():
      step = ooo.pipeline.make_train_step(_loss, optax.adam(1e-3), fsdp=fsdp, **kw)
      c = step.lower(step.abstract_state(p, x, x), x, x).compile()
      out["train step", fsdp] = row(c, step.fsdp_choice.mode)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dims", type=int, nargs="+", default=[256, 1024, 65536])
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
    "the automatic `value_and_grad` jitted, and `make_train_step` with Adam (its state "
    "the arguments); XLA's memory_analysis() per device (MB), and the all-gather / "
    "reduce-scatter / all-reduce (of arrays: the loss's scalar left out) instructions of "
    "the compiled program (not executions); `reduced MB`: what a device sends for the "
    "all-reduces and reduce-scatters outside the tick loop (ring over the 2 replicas: an "
    "all-reduce its bytes, a reduce-scatter half), regather's inside the loop not counted; "
    "nothing ran. `runs`: the mode each option compiled (`fsdp='auto'`: fsdp_mode's rule "
    "on an 80 GB H100).",
    "",
    "| dim | form | fsdp | runs | temporary | arguments | outputs | all-gather instr. "
    "| reduce-scatter instr. | all-reduce instr. | reduced MB | temp / keep |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for d in a.dims:
    r = measure(d)
    for (form, fsdp), (t, arg, o, ag, rs, mode, ar, sent) in r.items():
      lines.append(
        f"| {d} | {form} | {fsdp} | {mode} | {t / 1e6:.2f} | {arg / 1e6:.2f} | {o / 1e6:.2f} "
        f"| {ag} | {rs} | {ar} | {sent / 1e6:.2f} | {t / r[form, 'keep'][0]:.2f} |"
      )
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
