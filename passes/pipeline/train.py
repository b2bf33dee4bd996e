"""pipeline.train: a table tiled over steps as one training program.

Contract: `lower_train(stage_fn, loss_fn, sched, mesh, axis_name, optimizer,
input_fn=None) -> train(stage_params, opt_state, batches) -> (stage_params,
opt_state, losses)`: the weights and optimizer states are loop state of
`execute`'s tick loop, each (stage, chunk) updated at its `U` tick.
`lower_updates(..., updater)` is the same program with the update given as an
`Updater`, and shared weights as loop state too, reduced over the stages and
updated once per step at the plan's `sync` tick (the automatic form's tiled
train step, `ooojax.pipeline._tiled`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ooojax.passes.pipeline import plan as plan_pass
from ooojax.passes.pipeline.execute import _check, _data_size, _explicit, _mesh_options, _shard
from ooojax.passes.pipeline.program import Program, split_microbatches, trace_replica
from ooojax.passes.pipeline.schedule import PipelineSchedule
from ooojax.passes.pipeline.ticks import tick_loop

__all__ = ["Updater", "lower_train", "lower_updates"]


@dataclasses.dataclass(frozen=True)
class Updater:
  """How a training program's updates change its loop state (per device, inside
  `shard_map`). `opt_stage` is stage-sharded (each chunk gets its `(1, ...)`
  rows), `opt_rep` replicated; both are the updater's own trees.

  * `chunk(c, w, g, o_c, o_rep) -> (w, o_c, o_rep)`: chunk c's update at its U
    tick: `w` / `g` its weight / summed gradient leaves (leading stage axis
    dropped), `o_c` its rows of `opt_stage` (leading axis dropped).
  * `shared(key, js, sh, g, o_rep) -> (sh, o_rep)`: the update of shared
    leaves `js` (`sh`, `g` theirs). `key` None: leaves the first and the last
    stage read, at each `sync` tick, the gradient summed over the stages (the
    same on every device); `key` a virtual stage: the leaves only it reads, at
    its U tick on its device (the others' copies go stale until the end).
    None: the program takes no shared weights.
  * `start(o_rep)` / `finish(o_rep, bcast)`: `opt_rep` into the loop state and
    back; `bcast(key, x)` gives every device the owner's `x`.
  """

  chunk: Callable
  shared: Callable | None = None
  start: Callable = lambda o: o  # noqa: E731
  finish: Callable = lambda o, bcast: o  # noqa: E731


def lower_train(
  stage_fn: Callable,
  loss_fn: Callable,
  sched: PipelineSchedule,
  mesh,
  axis_name: str,
  optimizer,
  input_fn: Callable | None = None,
  device_major: bool = False,
) -> Callable:
  """Returns `train(stage_params, opt_state, batches) -> (stage_params, opt_state, losses)`
  running a table tiled over `sched.steps` steps (`tile`), with each stage's
  optimizer update inside the tick loop at its `U` action (a one-step table
  gets its U from `steps.with_updates`).

  `opt_state = jax.vmap(optimizer.init)(stage_params)`: one state per virtual
  stage, updated by that stage alone. `batches = (inputs, targets[, side])` with
  leading axes (steps, batch). `losses[t]` is step t's loss. The weights step t + 1's
  forwards read are those of the synchronous loop (its stage's update of step t
  precedes them), so the trajectory is the synchronous one for any optax
  transformation that acts leaf by leaf (sgd, momentum, adam, adamw, weight
  decay); one that reduces over every leaf (`clip_by_global_norm`) would see
  one stage's leaves only, and tied (`shared`) weights would need a reduction
  across the stages before their update: neither is supported here (the
  automatic form's `make_train_step(steps=n)` updates shared weights exactly).
  With `device_major` the stage rows (of the weights and of `opt_state`) are in
  `execute.device_order`.
  """

  def train(stage_params, opt_state, batches):
    tree = jax.tree.structure(stage_params)

    def chunk(c, w, g, o, o_rep):
      u, o = optimizer.update(tree.unflatten(g), o, tree.unflatten(w))
      return [(a + b).astype(a.dtype) for a, b in zip(w, jax.tree.leaves(u))], o, o_rep

    run = lower_updates(
      stage_fn, loss_fn, sched, mesh, axis_name, Updater(chunk), input_fn, device_major
    )
    p, _, o, _, losses = run(stage_params, None, opt_state, (), batches)
    return p, o, losses

  _check(sched, mesh, axis_name)
  return train


def lower_updates(
  stage_fn: Callable,
  loss_fn: Callable,
  sched: PipelineSchedule,
  mesh,
  axis_name: str,
  updater: Updater,
  input_fn: Callable | None = None,
  device_major: bool = False,
  owners=None,
  has_aux: bool = False,
  data_axis: str | None = None,
) -> Callable:
  """`run(stage_params, shared, opt_stage, opt_rep, batches) -> (stage_params, shared,
  opt_stage, opt_rep, losses)`: `lower_train`'s program with the updates of
  `updater`. `shared` (weights read outside the stack, or None): `owners[j]`
  is the virtual stage (0 or the last) that alone reads leaf j, updated there
  at its U tick; None (default: all) for a leaf both read, reduced over the
  stages and updated at the plan's `sync` ticks, which needs a table tiled
  with `tile(sched, steps, shared=True)` (checked). With `has_aux` (`loss_fn` returns
  `(loss, aux)`), `losses` is `(losses, aux)`, each aux leaf `(steps * M, ...)`.
  With a `data_axis`, each microbatch's rows are split over it as in
  `execute.lower`; each update reads the gradient's mean over the replicas, so
  the replicas' weights stay equal, and `losses` are the replicas' mean."""
  _check(sched, mesh, axis_name)
  D = _data_size(mesh, axis_name, data_axis)
  if sched.steps == 1 and not any(a.kind == "U" for row in sched.grid for c in row for a in c):
    from ooojax.passes.pipeline.steps import with_updates

    sched = with_updates(sched)
  M, N = sched.microbatches, sched.steps

  def run(stage_params, shared, opt_stage, opt_rep, batches):
    lead = {jnp.shape(x)[0] for x in jax.tree.leaves(batches)}
    if lead != {N}:
      raise ValueError(
        f"batches need a leading axis of {N} steps (the table's steps); "
        f"got leading sizes {sorted(lead)}"
      )
    if jax.tree.leaves(shared) and updater.shared is None:
      raise ValueError("shared weights need an updater with a shared update")
    # index step * M + microbatch; side: what every stage reads besides the activation
    inputs_m, targets_m, side_m = _per_microbatch(batches, N, M, D, mesh, data_axis)
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
    own = list(owners or [None] * len(jax.tree.leaves(shared)))
    if None in own:
      _check_sync(prog, sched)
    body = tick_loop(
      prog,
      sched.stages,
      sched.chunks,
      M,
      axis_name,
      sched.lag,
      updater=updater,
      steps=N,
      data_axis=data_axis,
      owners=[None if o is None else (*sched.place(o), o) for o in own],
      **_mesh_options(mesh, sched, prog),
    )
    return _shard(
      body,
      sched,
      mesh,
      axis_name,
      stage_params,
      shared,
      (inputs_m, targets_m, side_m),
      [fl.consts for fl in prog.flavors],
      (opt_stage, opt_rep),
      data_axis=data_axis,
      device_major=device_major,
    )

  return run


def _per_microbatch(batches, N, M, D, mesh, data_axis):
  """`(steps, batch, ...)` leaves as `(steps * M, rows, ...)`. On an explicit mesh the
  reshape says where the rows go (over the data axis, where `_shard` wants them):
  a reshape that moves a sharded axis has no sharding of its own there."""
  flat = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((N * x.shape[1], *x.shape[2:]), x.dtype), batches
  )
  jax.eval_shape(lambda b: split_microbatches(b, N * M, D), flat)  # sizes, with its message
  spec = P(None, data_axis) if data_axis is not None and _explicit(mesh) else None
  return jax.tree.map(
    lambda x: lax.reshape(x, (N * M, x.shape[1] // M, *x.shape[2:]), out_sharding=spec),
    tuple(batches) + (None,) * (3 - len(batches)),
  )


def _check_sync(prog: Program, sched: PipelineSchedule) -> None:
  """Shared weights are exact when every action of a flavor that reads them runs
  after the sync of the step before and (W) no later than its own step's sync."""
  F, rows = plan_pass.F, prog.plan.rows
  syncs = list(np.flatnonzero(rows[:, 0, F["sync"]]))
  for t in range(rows.shape[0]):
    for d in range(rows.shape[1]):
      b = rows[t, d, F["branch"]]
      if b == 0 or not prog.flavors[prog.plan.branches[b - 1][0]].n_shared:
        continue
      n = rows[t, d, F["step"]]
      if (n and t <= syncs[n - 1]) or t > syncs[n]:
        raise ValueError(
          f"{sched.name!r} tiled over {sched.steps} steps runs a stage that reads the "
          f"shared weights (tied embeddings, head) at tick {t} of step {n}, across the "
          "update of those weights; tile it with tile(sched, steps, shared=True)"
        )
