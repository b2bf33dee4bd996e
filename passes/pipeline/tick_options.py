"""pipeline.tick_options: the environment's choices for the tick loop on a mesh.

Contract: `one_way(mesh)`, `every_tick_writes_records(mesh)`, `masked_rows(mesh)`
-> bool, `weight_slices(mesh)` -> str and `recompute_costs(platform)` -> `Costs`
or None, read when a step traces
(`passes.pipeline.execute`, `train`) and passed to `ticks.tick_loop`. Each has an `OOOJAX_*` variable whose `auto` (or default)
picks by the mesh's platform; a bad value is a `ValueError` naming the good ones.
"""

from __future__ import annotations

import os

__all__ = [
  "CPU_EXCHANGE",
  "RECOMPUTE",
  "RECORD_WRITES",
  "TICK_ROWS",
  "WEIGHT_SLICES",
  "every_tick_writes_records",
  "masked_rows",
  "one_way",
  "recompute_costs",
  "weight_slices",
]


CPU_EXCHANGE = "OOOJAX_CPU_EXCHANGE"


def one_way(mesh) -> bool:
  """Whether each exchange runs as one-way collective permutes (no device both
  sends and receives in one): on CPU (gloo), unless the environment variable
  `OOOJAX_CPU_EXCHANGE=two_way`. gloo's collective permute posts a device's
  send, then its receive, and waits for both; two processes that exchange in
  one permute took 1.4-3 ms for 16-32 kB under the kernel's fair scheduler,
  two one-way permutes in a row 0.08-0.11 ms (benchmarks/RESULTS.md, issue 34).
  Under a real-time scheduler (`chrt -f`) the two-way permute costs 0.03 ms,
  and on a full-duplex link it carries both directions at once: `two_way` is
  for that. NCCL pairs the send and receive in one group, so accelerators
  always keep one permute."""
  if mesh.devices.flat[0].platform != "cpu":
    return False
  mode = os.environ.get(CPU_EXCHANGE, "one_way")
  if mode not in ("one_way", "two_way"):
    raise ValueError(f"{CPU_EXCHANGE}={mode!r}: use one_way (the default) or two_way")
  return mode == "one_way"


RECORD_WRITES = "OOOJAX_RECORD_WRITES"


def every_tick_writes_records(mesh=None) -> bool:
  """Whether every tick writes its residual records, a tick that produces none
  into a trash slot (`always`), instead of under a `cond` (`cond`).
  `OOOJAX_RECORD_WRITES=auto` (the default): `always` on a GPU `mesh`, `cond` on
  CPU (or without a mesh). XLA:GPU runs a conditional on the host (it copies
  the branch index back and waits for the device): on one H200 (jax 0.11.2,
  1F1B, m = 8) the executor took 1.89x the accumulated step with the two
  record conds and 1.55x without them (benchmarks/RESULTS.md, "The second GPU
  run"). On CPU a conditional is a branch and the unconditional write a
  memcpy of a record per tick, so CPU keeps the conds."""
  mode = os.environ.get(RECORD_WRITES, "auto")
  if mode not in ("auto", "cond", "always"):
    raise ValueError(f"{RECORD_WRITES}={mode!r}: use auto (the default), cond or always")
  if mode == "auto":
    return mesh is not None and mesh.devices.flat[0].platform != "cpu"
  return mode == "always"


TICK_ROWS = "OOOJAX_TICK_ROWS"


def masked_rows(mesh) -> bool:
  """Whether each tick reads its row of the table as a masked sum (`_row`):
  `OOOJAX_TICK_ROWS=auto` (the default) on a GPU mesh, so that XLA can capture
  the tick loop whole in a CUDA graph; on CPU the scan slices the rows
  (`slice`). `masked` / `slice` force one."""
  mode = os.environ.get(TICK_ROWS, "auto")
  if mode not in ("auto", "masked", "slice"):
    raise ValueError(f"{TICK_ROWS}={mode!r}: use auto (the default), masked or slice")
  if mode == "auto":
    return mesh.devices.flat[0].platform != "cpu"
  return mode == "masked"


WEIGHT_SLICES = "OOOJAX_WEIGHT_SLICES"


def weight_slices(mesh) -> str:
  """How a tick reads the layers its stage slices out of a stacked weight
  (`p["w1"][j]`; `passes.pipeline.weight_slices`): `static` (a slice in every
  F, B and W that reads it), `dynamic` (a dynamic slice XLA:GPU fuses into the
  GEMM) or `hoist` (once before the ticks, a copy of the weights in temporary
  memory; one-step tables without FSDP, else `static`).
  `OOOJAX_WEIGHT_SLICES=auto` (the default): `dynamic` on a GPU mesh, where
  each static slice before a Triton GEMM is a copy kernel (31 a microbatch on
  one stage, against the accumulated scan's 16; benchmarks/RESULTS.md, issue
  48); `static` on CPU (the loop as it was)."""
  mode = os.environ.get(WEIGHT_SLICES, "auto")
  if mode not in ("auto", "static", "dynamic", "hoist"):
    raise ValueError(f"{WEIGHT_SLICES}={mode!r}: use auto (the default), static, dynamic or hoist")
  if mode == "auto":
    return "static" if mesh.devices.flat[0].platform == "cpu" else "dynamic"
  return mode


RECOMPUTE = "OOOJAX_RECOMPUTE"


def recompute_costs(platform: str):
  """What B and W recompute of F's values instead of reading them from the
  records (`passes.pipeline.recompute`), as its `Costs`: `fused` (a GPU's
  default: cheap elementwise and row-reduction chains, transcendentals too,
  which XLA:GPU fuses into B's kernels), `arith` (CPU's default: flops cost more
  there, so tanh and exp are mostly saved) or `off` (None: F saves every value
  B and W read, as before). `OOOJAX_RECOMPUTE=auto` (the default) picks by
  `platform`."""
  from ooojax.passes.pipeline import recompute

  mode = os.environ.get(RECOMPUTE, "auto")
  if mode not in ("auto", "fused", "arith", "off"):
    raise ValueError(f"{RECOMPUTE}={mode!r}: use auto (the default), fused, arith or off")
  if mode == "auto":
    mode = "arith" if platform == "cpu" else "fused"
  return {"fused": recompute.GPU, "arith": recompute.CPU, "off": None}[mode]
