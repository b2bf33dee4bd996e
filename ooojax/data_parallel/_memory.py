"""Predicted per-device memory of the data-parallel step: ooojax beside plain GSPMD.

The memory section of `ooo.explain(..., mode="data_parallel")` (kept apart from
the timing report). What a device holds, from the parameters' shapes and
shardings and the plan's buckets alone (no compile):

* parameters and their gradients after the reduction: 1/N of each weight
  split over the data axis (FSDP / ZeRO-3), a whole replicated one, divided
  by the other mesh axes a weight is split over (tensor parallel): the same
  under ooojax and plain GSPMD;
* the unreduced gradients in flight: ooojax reduces a bucket at a time
  (its largest bucket); plain GSPMD one leaf at a time (its largest leaf)
  before XLA's combiners merge some;
* gathered weights (FSDP): `fsdp="regather"` gathers each weight where the
  forward reads it, again in the backward, one group ahead
  (`passes.collectives.regather`): about two consecutive layers' weights at
  once; `fsdp="keep"` holds every FSDP weight gathered for the whole step;
  the default `fsdp="auto"` keeps unless memory demands regather
  (`passes.collectives.fsdp_mode`: the section says which and why).
  Plain GSPMD gathers where XLA's scheduler puts the gathers: one layer
  ahead when it prefetches so (the same two layers), up to the whole model
  when memory does not press it.

Estimates, never measurements: XLA's buffer assignment adds activations and
temporaries and may keep more alive (`benchmarks/dp_gspmd.py --mem` reads the
compiled numbers).
"""

from __future__ import annotations

import dataclasses
import math

import jax

from ooojax.passes import _compat
from ooojax.passes.collectives import plan as collectives


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """How one parameter is held: its full bytes, whether it is split over the
  data axis (FSDP), and the product of the other mesh axes it is split over."""

  nbytes: int
  fsdp: bool
  other: int = 1


@dataclasses.dataclass(frozen=True)
class DataParallelMemory:
  """Predicted per-device bytes (see the module docstring)."""

  n_devices: int
  params: int  # held parameters (ooojax = plain GSPMD)
  grads: int  # reduced gradients (ooojax = plain GSPMD)
  bucket: int  # ooojax: the largest unreduced gradient bucket
  leaf: int  # plain GSPMD: the largest unreduced gradient leaf
  gathered: int  # ooojax fsdp="regather": two consecutive layers' FSDP weights
  gathered_keep: int  # fsdp="keep": every FSDP weight
  fsdp_leaves: int
  fsdp: str = "keep"  # the FSDP mode this call runs
  fsdp_asked: str = "auto"  # the option
  fsdp_reason: str = ""  # why (`passes.collectives.fsdp_mode.FsdpChoice.reason`)

  def lines(self) -> list[str]:
    mb = lambda b: f"{b / 1e6:.2f} MB" if b >= 1e6 else f"{b / 1e3:.1f} KB"  # noqa: E731
    out = [
      "  memory per device (predicted from shapes and shardings, not compiled):",
      f"    parameters {mb(self.params)}, gradients after the reduction {mb(self.grads)} "
      "(ooojax and plain GSPMD alike"
      + (
        f"; {self.fsdp_leaves} FSDP leaves held at 1/{self.n_devices})" if self.fsdp_leaves else ")"
      ),
      f"    unreduced gradients in flight: ooojax {mb(self.bucket)} (its largest bucket), "
      f"plain GSPMD {mb(self.leaf)} (its largest leaf)",
    ]
    if self.fsdp_leaves:
      out.append(f"    FSDP: fsdp={self.fsdp_asked!r} runs {self.fsdp!r} here ({self.fsdp_reason})")
      out.append(
        f"    gathered weights (this call: fsdp={self.fsdp!r}): ooojax "
        f"{mb(self.gathered)} (fsdp='regather': two consecutive "
        f"layers at once), fsdp='keep' {mb(self.gathered_keep)} (every FSDP weight for the "
        f"whole step); plain GSPMD {mb(self.gathered)} when XLA prefetches one layer ahead, "
        f"up to {mb(self.gathered_keep)}"
      )
    return out


def leaf_layouts(leaves, boxed: dict, axis, n: int) -> list[LeafLayout]:
  """Per parameter leaf: its `LeafLayout`, from its own sharding (an array or a struct
  placed on a mesh) or the spec of the box holding it (`boxed`: id -> spec)."""
  out = []
  for x in leaves:
    nbytes = int(math.prod(x.shape)) * jax.numpy.dtype(x.dtype).itemsize
    s = _compat.declared_sharding(x) if _compat.is_tracer(x) else getattr(x, "sharding", None)
    spec = getattr(s, "spec", None) if isinstance(s, jax.sharding.NamedSharding) else None
    if spec is None:
      spec = boxed.get(id(x))
    if spec is None:
      out.append(LeafLayout(nbytes, False))
      continue
    names = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    sizes = dict(getattr(getattr(s, "mesh", None), "shape", {}) or {})
    other = math.prod(sizes.get(a, 1) for a in names if a != axis)
    out.append(LeafLayout(nbytes, axis in names, int(other)))
  return out


def predict(
  split, plan, param_names, layouts: list[LeafLayout], n: int, fsdp=None
) -> DataParallelMemory:
  """The per-device memory of the data-parallel step (`DataParallelMemory`); `fsdp`: the
  call's `passes.collectives.fsdp_mode.FsdpChoice` (None: "keep", as asked)."""
  held = [l.nbytes // ((n if l.fsdp else 1) * l.other) for l in layouts]
  local = [l.nbytes // l.other for l in layouts]  # a gathered weight, an unreduced gradient
  bucket = max((sum(local[i] for i in b.grads) for b in plan.buckets), default=0)
  bucket = max([bucket, *(lp.nbytes // max(lp.trips, 1) for lp in plan.loops)])  # a layer a trip
  by_layer: dict[str, int] = {}
  for name, l, b in zip(param_names, layouts, local):
    if l.fsdp:
      layer = collectives.layer_of(name)
      by_layer[layer] = by_layer.get(layer, 0) + b
  order = [l for l in collectives.layers_forward(split) if l in by_layer]
  order += [l for l in by_layer if l not in order]
  sizes = [by_layer[l] for l in order]
  two = max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))
  return DataParallelMemory(
    n,
    sum(held),
    sum(held),
    bucket,
    max(local, default=0),
    two,
    sum(sizes),
    sum(l.fsdp for l in layouts),
    fsdp.mode if fsdp else "keep",
    fsdp.asked if fsdp else "keep",
    fsdp.reason if fsdp else "as asked",
  )
