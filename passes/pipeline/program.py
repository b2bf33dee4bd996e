"""pipeline.program: what a pipelined step runs for one set of shapes, and its memory.

Contract: `program(stage_fn, loss_fn, sched, stage_params, batch, shared=None,
input_fn=None) -> Program` (the stage kinds cut into F / B / W phases by
`passes.pipeline.flavor`, the table's per-tick rows from `passes.pipeline.plan`,
the residual record layouts) and `memory(...) -> Memory` (bytes per device),
from shapes alone. `passes.pipeline.execute` lowers a `Program` to the tick
loop (`trace_replica`: the `Program` as one data replica traces it, for the
executor and the tiled train loop alike); `ooo.pipeline.memory` and
`ooo.pipeline.explain` read it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ooojax.passes import _compat
from ooojax.passes.pipeline import plan as plan_pass, records as records_pass
from ooojax.passes.pipeline.flavor import Flavor, make_flavor
from ooojax.passes.pipeline.generate import unfuse
from ooojax.passes.pipeline.schedule import PipelineSchedule
from ooojax.passes.pipeline.tick_options import recompute_costs

__all__ = ["Memory", "Program", "memory", "memory_of", "program", "split_microbatches", "trace"]


@dataclasses.dataclass(frozen=True)
class Program:
  """What the executor runs for one set of shapes: cut stages, rows, record layouts."""

  flavors: tuple[Flavor, ...]
  plan: plan_pass.Plan
  x_aval: jax.ShapeDtypeStruct  # the activation passed between stages
  fres: records_pass.Records  # F's residual record (what B and W read)
  bres: records_pass.Records  # B's record (what W reads)
  vstages: np.ndarray | None = None  # (stages, chunks): the virtual stage of each chunk


def split_microbatches(batch, M, D=1):
  """(inputs, targets[, side]) -> each leaf (M, rows, ...), rows split further over D
  data replicas; `side` (what every stage reads besides the activation) is None if absent."""
  if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
    raise TypeError(
      "batch must be (inputs, targets) or (inputs, targets, side); got "
      f"{type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )
  inputs, targets, side = (*batch, None)[:3]
  bsz = {jnp.shape(x)[0] for x in jax.tree.leaves((inputs, targets, side))}
  if len(bsz) != 1 or next(iter(bsz)) % (M * D):
    per = f"microbatches={M}" + (f" x {D} data replicas" if D > 1 else "")
    raise ValueError(
      f"inputs, targets and side need one leading batch size divisible by "
      f"{per}; got leading sizes {sorted(bsz)}"
    )
  return jax.tree.map(
    lambda x: jnp.reshape(x, (M, x.shape[0] // M, *x.shape[1:])), (inputs, targets, side)
  )


@_compat.manual_tracing  # as the shard_map body runs the stages
def trace(
  stage_fn,
  loss_fn,
  input_fn,
  sched,
  stage_params,
  inputs_m,
  targets_m,
  shared,
  side_m=None,
  has_aux: bool = False,
  platform: str | None = None,
) -> Program:
  V = sched.virtual_stages
  # what B and W recompute of F's values: by the platform the step runs on
  costs = recompute_costs(platform or jax.default_backend())
  for leaf in jax.tree.leaves(stage_params):
    if jnp.ndim(leaf) < 1 or jnp.shape(leaf)[0] != V:
      raise ValueError(
        f"stage_params leaves must be stacked on a leading axis of "
        f"{V} (virtual) stages; got a leaf of shape {jnp.shape(leaf)}"
      )
  typed = _compat.manual_avals  # under Explicit axes: as the shard_map body types them
  aval = lambda x: typed(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)))  # noqa: E731
  one = (
    lambda t: jax.tree.map(  # noqa: E731
      lambda x: typed(jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x))), t
    )
  )
  p_aval, in_aval, tg_aval = one(stage_params), one(inputs_m), one(targets_m)
  sd_aval = None if side_m is None else one(side_m)  # stage_fn(p, x, side)
  sd = () if sd_aval is None else (sd_aval,)
  sh_aval = None if shared is None else jax.tree.map(aval, shared)
  extra = () if shared is None else (sh_aval,)
  x_aval = jax.eval_shape(input_fn, in_aval, *extra) if input_fn is not None else in_aval
  if not isinstance(x_aval, jax.ShapeDtypeStruct):
    raise TypeError(f"the activation passed between stages must be one array; got {x_aval}")
  # One stage function for every virtual stage, or one each (equal ones share a
  # flavor): automatic cutting runs a different layer count per virtual stage.
  fns = tuple(stage_fn) if isinstance(stage_fn, (tuple, list)) else (stage_fn,) * V
  if len(fns) != V:
    raise ValueError(
      f"stage_fn gives {len(fns)} functions for {V} virtual stages; pass "
      "one function, or one per virtual stage"
    )
  uniq = list(dict.fromkeys(fns))
  # a stage function marked `stage_index` also gets its virtual stage's index
  index = any(getattr(fn, "stage_index", False) for fn in uniq)
  vs = (typed(jax.ShapeDtypeStruct((), jnp.int32)),) if index else ()
  for fn in uniq:
    y_aval = jax.eval_shape(fn, p_aval, x_aval, *sd, *vs)
    if (getattr(y_aval, "shape", None), getattr(y_aval, "dtype", None)) != (
      x_aval.shape,
      x_aval.dtype,
    ):
      raise ValueError(
        f"stage_fn must map the activation to one of the same shape and "
        f"dtype ({x_aval.shape} {x_aval.dtype}); got {y_aval}"
      )
  x_aval = typed(jax.ShapeDtypeStruct(x_aval.shape, x_aval.dtype))
  kind_of = lambda vs: (vs == 0, vs == V - 1, uniq.index(fns[vs]))  # noqa: E731
  kinds = sorted(
    {kind_of(vs) for vs in range(V)}, key=lambda k: (not k[0], not k[1], k[2])
  )  # first, last, middles
  flavors = tuple(
    make_flavor(
      fi,
      la,
      uniq[i],
      loss_fn,
      input_fn,
      p_aval,
      sh_aval,
      x_aval,
      in_aval,
      tg_aval,
      sd_aval,
      has_aux,
      index,
      costs,
    )
    for fi, la, i in kinds
  )
  flavor_of = lambda s, c: kinds.index(kind_of(sched.vstage(s, c)))  # noqa: E731
  # The executor is lock-step (a tick lasts as long as its slowest cell): it
  # runs a fused BW as B then W in consecutive ticks (`generate.unfuse`).
  return Program(
    flavors,
    plan_pass.plan(unfuse(sched), flavor_of),
    x_aval,
    records_pass.layout([fl.fres for fl in flavors]),
    records_pass.layout([fl.bres for fl in flavors]),
    np.array(
      [[sched.vstage(s, c) for c in range(sched.chunks)] for s in range(sched.stages)], np.int32
    ),
  )


@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes per device of a pipelined step (the largest device)."""

  weights: int  # the device's stage weights
  grads: int  # their gradient accumulators
  fres: int  # F's residual record of one microbatch on one (virtual) stage
  bres: int  # B's record (what W reads)
  peak: int  # the table's peak live microbatches per device (peak_activations)
  slots: dict  # slots per buffer (receive stacks add one trash slot)
  activation: int  # bytes of one activation (a receive slot)

  @property
  def bound(self) -> int:
    """What the schedule needs: weights, gradients, and `peak` microbatches' residuals."""
    return self.weights + self.grads + self.peak * (self.fres + self.bres)

  @property
  def allocated(self) -> int:
    """What the executor's buffers hold: accumulators, record and receive slots."""
    return (
      self.grads
      + (self.slots["fres"] + 1) * self.fres
      + (self.slots["bres"] + 1) * self.bres  # +1: the record being produced
      + (self.slots["act"] + self.slots["grad"] + 2) * self.activation
    )


def trace_replica(
  stage_fn,
  loss_fn,
  input_fn,
  sched,
  stage_params,
  batch_m,
  shared,
  has_aux: bool = False,
  data_axis: str | None = None,
  D: int = 1,
  platform: str | None = None,
) -> Program:
  """`trace` as one of `D` data replicas sees it: `batch_m` is (inputs, targets,
  side) with leaves `(microbatches, rows, ...)` whose rows split over `data_axis`,
  bound while tracing (a loss may name it)."""
  local = (
    lambda t: jax.tree.map(  # noqa: E731 - one data replica's slice
      lambda x: jax.ShapeDtypeStruct((x.shape[0], x.shape[1] // D, *x.shape[2:]), x.dtype), t
    )
  )
  inputs_m, targets_m, side_m = batch_m
  with _compat.axis_env([(data_axis, D)] if data_axis else []):
    return trace(
      stage_fn,
      loss_fn,
      input_fn,
      sched,
      stage_params,
      local(inputs_m),
      local(targets_m),
      shared,
      local(side_m),
      has_aux,
      platform,
    )


def program(
  stage_fn: Callable,
  loss_fn: Callable,
  sched: PipelineSchedule,
  stage_params,
  batch,
  shared=None,
  input_fn: Callable | None = None,
  platform: str | None = None,
) -> Program:
  """The `Program` a step runs for these shapes (cut stages, rows, records), untraced
  by any mesh: what `memory` and `ooo.pipeline.explain` read. `platform` ("cpu",
  "gpu"; default: jax's backend) sets what B and W recompute of F's values."""
  inputs_m, targets_m, side_m = jax.eval_shape(
    lambda b: split_microbatches(b, sched.microbatches), batch
  )
  return trace(
    stage_fn,
    loss_fn,
    input_fn,
    sched,
    stage_params,
    inputs_m,
    targets_m,
    shared,
    side_m,
    platform=platform,
  )


def memory(
  stage_fn: Callable,
  loss_fn: Callable,
  sched: PipelineSchedule,
  stage_params,
  batch,
  shared=None,
  input_fn: Callable | None = None,
) -> Memory:
  """The memory a pipelined step needs per device (`Memory`), from shapes alone."""
  prog = program(stage_fn, loss_fn, sched, stage_params, batch, shared, input_fn)
  return memory_of(prog, sched, stage_params)


def memory_of(prog: Program, sched: PipelineSchedule, stage_params) -> Memory:
  """`memory` of an already cut `Program`."""
  rec = lambda r: sum(w * np.dtype(dt).itemsize for dt, w in r.widths.items())  # noqa: E731
  per_v = sum(
    math.prod(jnp.shape(x)[1:]) * jnp.result_type(x).itemsize for x in jax.tree.leaves(stage_params)
  )
  wb = per_v * sched.chunks
  x = prog.x_aval
  return Memory(
    wb,
    wb,
    rec(prog.fres),
    rec(prog.bres),
    max(sched.peak_activations()),
    dict(prog.plan.counts),
    math.prod(x.shape) * x.dtype.itemsize,
  )
