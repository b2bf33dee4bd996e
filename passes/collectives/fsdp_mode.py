"""collectives.fsdp_mode: FSDP weights gathered once and kept, or gathered again in the backward.

Contract: `choose(fsdp, keep_bytes, n_devices, link, spec_name, gathers) -> FsdpChoice`.

With FSDP (parameters sharded over the data axis) ooojax either gathers each
weight once and keeps it for the step (`"keep"`: the whole model per device,
one all-gather of it per step) or gathers it where the forward reads it and
again where the backward does (`"regather"`, ZeRO-3: about two layers'
weights per device, but the whole model crosses the link twice). The second
gather is never free of cost on the link: replayed on compiled H100 programs
(issue 53, nanodo D 2048 x8 FSDP) regather took 9.68 ms against 6.89 for keep
on NVLink and 63.8 against 40.4 on IB 400, for 638 against 1422 MB of temp.

`fsdp="auto"` (the default) therefore keeps, unless memory demands it: the
whole FSDP model gathered (its full bytes) is more than `KEEP_SHARE` of the
device's memory. Regather is not taken where its second gather would hide
under the compute either: no compiled program showed it free. BERT-large-like
x8 on NVLink, where that test predicted it hidden under the forward, replayed
7.10 ms against 6.10 for keep: regather's compute grows too (6.29 against 5.74
ms of kernels: its ties and the casts recomputed at each gather site).

An unknown device memory (a CPU, a `DeviceSpec` not listed in `MEMORY`) never
demands it. `fsdp="keep"` / `"regather"` are taken as given.
"""

from __future__ import annotations

import dataclasses

from ooojax.passes.collectives.costs import COLLECTIVE_SECONDS
from ooojax.passes.simulate import Link

# Device memory in bytes, per `passes.cost` spec name (the larger common part).
MEMORY = {"V100": 32e9, "A100": 80e9, "H100": 80e9, "H200": 141e9}
# The most of a device's memory the whole gathered model may take under "keep": the
# rest is for activations, the optimizer's shards and XLA's temporaries.
KEEP_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class FsdpChoice:
  """The FSDP mode a call runs and why (`explain` prints `reason`)."""

  mode: str  # "keep" or "regather"
  asked: str  # the option: "auto", "keep" or "regather"
  reason: str
  keep_bytes: int  # the whole FSDP model gathered, per device
  memory: float  # the device's memory (0: unknown)
  gather_seconds: float  # one all-gather of the whole model on the link


def gather_seconds(link: Link, nbytes: float, n_devices: int, gathers: int) -> float:
  """Ring all-gather (or reduce-scatter) of `nbytes` in `gathers` collectives on `link`."""
  if n_devices <= 1 or nbytes <= 0:
    return 0.0
  per = (n_devices - 1) * link.latency + COLLECTIVE_SECONDS
  return gathers * per + (n_devices - 1) / n_devices * nbytes / link.bandwidth


def choose(
  fsdp: str,
  keep_bytes: int,
  n_devices: int,
  link: Link,
  spec_name: str,
  gathers: int,
  regathers: int = 1,
  again: str = "in the backward",
  what: str = "the whole model",
) -> FsdpChoice:
  """The mode for `fsdp` ("auto", "keep", "regather"); see the module docstring.
  `regathers`: how many more times than keep regather gathers the model (one, the
  backward's; a pipeline stage's actions gather it per microbatch), `again` where;
  `what`: what `keep_bytes` holds (a pipeline device's share of the stack)."""
  memory = MEMORY.get(spec_name, 0.0)
  ag = gather_seconds(link, keep_bytes, n_devices, max(gathers, 1))
  mb = lambda b: f"{b / 1e6:.0f} MB"  # noqa: E731
  if fsdp != "auto":
    return FsdpChoice(fsdp, fsdp, "as asked", keep_bytes, memory, ag)
  if memory and keep_bytes > KEEP_SHARE * memory:
    why = (
      f"memory demands it: {what} gathered ({mb(keep_bytes)}) is over "
      f"{KEEP_SHARE:.0%} of the {spec_name}'s {memory / 1e9:.0f} GB"
    )
    return FsdpChoice("regather", fsdp, why, keep_bytes, memory, ag)
  where = f"{memory / 1e9:.0f} GB {spec_name}" if memory else f"{spec_name} (memory unknown)"
  why = (
    f"{what} gathered ({mb(keep_bytes)}) fits the {where}; gathering it "
    f"again {again} would add {regathers * ag * 1e3:.3f} ms on {link.name} and compute "
    "(predicted); fsdp='regather' holds 1/N instead"
  )
  return FsdpChoice("keep", fsdp, why, keep_bytes, memory, ag)
