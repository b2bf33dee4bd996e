"""Pipeline parallelism: schedules as tables, executed as one SPMD program.

>>> import ooojax as ooo
>>> sched = ooo.pipeline.schedule("zb-h1", stages=4, microbatches=8)
>>> round(sched.bubble_fraction(), 3), max(sched.peak_activations())
(0.111, 4)
>>> zb2 = ooo.pipeline.schedule("zb-h2", stages=4, microbatches=8)
>>> round(zb2.bubble_fraction(), 3), round(zb2.steady_bubble(steps=4), 3)  # simulated
(0.111, 0.0)

`value_and_grad(stage_fn, loss_fn, mesh=..., axis_name=..., schedule=...)`
returns `step(stage_params, batch, shared=None) -> (loss, grads)` that runs the
table with `jax.shard_map` over the stage axis; B and W of each stage come from
the split pass (no recomputation of the dX chain, no hand-written backward).
`explain(stage_fn, loss_fn, schedule, stage_params, batch)` prices the table on
the model (simulated bubble, memory per stage, compiled ppermute windows);
`explain(loss_fn, params, *batch, stages=N)` does so for the automatic form
below, and reports its cut and balance.
`value_and_grad(loss_fn, mesh=..., axis_name=...)`, with the plain loss one
passes to `jax.value_and_grad`, cuts the stages itself
(`passes.pipeline.cut`): `step(params, *batch) -> (loss, grads)`.
`make_train_step(loss_fn, optimizer, mesh=..., axis_name=...)` adds the
optimizer, applied per stage on the stage-sharded parameters; with `steps=n`
one call runs n steps as a table tiled over steps (`ooojax.pipeline._tiled`).
`step.tune(state, *batch)` times the candidate tables (`ooo`, 1F1B's, GPipe's)
on the devices at hand and keeps the fastest (`tune` for any step built from a
table).
"""

from __future__ import annotations

from ooojax.passes.pipeline.balance import Balance
from ooojax.passes.pipeline.cut import Cut, CutError
from ooojax.passes.pipeline.depth import DepthChoice, pick_measured, plan_ooo, trial_tables
from ooojax.passes.pipeline.execute import device_order
from ooojax.passes.pipeline.generate import SCHEDULES
from ooojax.passes.pipeline.link import LinkModel, simulate_link
from ooojax.passes.pipeline.program import Memory
from ooojax.passes.pipeline.schedule import Action, PipelineSchedule, ScheduleError
from ooojax.passes.pipeline.steps import SteadyState, steady_state, tile
from ooojax.pipeline._automatic import (  # noqa: F401 - the private ones: tests, models.matrix
  _auto,
  _auto_parts,
  _auto_program,
  _AutoParts,
  _AutoProgram,
  _device_major,
  _explicit,
  _table,
  is_key,
  mean_aux,
  microbatch_keys,
)
from ooojax.pipeline._explain import AutoCut, PipelineReport, explain
from ooojax.pipeline._grad import value_and_grad
from ooojax.pipeline._make import make_train_step, train
from ooojax.pipeline._report import StageFsdp
from ooojax.pipeline._tables import compiler_options, memory, schedule
from ooojax.pipeline._tiled import TiledTrainStep  # noqa: F401 - make_train_step(steps=n)'s step
from ooojax.pipeline._train import PipelineTrainState, PipelineTrainStep, StageParams
from ooojax.pipeline._tune import Tuning, tune

__all__ = [
  "SCHEDULES",
  "Action",
  "AutoCut",
  "Balance",
  "Cut",
  "CutError",
  "DepthChoice",
  "LinkModel",
  "Memory",
  "PipelineReport",
  "pick_measured",
  "plan_ooo",
  "trial_tables",
  "simulate_link",
  "PipelineSchedule",
  "PipelineTrainState",
  "PipelineTrainStep",
  "ScheduleError",
  "StageFsdp",
  "StageParams",
  "SteadyState",
  "compiler_options",
  "device_order",
  "explain",
  "make_train_step",
  "mean_aux",
  "memory",
  "schedule",
  "steady_state",
  "tile",
  "train",
  "tune",
  "Tuning",
  "value_and_grad",
]
