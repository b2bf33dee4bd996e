"""Schedule tables by name, the XLA options their steps compile with, and the bytes a
table needs per device (shapes only): `ooo.pipeline.schedule`, `compiler_options`,
`memory`."""

from __future__ import annotations

from collections.abc import Callable

from ooojax.passes.pipeline.depth import plan_ooo
from ooojax.passes.pipeline.execute import xla_options
from ooojax.passes.pipeline.generate import generate
from ooojax.passes.pipeline.link import LinkModel
from ooojax.passes.pipeline.program import Memory, memory as _memory
from ooojax.passes.pipeline.schedule import PipelineSchedule
from ooojax.passes.pipeline.steps import tile

__all__ = ["compiler_options", "memory", "schedule"]


def compiler_options(schedule: PipelineSchedule) -> dict:
  """The XLA options to compile a step of `schedule` with, for its transfers to
  run beside its compute on a GPU: `jax.jit(step, compiler_options=...)`.

  A lag-1 table (`schedule(..., lag=1)`) on more than 2 stages sends each
  tick's output on two rings, up and down, before the tick's action. XLA:GPU's
  scheduler keeps one collective in flight by default, so only one ring runs
  beside the action; these options allow both. Otherwise the dict is empty.
  `make_train_step` and `explain(...).compiled()` apply them themselves (options
  you pass win); other backends ignore them.

  >>> import ooojax as ooo
  >>> ooo.pipeline.compiler_options(ooo.pipeline.schedule("ooo", 4, 8, lag=1))
  {'xla_gpu_experimental_parallel_collective_overlap_limit': 2}
  >>> ooo.pipeline.compiler_options(ooo.pipeline.schedule("ooo", 4, 8))
  {}
  """
  if not isinstance(schedule, PipelineSchedule):
    raise TypeError(
      f"compiler_options takes a PipelineSchedule (ooo.pipeline.schedule(...)), got "
      f"{type(schedule).__name__}"
    )
  return xla_options(schedule)


def schedule(
  name: str,
  stages: int,
  microbatches: int,
  chunks: int | None = None,
  lag: int = 0,
  steps: int = 1,
  *,
  link: LinkModel | None = None,
  costs=None,
  budget: int | None = None,
  mode: str = "executor",
) -> PipelineSchedule:
  """A validated schedule table by name (one of `SCHEDULES`).

  Args:
    name: "gpipe", "1f1b", "ooo" (gradient fast-forwarding), "zb-h1", "zb-h2",
      "interleaved" (modulo allocation, `chunks` virtual stages per device) or
      "zb-v" (two chunks per device in a V: device s holds blocks s and 2S-1-s).
    stages: pipeline stages (devices on the stage mesh axis).
    microbatches: microbatches per step.
    chunks: virtual stages per device for "interleaved" (default 2).
    lag: 1 receives each transfer one tick after its send, so the executor
      overlaps it with the next tick's compute (more ticks, hidden transfers).
    steps: training steps laid out in one table (`tile`): step t + 1's
      forwards on a stage start once that stage's update of step t is done,
      so one step's drain overlaps the next one's warm-up. Run such a table
      with `train` (`value_and_grad` runs one-step tables).
    link: for "ooo" only, a `LinkModel` (latency, bandwidth, bytes per
      transfer): the in-flight depth is planned on it (`plan_ooo`): the
      fastest table, simulated on that link with `costs`, that holds at most
      `budget` activations per stage (default GPipe's, `microbatches`).
      GPipe's and 1F1B's own tables are candidates, so on that link the result
      is never slower than either at the same memory.
    costs: `{"F", "B", "W"}` seconds per whole stage for planning with `link`.
    budget: activations a stage may hold when planning with `link`.
    mode: how the planner replays a table: "executor" (this package's tick
      loop, transfers after each tick's compute) or "overlap" (asynchronous
      transfers beside compute).

  Returns:
    A `PipelineSchedule`: `validate()`, `bubble_fraction(costs)`,
    `peak_activations()`, `simulate()`, `plot()`, `to_text()`, `print()`.

  >>> s = schedule("ooo", stages=2, microbatches=2)
  >>> print(s.to_text().splitlines()[1])
  0F0+0SF0 0F1+0SF1 0RB0 0B0 0W0+0RB1 0B1 0W1
  """
  if link is not None:
    if name != "ooo":
      raise ValueError(
        f"link= plans the in-flight depth of 'ooo' only, not {name!r}; "
        "compare other tables with passes.pipeline.link.simulate_link"
      )
    return tile(plan_ooo(stages, microbatches, costs, link, budget, mode, lag)[0], steps)
  return tile(generate(name, stages, microbatches, chunks, lag), steps)


def memory(
  stage_fn: Callable,
  loss_fn: Callable,
  schedule: PipelineSchedule,
  stage_params,
  batch,
  shared=None,
  input_fn: Callable | None = None,
) -> Memory:
  """Bytes per device of the pipelined step, from shapes alone (arrays or
  `jax.ShapeDtypeStruct`s): `weights`, `grads`, `fres` / `bres` (one
  microbatch's residual records), `peak`, `slots`, and `bound` (weights +
  gradients + peak x records: what the schedule needs).

  >>> import jax, jax.numpy as jnp
  >>> sd = jax.ShapeDtypeStruct
  >>> m = memory(lambda w, x: jnp.tanh(x @ w), lambda y, t: jnp.mean((y - t) ** 2),
  ...            schedule("1f1b", stages=2, microbatches=4), sd((2, 64, 64), jnp.float32),
  ...            (sd((16, 64), jnp.float32), sd((16, 64), jnp.float32)))
  >>> m.weights, m.peak    # one 64x64 f32 stage per device; 1F1B keeps 2 microbatches
  (16384, 2)
  >>> m.fres               # x and tanh(x w), 2 x 4 x 64 f32 (B recomputes y - t)
  2048
  """
  return _memory(stage_fn, loss_fn, schedule, stage_params, batch, shared, input_fn)
