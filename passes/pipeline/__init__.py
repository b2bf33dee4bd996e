"""Pipeline parallel: schedules as tables of actions, and one program that runs them.

One idea: a schedule is a stage x tick grid of small hashable actions (F, B,
W, transfers) that generation, validation, simulation, plotting and the
executor all read.

* `actions`: the action IR and its dependency rules.
* `schedule`: the table (`PipelineSchedule`), its validator and text form.
* `generate`: the named schedules (gpipe, 1f1b, ooo, zb-h1, zb-h2, interleaved, zb-v).
* `place`: per-stage orders placed on ticks and their transfers lowered (for
  `generate` and `steps`).
* `simulate`: a table's timeline under per-kind costs, and its plot.
* `steps`: a table tiled over several training steps (per-stage updates U),
  and its steady-state bubble per step.
* `flavor`: a stage's forward + vjp cut into F, B and W phases (`recompute`:
  which of F's cheap values B and W recompute instead of reading); `sliced` counts
  its GEMM operands that are rows of a stacked parameter (for `explain`).
* `execute`: a table lowered to one SPMD `shard_map` program.
* `cut`, `balance`: a plain loss cut into prologue, layers and epilogue, and its
  layers split over the virtual stages by the cost model; `stack` finds the
  layers in the loss's equations, `side` the per-example values they read,
  `state` the model state (BatchNorm statistics) that travels with them.
"""
