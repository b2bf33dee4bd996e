"""pipeline.fsdp: stage weights sharded over the data axis inside their stage (ZeRO-3
within a pipeline stage).

Contract: `data_dims(stage_params, data_axis) -> tuple[int | None, ...]`, per leaf
of a stack (leading axis: virtual stages) the dimension split over `data_axis`
(None: held whole on each data replica), read from the leaves' shardings (an
Explicit-axes type, or a concrete array's `NamedSharding`); `Fsdp` is what the
tick loop does with them: each action that reads a chunk's weights all-gathers
the split leaves over the data axis first (the gathered copy dies with the
action), and each W reduce-scatters its gradient contribution at once, so a
device holds 1/D of those weights, of their gradient accumulators and of their
gradients. Without it (`fsdp="keep"`) the `shard_map` that runs the loop takes
the whole stage on every replica: one all-gather of the stage before the loop,
kept for the step; the whole gradients accumulate in the loop and are
reduce-scattered once after it (`Fsdp.scatter_after`, the tick loop's `scatter`),
so they come back split as the weights are (an all-reduce and a slice would
move twice the bytes). `fsdp="auto"` (the default) takes one of the two by
`collectives.fsdp_mode`'s rule, on a stage's split weights (`choose`): keep,
unless a device's stages gathered are over a quarter of its memory.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["FSDP_MODES", "Fsdp", "choose", "data_dims", "spec_name", "split_dim", "stack_dims"]

FSDP_MODES = ("auto", "regather", "keep")


def _spec(x):
  s = getattr(x, "sharding", None)  # a concrete array
  if isinstance(s, jax.sharding.NamedSharding):
    return s.spec
  try:
    s = jax.typeof(x).sharding  # a tracer under Explicit axes
  except (TypeError, AttributeError):
    return None
  return getattr(s, "spec", None)


def _names(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def split_dim(x, data_axis: str) -> int | None:
  """The dimension of `x` its sharding splits over `data_axis` alone, else None (a
  dimension split over the data axis together with another axis is gathered, as
  before: the tick loop splits over the data axis only)."""
  spec = _spec(x)
  dims = [d for d, e in enumerate(spec or ()) if _names(e) == (data_axis,)]
  return dims[0] if dims else None


def data_dims(stage_params, data_axis: str | None, given=None) -> tuple[int | None, ...]:
  """Per leaf of `stage_params` (a stack: leading axis of virtual stages), its
  dimension (>= 1) split over `data_axis`, else None (a stack split over it on its
  leading axis is gathered: the stages lead); `given`: those dimensions as the
  caller laid them out (padded with None), instead of the leaves' shardings."""
  leaves = jax.tree.leaves(stage_params)
  if given is not None:
    return (*given, *[None] * (len(leaves) - len(given)))[: len(leaves)]
  if data_axis is None:
    return (None,) * len(leaves)
  return tuple(d or None for d in (split_dim(x, data_axis) for x in leaves))


def stack_dims(leaves, cut, counts, data_axis: str) -> tuple | None:
  """Per stage column of `cut.stage_params(leaves, counts)`, its dimension split over
  `data_axis`, from the user's `leaves`: a column is split where every layer's leaf
  splits the same dimension of its own (a scan's: not its layer axis), one further
  in the stack (the virtual stages lead); None where no column is."""
  out = []
  for k in range(len(cut.stacked[0])):
    ds = {split_dim(leaves[row[k]], data_axis) for row in cut.stacked}
    d = ds.pop() if len(ds) == 1 else None
    out += [None if d is None or (cut.scanned and d == 0) else d + 1] * cut.per_leaf(counts)
  return tuple(out) if any(d is not None for d in out) else None


def spec_name(mesh) -> str:
  """The cost-model spec of the mesh's devices ("H100"; compile-only ones too), else
  their kind: `fsdp_mode.MEMORY` knows the GPUs' memory, not a CPU's."""
  from ooojax.passes.cost import DEVICE_SPECS

  kind = str(getattr(mesh.devices.flat[0], "device_kind", "")).upper()
  return next((n for n in DEVICE_SPECS if n in kind), kind or "CPU")


def choose(asked: str, cols, dims, stages: int, microbatches: int, data_size: int, spec: str):
  """`fsdp` ("auto", "keep", "regather") for a stack split as `dims` (per column of
  `cols`, the stage layout: leading axis of virtual stages): a
  `collectives.fsdp_mode.FsdpChoice`, the bytes those columns take whole on a device
  (its stages') against its memory; regather gathers them in each F, B and W of
  every microbatch."""
  from ooojax.passes.collectives import fsdp_mode
  from ooojax.passes.collectives.plan import get_link

  split = [x for x, d in zip(cols, dims) if d is not None]
  whole = sum(x.size * x.dtype.itemsize for x in split) // max(stages, 1)
  return fsdp_mode.choose(
    asked,
    whole,
    data_size,
    get_link(None),
    spec,
    len(split),
    regathers=3 * microbatches - 1,
    again="in each F, B and W",
    what="each device's share of the stack",
  )


@dataclasses.dataclass(frozen=True)
class Fsdp:
  """The tick loop's view: `dims[k]` is leaf k's split dimension in one chunk's
  weights (the stage axis dropped), or None."""

  dims: tuple[int | None, ...]
  axis: str
  size: int

  @staticmethod
  def of(stage_dims, data_axis, size) -> Fsdp | None:
    if data_axis is None or all(d is None for d in stage_dims):
      return None
    return Fsdp(tuple(None if d is None else d - 1 for d in stage_dims), data_axis, size)

  def gather(self, ws):
    """A chunk's weight leaves whole (what its stage function reads)."""
    return [
      w if d is None else lax.all_gather(w, self.axis, axis=d, tiled=True)
      for w, d in zip(ws, self.dims)
    ]

  def scatter(self, gs):
    """A W's gradient contributions, the split leaves' as this replica's part of the
    replicas' mean (the others' whole: reduced after the loop)."""
    return [
      g
      if d is None
      else lax.psum_scatter(g, self.axis, scatter_dimension=d, tiled=True) / self.size
      for g, d in zip(gs, self.dims)
    ]

  def scatter_after(self, gs):
    """keep's accumulated gradients after the loop, as `scatter`, each split leaf's
    dimension cut into (replicas, part) with the replicas leading: XLA:GPU
    reduce-scatters a leading dimension of the row-major accumulators as they are,
    while scattering dimension d in place makes it lay them out d-major inside the
    tick loop too (jax 0.12: 21 -> 34 MB of temporaries, benchmarks/pipeline_fsdp)."""
    out = []
    for g, d in zip(gs, self.dims):
      if d is not None:
        n = g.shape[d]
        g = g.reshape(*g.shape[:d], self.size, n // self.size, *g.shape[d + 1 :])
        g = lax.psum_scatter(jnp.moveaxis(g, d, 0), self.axis, scatter_dimension=0) / self.size
      out.append(g)
    return out

  def split(self, k: int) -> bool:
    return k < len(self.dims) and self.dims[k] is not None
