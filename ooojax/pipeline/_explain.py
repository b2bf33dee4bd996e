"""`ooo.pipeline.explain`: a pipeline schedule priced on the model it would run.

The table (`passes.pipeline.schedule`) says what runs where; the stage cut
(`passes.pipeline.program.program`: F / B / W phases of the user's stage
function, by the split pass) gives each phase a cost-model price, with which
the table's simulator (`passes.pipeline.simulate`) gives the bubble; the
same cut gives the bytes per device (`memory`). With a compile-only GPU the
report also reads, from the compiled tick loop, which collective-permutes
have the tick's compute inside their start..done window. Bubble and times
are simulated (cost model), never measured. The report itself, its summary and
plot, is `ooojax.pipeline._report`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from ooojax import _filter
from ooojax._explain_inputs import binds_unbound_axes
from ooojax.passes.pipeline.schedule import PipelineSchedule
from ooojax.pipeline import _modules
from ooojax.pipeline._report import AutoCut, PipelineReport, StageFsdp


@dataclasses.dataclass(frozen=True)
class _Call:
  stage_fn: Callable
  loss_fn: Callable
  stage_params: Any
  batch: Any
  shared: Any
  input_fn: Callable | None
  # (data axis, its size, the mesh's axis types by name) of a (data, stage) mesh: the
  # compiled step runs the table on every data replica, as `value_and_grad(data_axis=)`
  data: Any = None
  fsdp: Any = None  # per stage column, its dimension split over the data axis, or None


def _phase_costs(prog, device) -> tuple[tuple[str, float, float, float], ...]:
  from ooojax.passes.pipeline.lowering import phase_costs

  return phase_costs(prog, device)


def _schedule(schedule, stage_params, microbatches, chunks) -> PipelineSchedule:
  from ooojax.passes.pipeline.generate import SCHEDULES, generate
  from ooojax.pipeline._automatic import _table

  if not isinstance(schedule, str):  # a table (validated), or the TypeError
    return _table(schedule, 0, microbatches, chunks)
  if schedule not in SCHEDULES:
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
  leaves = jax.tree.leaves(stage_params)
  if not leaves or any(len(getattr(x, "shape", ())) < 1 for x in leaves):
    raise ValueError(
      "stage_params leaves must be arrays stacked on a leading axis of (virtual) stages"
    )
  v = leaves[0].shape[0]
  c = chunks or (2 if schedule in ("interleaved", "zb-v") else 1)
  if v % c:
    raise ValueError(f"stage_params hold {v} virtual stages, not a multiple of chunks={c}")
  return generate(schedule, v // c, microbatches or 2 * (v // c), chunks)


@binds_unbound_axes
def explain(
  fn: Callable,
  *args,
  schedule: str | PipelineSchedule | None = None,
  shared=None,
  input_fn: Callable | None = None,
  stages: int | None = None,
  mesh=None,
  axis_name: str | None = None,
  layers=None,
  has_aux: bool = False,
  microbatches: int | None = None,
  chunks: int | None = None,
  device: str = "H100",
  link: str | None = None,
  gpu: str | None = None,
  compiler_options=None,
  steps: int = 1,
  budget: int | None = None,
  state_argnums=(),
  data_axis: str | None = None,
  fsdp: str = "auto",
) -> PipelineReport:
  """The schedule, its simulated bubble and the memory per stage for this model.

  Two forms, as `ooo.pipeline.value_and_grad`: `explain(stage_fn, loss_fn,
  schedule, stage_params, batch, shared=None, input_fn=None)` (a stack written
  by hand), or `explain(loss_fn, params, *batch, stages=N or mesh=...,
  axis_name=..., schedule="ooo", layers=None, has_aux=False)` (the plain loss,
  cut and balanced as the automatic `value_and_grad` does; the report adds
  `cut`, an `AutoCut`, and `balance`, a `Balance`).

  Args:
    stage_fn, loss_fn, stage_params, batch, shared, input_fn: as for
      `ooo.pipeline.memory` / `value_and_grad`; arrays or `jax.ShapeDtypeStruct`s.
    schedule: a `PipelineSchedule`, or a name (`SCHEDULES`): then the stages
      are the leading axis of `stage_params` over `chunks`, and `microbatches`
      defaults to 2 x stages.
    device: the cost-model spec the phases are priced with.
    link: a network preset ("nvlink", "100GbE", ...) whose transfer of one
      activation delays each cross-device dependency in the simulation. With
      the schedule named "ooo", its in-flight depth is planned on this link
      (`ooo.pipeline.plan_ooo`, the executor's replay with the link's
      bandwidth shared): `report.depth` and the summary give the chosen depth,
      its peak activations, and the simulated step beside GPipe's and 1F1B's.
    budget: activations a stage may hold when planning "ooo" on a link
      (default GPipe's: the microbatches).
    gpu: "H100" / "H200" / "A100": also compile the step for compile-only
      GPUs (`ooojax.gpu_hlo`) and read the collective-permute windows.
    stages, mesh, axis_name, layers, has_aux, state_argnums: (automatic form) the
      stage count (or the mesh axis that sets it) and `value_and_grad`'s
      `layers`, `has_aux`, `state_argnums`.
    data_axis: (automatic form, with `mesh=`) the mesh axis the batch is split
      over, as in `value_and_grad`: `gpu=` compiles the (data, stage) step.
    fsdp: (with `data_axis`) as in `value_and_grad`: stack leaves whose
      sharding splits one of their dimensions over the data axis; the report's
      `fsdp` (a `StageFsdp`) names them, says what is gathered and when, and
      with "auto" which mode the step takes on the mesh's devices and why.
    steps: >= 2 also simulates the table tiled over that many training steps
      (`passes.pipeline.steps`): the per-step bubble beside the one-step
      bubble, and which actions of step t run during step t + 1's warm-up.

  Returns:
    A `PipelineReport`.

  >>> import jax.numpy as jnp, ooojax as ooo
  >>> from ooojax.models import mlp_stack
  >>> stage_fn, loss_fn, params, batch = mlp_stack.make(4, layers=4, dim=64, hidden=128)
  >>> r = ooo.pipeline.explain(stage_fn, loss_fn, "1f1b", params, batch, microbatches=8)
  >>> r.peak_activations, round(r.unit_bubble_fraction, 3)
  ((4, 3, 2, 1), 0.273)
  >>> z = ooo.pipeline.explain(stage_fn, loss_fn, "zb-h2", params, batch, microbatches=8,
  ...                          steps=3)
  >>> z.carried_actions        # this model's costs (B > F > W): stage 0 ends each step last
  ((), (), (), ())
  >>> import dataclasses       # F = B = W: the last stages drain under the next warm-up
  >>> unit = dataclasses.replace(z, costs={"F": 1.0, "B": 1.0, "W": 1.0})
  >>> unit.carried_actions[3], round(unit.steady_state().steady_bubble, 3)
  (('3W5', '3W6', '3W7', '3U'), 0.0)

  The automatic form, on a plain loss (shapes only):

  >>> def plain(w, x, t):
  ...   h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]
  ...   return jnp.mean((h - t) ** 2)
  >>> sd = jax.ShapeDtypeStruct((16, 64), jnp.float32)
  >>> a = ooo.pipeline.explain(plain, jax.ShapeDtypeStruct((8, 64, 64), jnp.float32), sd, sd,
  ...                          stages=4, schedule="1f1b", microbatches=8)
  >>> a.balance.counts, a.cut.layers, a.cut.scanned, a.peak_activations
  ((2, 2, 2, 2), 8, True, (4, 3, 2, 1))
  """
  plan = link is not None and schedule in ("ooo", None)
  kw = dict(
    microbatches=microbatches,
    chunks=chunks,
    device=device,
    link=link,
    gpu=gpu,
    compiler_options=compiler_options,
    steps=steps,
    budget=budget,
    plan=plan,
  )
  # A module is callable too: only a module (or a non-callable tree) is the automatic
  # form's parameters; any other callable is the explicit form's stage_fn.
  first = args[0] if args else None
  module = (
    _modules.filtered(first)
    if args and (_filter.holds_module(first) or not callable(first))
    else None
  )
  if module is not None:  # an Equinox module (callable, but the parameters): automatic
    fn, args = module.loss(fn), (module.diff, *args[1:])
  elif args and callable(args[0]):  # explicit: (stage_fn, loss_fn, schedule, ...)
    auto = {
      k: v
      for k, v in dict(
        stages=stages,
        mesh=mesh,
        axis_name=axis_name,
        layers=layers,
        has_aux=has_aux,
        state_argnums=state_argnums,
        data_axis=data_axis,
        fsdp=fsdp != "auto" and fsdp,
      ).items()
      if v
    }
    if auto:
      raise TypeError(
        f"{', '.join(auto)} belong to the automatic form explain(loss_fn, "
        "params, *batch, stages=...); the explicit form's schedule and "
        "stage_params set the stages"
      )
    bound = _bind(
      *args,
      **({} if schedule is None else {"schedule": schedule}),
      **({} if shared is None else {"shared": shared}),
      **({} if input_fn is None else {"input_fn": input_fn}),
    )
    return _explain(fn, *bound, **kw)
  if shared is not None or input_fn is not None:
    raise TypeError(
      "shared and input_fn belong to the explicit form explain(stage_fn, "
      "loss_fn, schedule, stage_params, batch, ...); the automatic form "
      "explain(loss_fn, params, *batch, stages=...) finds them itself"
    )
  if not args:
    raise TypeError(
      "explain(loss_fn, params, *batch, stages=...) needs the params and "
      "the batch (arrays or jax.ShapeDtypeStructs)"
    )
  ctx = jax.sharding.get_abstract_mesh()
  if gpu and mesh is not None and not ctx.empty and not _ON_GPUS:
    # a loss traced under the user's `jax.set_mesh` carries that mesh in its equations
    # (`reshard`, `out_sharding=`): traced again under compile-only GPUs of its shape
    g_mesh, args = _on_gpus(gpu, mesh, args)
    _ON_GPUS.append(True)
    try:
      with jax.set_mesh(g_mesh):
        return explain(
          fn,
          *args,
          schedule=schedule,
          stages=stages,
          mesh=g_mesh,
          axis_name=axis_name,
          layers=layers,
          has_aux=has_aux,
          state_argnums=state_argnums,
          data_axis=data_axis,
          fsdp=fsdp,
          **{k: v for k, v in kw.items() if k != "plan"},
        )
    finally:
      _ON_GPUS.pop()
  return _explain_auto(
    fn,
    args[0],
    args[1:],
    "ooo" if schedule is None else schedule,
    stages,
    mesh,
    axis_name,
    layers,
    has_aux,
    state_argnums=state_argnums,
    data_axis=data_axis,
    fsdp=fsdp,
    **kw,
  )


_ON_GPUS: list = []  # non-empty while explain re-traces under compile-only GPUs


def _on_gpus(gpu, mesh, args):
  """A mesh of compile-only `gpu`s of `mesh`'s shape, names and axis types, and `args`
  as structs placed on it with the same specs."""
  from ooojax import gpu_hlo

  names = tuple(mesh.axis_names)
  g = gpu_hlo.mesh(gpu, tuple(mesh.shape[a] for a in names), names)
  types = tuple(getattr(mesh, "axis_types", ()) or ())
  if len(types) == len(names):
    g = jax.sharding.Mesh(g.devices, names, axis_types=types)

  def put(x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      return x
    s = getattr(x, "sharding", None)
    spec = s.spec if isinstance(s, jax.sharding.NamedSharding) else jax.sharding.PartitionSpec()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(g, spec))

  return g, jax.tree.map(put, args)


def _batch_name(b_named, i: int) -> str:
  """A batch leaf's name; past the user's leaves, a scalar key's whole-batch split
  (`ooojax.pipeline._example_keys`), in the order of the keys."""
  if i < len(b_named):
    return "batch" + jax.tree_util.keystr(b_named[i][0])
  keys = [
    p
    for p, x in b_named
    if not jax.numpy.ndim(x)
    and jax.dtypes.issubdtype(jax.numpy.result_type(x), jax.dtypes.prng_key)
  ]
  return f"split(batch{jax.tree_util.keystr(keys[i - len(b_named)])})"


def _bind(loss_fn, schedule, stage_params, batch, shared=None, input_fn=None):
  return loss_fn, schedule, stage_params, batch, shared, input_fn


def _explain_auto(
  loss_fn,
  params,
  batch,
  schedule,
  stages,
  mesh,
  axis_name,
  layers,
  has_aux,
  *,
  microbatches,
  chunks,
  state_argnums=(),
  data_axis=None,
  fsdp="auto",
  **kw,
) -> PipelineReport:
  """The automatic form: `loss_fn` cut and balanced by `ooojax.pipeline._automatic._auto_parts`
  (what the automatic `value_and_grad` runs), then the explicit form's report."""
  from ooojax.pipeline._automatic import _auto_parts, _table, state_leaves
  from ooojax.pipeline._tiled import _owners

  if (stages is None) == (mesh is None):
    raise TypeError("give the automatic form one of stages=N or mesh=... with axis_name=...")
  if mesh is not None:
    if axis_name not in mesh.shape:
      raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    stages = mesh.shape[axis_name]
  data = None
  if data_axis is not None:
    if mesh is None or data_axis not in mesh.shape or data_axis == axis_name:
      raise ValueError(
        f"data_axis={data_axis!r} must name another axis of mesh= (its axes: "
        f"{dict(mesh.shape) if mesh is not None else None}), as in value_and_grad"
      )
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    data = (data_axis, mesh.shape[data_axis], types)
  sched = _table(schedule, stages, microbatches, chunks)
  named, p_tree = jax.tree_util.tree_flatten_with_path(params)
  leaves = [x for _, x in named]
  sds = lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x))  # noqa: E731
  p_avals = [sds(x) for x in leaves]
  b_avals = jax.tree.map(sds, batch)
  parts = _auto_parts(
    loss_fn,
    has_aux,
    sched,
    1,
    p_avals,
    p_tree,
    b_avals,
    layers,
    state=state_leaves(batch, state_argnums),
  )
  c, counts, (stage_fn, lfn, ifn) = parts.cut, parts.balance.counts, parts.fns
  epi = lfn  # the loss and the aux (with has_aux): what the last stage reads
  if c.n_aux:  # the aux is a few values of the last stage's F: priced with the loss
    lfn = lambda y, tg, sh: epi(y, tg, sh)[0]  # noqa: E731
  stage_params = jax.eval_shape(  # with model state: its columns and probes after
    lambda ls, bs: c.stage_params(ls, counts) + c.stage_state(bs, counts),
    p_avals,
    jax.tree.leaves(b_avals),
  )
  rows = jax.eval_shape(lambda bs: parts.rowed(bs), jax.tree.leaves(b_avals))
  shared = tuple(p_avals[i] for i in c.shared)
  from ooojax.passes.pipeline.fsdp import FSDP_MODES, choose, spec_name, stack_dims

  if fsdp not in FSDP_MODES:
    raise ValueError(f"fsdp={fsdp!r}: use one of {FSDP_MODES}")
  split = None if data is None else stack_dims(leaves, c, counts, data_axis)
  choice = split and choose(  # what the step runs: its mesh's devices' memory
    fsdp, jax.tree.leaves(stage_params), split, stages, sched.microbatches, data[1], spec_name(mesh)
  )
  report = _explain(
    stage_fn,
    lfn,
    sched,
    stage_params,
    rows,
    shared,
    ifn,
    microbatches=None,
    chunks=None,
    data=data,
    fsdp=split if choice and choice.mode == "regather" else None,
    **kw,
  )
  # the ends as a stage runs them: on one microbatch (their equations were traced at
  # its shapes, so the whole batch would not broadcast against them)
  mb = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((x.shape[0] // sched.microbatches, *x.shape[1:]), x.dtype), rows
  )
  own = _owners(ifn, epi, mb[0], mb[1], shared, sched.virtual_stages) if shared else []
  name = lambda i: jax.tree_util.keystr(named[i][0]) or "params"  # noqa: E731
  b_named = jax.tree_util.tree_flatten_with_path(tuple(batch))[0]
  pick = lambda o: tuple(name(i) for i, w in zip(c.shared, own) if w == o)  # noqa: E731
  info = AutoCut(
    c.layers,
    c.scanned,
    c.reverse,
    tuple(name(i) for i in c.stacked[0]),
    pick(0),
    pick(sched.virtual_stages - 1),
    pick(None),
    tuple(_batch_name(b_named, i) for i in c.side),
  )
  return dataclasses.replace(
    report,
    cut=info,
    balance=parts.balance,
    fsdp=split and _stage_fsdp(choice, data, split, stage_params, sched, c, name),
  )


def _stage_fsdp(choice, data, split, stage_params, sched, c, name) -> StageFsdp:
  r = len(split) // len(c.stacked[0])  # stage columns per leaf of a layer
  cols = jax.tree.leaves(stage_params)[: len(split)]
  return StageFsdp(
    choice.mode,
    data[0],
    data[1],
    tuple(name(i) for k, i in enumerate(c.stacked[0]) if split[k * r] is not None),
    sum(x.size * x.dtype.itemsize // sched.stages for x, d in zip(cols, split) if d is not None),
    sched.chunks,
    choice.asked,
    choice.reason,
  )


def _explain(
  stage_fn,
  loss_fn,
  schedule,
  stage_params,
  batch,
  shared,
  input_fn,
  *,
  microbatches,
  chunks,
  device,
  link,
  gpu,
  compiler_options,
  steps,
  budget=None,
  plan=False,
  data=None,
  fsdp=None,
) -> PipelineReport:
  from ooojax.passes.collectives.plan import get_link
  from ooojax.passes.cost import get_spec
  from ooojax.passes.pipeline.program import memory_of, program

  if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
    raise ValueError(f"steps must be an int >= 1, got {steps!r}")
  sched = _schedule(schedule, stage_params, microbatches, chunks)
  if sched.steps != 1:
    raise ValueError(
      f"explain a one-step table and pass steps={sched.steps} (the table "
      f"{sched.name!r} is already tiled over {sched.steps} steps)"
    )
  # B and W recompute what the device's programs recompute of F's values
  platform = "cpu" if get_spec(device).name == "CPU" else "gpu"
  prog = program(stage_fn, loss_fn, sched, stage_params, batch, shared, input_fn, platform)
  phases = _phase_costs(prog, device)
  # lock-step ticks: the slowest stage kind sets each phase's pace; per whole stage
  costs = {k: max(p[i] for p in phases) * sched.chunks for i, k in enumerate("FBW", 1)}
  x = prog.x_aval
  act = x.size * x.dtype.itemsize
  comm = get_link(link).seconds(act) if link is not None else 0.0
  depth = None
  if plan and sched.name == "ooo" and sched.chunks == 1:  # the depth, planned on the link
    from ooojax.passes.pipeline.depth import plan_ooo
    from ooojax.passes.pipeline.link import LinkModel

    sched, depth = plan_ooo(
      sched.stages, sched.microbatches, costs, LinkModel.of(link, act), budget, lag=sched.lag
    )
    prog = program(stage_fn, loss_fn, sched, stage_params, batch, shared, input_fn, platform)
  name = get_spec(device).name  # a ValueError naming the specs for an unknown one
  from ooojax.passes.pipeline.sliced import sliced

  report = PipelineReport(
    sched,
    costs,
    comm,
    memory_of(prog, sched, stage_params),
    name,
    get_link(link).name if link is not None else "",
    phases,
    call=_Call(stage_fn, loss_fn, stage_params, batch, shared, input_fn, data, fsdp),
    steps=steps,
    depth=depth,
    sliced_weights=max(sliced(fl) for fl in prog.flavors),
  )
  return report.compiled(gpu, compiler_options=compiler_options) if gpu else report
