"""pipeline.execute: lower a pipeline table to one SPMD `shard_map` program.

Contract: `lower(stage_fn, loss_fn, sched, mesh, axis_name, input_fn=None,
data_axis=None) -> step(stage_params, batch, shared=None) -> (loss, grads)`
(with a `data_axis`, each microbatch's rows split over that mesh axis).
`passes.pipeline.train` runs tables tiled over steps with the same loop body
(`ticks.tick_loop` with an updater: weights and optimizer states as loop state).

Each stage kind ("flavor": first, middle, last virtual stage) is cut into
F / B / W phases by `passes.pipeline.flavor` (the split pass; scanned layers
split into a B-scan and W-scans); `passes.pipeline.plan` turns the table into
per (tick, device) integer rows and slot counts; `passes.pipeline.ticks` is
the per-device loop over the ticks. This module runs that loop under
`shard_map`: each device gets its own chunks' weights (a slice of the stack,
never a gather) and the gradients come back in the stack's order.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ooojax.passes.pipeline.flavor import Flavor, make_flavor
from ooojax.passes.pipeline.fsdp import FSDP_MODES, Fsdp, choose, data_dims, spec_name
from ooojax.passes.pipeline.link import one_way_groups
from ooojax.passes.pipeline.lowering import tick_lowering
from ooojax.passes.pipeline.program import (
  Memory,
  Program,
  memory,
  program,
  split_microbatches,
  trace_replica,
)
from ooojax.passes.pipeline.schedule import PipelineSchedule
from ooojax.passes.pipeline.tick_options import (
  every_tick_writes_records,
  masked_rows,
  one_way,
  weight_slices,
)
from ooojax.passes.pipeline.ticks import tick_loop

__all__ = [
  "Flavor",
  "Memory",
  "Program",
  "device_order",
  "every_tick_writes_records",
  "lower",
  "xla_options",
  "one_way",
  "one_way_groups",
  "make_flavor",
  "memory",
  "program",
]


# --- the program ------------------------------------------------------------------
def _check(sched: PipelineSchedule, mesh, axis_name: str) -> None:
  S, v = sched.stages, sched.chunks
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
  if mesh.shape[axis_name] != S:
    raise ValueError(
      f"the schedule has {S} stages but mesh axis {axis_name!r} has "
      f"{mesh.shape[axis_name]} devices; generate it with stages="
      f"{mesh.shape[axis_name]}"
    )
  if S == 1 and v > 1:
    raise ValueError("an interleaved schedule needs at least 2 stages to execute")
  if sched.lag not in (0, 1):
    raise ValueError(f"the executor runs tables with lag 0 or 1, got {sched.lag}")


# XLA:GPU's latency-hiding scheduler keeps one collective in flight by default.
# A lag-1 tick on more than 2 stages sends on two rings (up and down), issued
# before its action: with the default only one ring's window holds the action
# and the other waits after it (tests/test_pipeline_hlo.py reads both cases).
GPU_OVERLAP_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"


def xla_options(sched: PipelineSchedule) -> dict:
  """The XLA compiler options under which the lowered step hides its transfers
  on a GPU: two collectives in flight where a lag-1 tick sends on two rings
  (more than 2 stages); none otherwise (a lag-0 tick's transfers wait for its
  action; at 2 stages both directions are one permute). Other backends ignore
  the option."""
  return {GPU_OVERLAP_LIMIT: 2} if sched.lag >= 1 and sched.stages > 2 else {}


def lower(
  stage_fn: Callable,
  loss_fn: Callable,
  sched: PipelineSchedule,
  mesh,
  axis_name: str,
  input_fn: Callable | None = None,
  data_axis: str | None = None,
  device_major: bool = False,
  has_aux: bool = False,
  fsdp: str | tuple = "auto",
  split_dims: tuple | None = None,
) -> Callable:
  """Returns `step(stage_params, batch, shared=None) -> (loss, grads)`; see the module doc.

  `stage_fn` is one function, or a tuple of one per virtual stage (equal ones
  share a stage kind: automatic cutting's per-stage layer counts).
  `stage_params` leaves are stacked on a leading axis of `sched.virtual_stages`;
  `batch = (inputs, targets)` with a leading batch axis split into
  `sched.microbatches`; `batch = (inputs, targets, side)` hands every stage its
  microbatch's `side` too: `stage_fn(params, x, side)` (not differentiated).
  `grads` mirrors `stage_params`, or is `(stage_grads, shared_grads)` when
  `shared` is given. With a `data_axis` (a second mesh axis) each microbatch
  is split over it too: every data replica runs the table on its slice, and
  the loss and gradients are their mean.
  With `device_major`, `stage_params` (and `grads`) stack the virtual stages in
  device order (`device_order(sched)`): device s's chunks are contiguous, so a
  stage-sharded stack reaches its devices without moving (interleaved, zb-v).
  With `has_aux`, `loss_fn` returns `(loss, aux)` (`aux` a tuple of arrays, computed
  by the last stage's F) and `step` returns `((loss, aux), grads)`, each aux leaf
  stacked over the microbatches (then data replicas): `(M * D, ...)`.
  With a `data_axis`, `stage_params` leaves whose sharding splits one of their
  dimensions over it (`fsdp.data_dims`) stay split on each replica: with
  `fsdp="regather"` each action gathers them and each W reduce-scatters their
  gradient, which comes back split as they are (`passes.pipeline.fsdp`);
  `fsdp="keep"` gathers the stages whole before the loop and reduce-scatters
  their gradients once after it (split as the weights are); `"auto"` (the
  default) keeps unless a device's stages gathered are over a quarter of its
  memory (`fsdp.choose`); a tuple gives each leaf's split dimension (or None) as
  the caller laid the stack out (regathered). `split_dims`: those dimensions for
  keep (make_train_step's state, whose tracers need not carry their sharding).
  """
  _check(sched, mesh, axis_name)
  given = fsdp if isinstance(fsdp, tuple) else None  # the caller's layout (make_train_step)
  if given is None and fsdp not in FSDP_MODES:
    raise ValueError(f"fsdp={fsdp!r}: use one of {FSDP_MODES}")
  D = _data_size(mesh, axis_name, data_axis)
  if sched.steps != 1 or any(a.kind == "U" for row in sched.grid for c in row for a in c):
    raise ValueError(
      f"value_and_grad runs one step's table without updates; "
      f"{sched.name!r} holds {sched.steps} steps (from tile): run it with "
      "lower_train (ooo.pipeline.train), or pass the one-step table"
    )
  M = sched.microbatches

  def step(stage_params, batch, shared=None):
    inputs_m, targets_m, side_m = split_microbatches(batch, M, D)
    prog = trace_replica(
      stage_fn,
      loss_fn,
      input_fn,
      sched,
      stage_params,
      (inputs_m, targets_m, side_m),
      shared,
      has_aux,
      data_axis,
      D,
      mesh.devices.flat[0].platform,
    )
    mode = fsdp
    if fsdp == "auto":  # keep unless the stages gathered are too big (`fsdp.choose`)
      split = data_dims(stage_params, data_axis)
      mode = "keep"
      if any(d is not None for d in split):
        leaves = jax.tree.leaves(stage_params)
        mode = choose(fsdp, leaves, split, sched.stages, M, D, spec_name(mesh)).mode
    dims = data_dims(stage_params, data_axis if mode == "regather" else None, given)
    kept = None  # keep: the leaves whose gradients are reduce-scattered after the loop
    if mode == "keep" and data_axis is not None:
      kept = data_dims(stage_params, data_axis, split_dims)
      kept = kept if any(d is not None for d in kept) else None
    body = tick_loop(
      prog,
      sched.stages,
      sched.chunks,
      M,
      axis_name,
      sched.lag,
      data_axis=data_axis,
      **_mesh_options(mesh, sched, prog),
      fsdp=Fsdp.of(dims, data_axis, D),
      scatter=kept and Fsdp.of(kept, data_axis, D),
    )
    loss, gp, gsh = _shard(
      body,
      sched,
      mesh,
      axis_name,
      stage_params,
      shared,
      (inputs_m, targets_m, side_m),
      [fl.consts for fl in prog.flavors],
      data_axis=data_axis,
      device_major=device_major,
      p_dims=dims,
      g_dims=kept,
    )
    return loss, (gp if shared is None else (gp, gsh))

  return step


def _mesh_options(mesh, sched, prog) -> dict:
  """`tick_loop`'s options that the mesh (and the table) choose."""
  return dict(
    split=one_way(mesh),
    select=tick_lowering(mesh, sched, prog) == "select",
    records_always=every_tick_writes_records(mesh),
    masked_rows=masked_rows(mesh),
    slices=weight_slices(mesh),
  )


def _shard(
  body,
  sched,
  mesh,
  axis_name,
  stage_params,
  shared,
  batch_m,
  consts,
  opt_state=None,
  data_axis=None,
  device_major=False,
  p_dims=None,
  g_dims=None,
):
  """Runs `body` under `shard_map`: each device gets its chunks' weights (and
  optimizer states); returns what it returns, per-chunk trees back in
  virtual-stage order. `p_dims[k]`: the dimension of weight leaf k split over
  `data_axis` (FSDP within the stage: its part only, and its gradient's), or None;
  `g_dims`: the gradients' (keep: the weights come whole, their gradients split)."""
  S, v = sched.stages, sched.chunks
  # Chunk c of device s is virtual stage sched.vstage(s, c): one (S, ...) tree per
  # chunk, so a device's chunk weights arrive as their own buffers (no slicing).
  idx = np.array([[sched.vstage(s, c) for s in range(S)] for c in range(v)])
  inv = np.argsort(idx.ravel())
  split = lambda tree: tuple(
    jax.tree.map(lambda x, c=c: _take(x, idx[c]), tree)  # noqa: E731
    for c in range(v)
  )
  from_dev = lambda *xs: _untake(xs, idx, inv)  # noqa: E731
  if device_major and v > 1:  # device s's chunks at rows s * v + c: a local slice
    split = (
      lambda tree: tuple(
        jax.tree.map(  # noqa: E731
          lambda x, c=c: x.reshape(S, v, *x.shape[1:])[:, c], tree
        )
        for c in range(v)
      )
    )
    from_dev = lambda *xs: jnp.stack(xs, 1).reshape(S * v, *xs[0].shape[1:])  # noqa: E731
  p_leaves, p_def = jax.tree.flatten(stage_params)

  def spec(ds):  # per chunk, each leaf's: over the stages, and its dimension ds[k] over data
    ds = ds or (None,) * len(p_leaves)
    one = [P(axis_name) if d is None else P(axis_name, *[None] * (d - 1), data_axis) for d in ds]
    return (jax.tree.unflatten(p_def, one),) * v

  p_spec = spec(p_dims)
  g_spec = spec(g_dims) if g_dims else p_spec
  rep = lambda t: jax.tree.map(lambda _: P(), t)  # noqa: E731
  dat = lambda t: jax.tree.map(lambda _: P(None, data_axis), t)  # noqa: E731
  per_mb = dat if data_axis else rep  # (microbatch, rows, ...): rows over the data axis
  # every device gets the whole batch (inputs, targets, side): a stage slices its microbatch
  specs = (p_spec, rep(shared), per_mb(batch_m), rep(consts))
  args = (split(stage_params), shared, batch_m, consts)
  if opt_state is None:
    out_specs = (P(), g_spec, rep(shared))
  else:
    o_stage, o_rep = opt_state
    o_spec = tuple(jax.tree.map(lambda _: P(axis_name), o_stage) for _ in range(v))
    specs, args = specs + (o_spec, rep(o_rep)), args + (split(o_stage), o_rep)
    out_specs = (P(), p_spec, rep(shared), o_spec, rep(o_rep))
  fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
  if g_dims:  # keep: each device's stage sliced first, then only it gathered (a
    # stack split over the data axis resharded over the stages at once is
    # gathered whole on every device: XLA's "involuntary full rematerialization")
    place = jax.reshard if _explicit(mesh) else jax.lax.with_sharding_constraint
    first = jax.tree.map(lambda x, sp: place(x, NamedSharding(mesh, sp)), args[0], g_spec)
    args = (first, *args[1:])
  if _explicit(mesh):  # explicit-sharding meshes want arguments already placed
    args = tuple(jax.tree.map(lambda x, sp: jax.reshard(x, NamedSharding(mesh, sp)), args, specs))
  loss, per_chunk, last, *opt = fn(*args)
  trees = (per_chunk,) if opt_state is None else (per_chunk, opt[0])
  out = []
  for k, t in enumerate(trees):
    if _explicit(mesh) and v > 1 and not device_major:  # chunks interleave into V
      # off the stage axis; a weight split over the data axis (FSDP) stays split
      whole = lambda x, sp=P(): jax.reshard(x, NamedSharding(mesh, P(None, *sp[1:])))  # noqa: E731
      t = tuple(
        jax.tree.map(whole, tc, g_spec[0]) if k == 0 else jax.tree.map(whole, tc) for tc in t
      )
    out.append(jax.tree.map(from_dev, *t))
  if opt_state is None:
    return loss, out[0], last
  return out[0], last, out[1], opt[1], loss


def device_order(sched: PipelineSchedule) -> np.ndarray:
  """The virtual stage at each row of a device-major stack: device s's chunk c at
  row s * chunks + c (the identity without chunks)."""
  return np.array([sched.vstage(s, c) for s in range(sched.stages) for c in range(sched.chunks)])


def _data_size(mesh, axis_name, data_axis) -> int:
  if data_axis is None:
    return 1
  if data_axis not in mesh.shape or data_axis == axis_name:
    raise ValueError(
      f"data_axis={data_axis!r} must be a mesh axis other than the stage "
      f"axis {axis_name!r}; the mesh has {dict(mesh.shape)}"
    )
  return mesh.shape[data_axis]


def _take(x, ids):
  """`x[ids]`, as a slice where `ids` is a run (modulo and V placements): a gather
  would make XLA materialise every stage's weights on every device."""
  a = int(ids[0])
  if list(ids) == list(range(a, a + len(ids))):
    return x if len(ids) == x.shape[0] else x[a : a + len(ids)]
  if list(ids) == list(range(a, a - len(ids), -1)):
    return jnp.flip(x[a - len(ids) + 1 : a + 1], 0)
  return x[ids]


def _untake(xs, idx, inv):
  """The (V, ...) stack of the per-chunk stacks `xs` (chunk c holds stages idx[c])."""
  order = sorted(range(len(xs)), key=lambda c: min(idx[c]))
  parts = [xs[c] if idx[c][0] <= idx[c][-1] else jnp.flip(xs[c], 0) for c in order]
  flat = np.concatenate([np.sort(idx[c]) for c in order])
  if list(flat) == list(range(len(flat))):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
  return jnp.concatenate(xs)[inv]


def _explicit(mesh) -> bool:
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()))
