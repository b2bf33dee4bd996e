"""The model matrix: every `features` case in every mode, against `jax.grad`.

`cell(case, mode)` runs one cell and returns `(got, want)` (gradient trees
with the aux output), or raises what the mode raises. `h100(case)` compiles
the single-GPU gradient for a compile-only H100 and counts heavy dW calls
overlapped. The tests (`tests/test_matrix.py`) assert on these; the results
table (`benchmarks/matrix.py`) prints them.

Modes:
  in_order, single_gpu: `ooo.grad` on one device (under `jax.shard_map` over
    the data axis when the loss names it), single_gpu with the H100 cost model
    so dW clusters really go to stream 1;
  dp_shard_map, dp_pmap: `mode="data_parallel"` with the batch split over the
    data axis, against `pmean(jax.grad)`;
  pipeline: `ooo.pipeline.value_and_grad` of the case's `Stack` on 2 stages,
    against `jax.value_and_grad` of the unrolled stack (cases without a stack:
    `NotAStack`);
  pipeline_auto: `ooo.pipeline.value_and_grad(case.loss, ...)`, the stages cut
    by ooojax from the unmodified loss, against `jax.value_and_grad` of the
    loss averaged over the microbatches, microbatch m with the scalar key
    `fold_in(key, m)` (a model it cannot cut: `CutError`). A loss that names
    the data axis runs on a data x stage mesh (`data_axis`), against that
    microbatch loop in `shard_map` over the data axis (replica d of microbatch
    m: its rows [m, d]), `pmean`-ed.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import ooojax as ooo
from ooojax import gpu_hlo
from ooojax.models.features import AXIS, Case

MODES = ("in_order", "single_gpu", "dp_shard_map", "dp_pmap", "pipeline", "pipeline_auto")
DEVICES = 4  # data-axis size for the mapped cells
STAGES = 2


class NotAStack(Exception):
  """The case's model is not a stack of identical blocks: no pipeline cell."""


def _jit(f):
  # correctness cells compile at XLA O0: a third less compile time on 2 cores
  return jax.jit(f, compiler_options={"xla_backend_optimization_level": 0})


def _grad(case: Case, mode: str, **kw):
  if mode == "jax":
    return jax.grad(case.loss, has_aux=True)
  if mode.startswith("dp_"):
    return ooo.grad(case.loss, has_aux=True, mode="data_parallel", axis_name=AXIS, **kw)
  return ooo.grad(
    case.loss, has_aux=True, mode=mode, **({"device": "H100"} if mode == "single_gpu" else {}), **kw
  )


def _per_device(case: Case, mode: str):
  """The mean over the data axis of each device's gradient (data_parallel
  reduces it itself), and the aux output."""
  g = _grad(case, mode)

  def f(*args):
    grads, aux = g(*args)
    if not mode.startswith("dp_"):
      grads = jax.lax.pmean(grads, AXIS)
    return grads, aux

  return f


def _specs(case: Case):
  return (P(),) + tuple(P(AXIS) if s else P() for s in case.split)


def _shard_map(case: Case, mode: str, devices: int):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), (AXIS,))
  return _jit(
    jax.shard_map(
      _per_device(case, mode),
      mesh=mesh,
      in_specs=_specs(case),
      out_specs=(P(), P()),
      check_vma=False,
    )
  )(*case.args)


def _pmap(case: Case, mode: str, devices: int):
  def place(a, split):
    if split:
      return a.reshape(devices, -1, *a.shape[1:])
    return jax.tree.map(lambda x: jax.numpy.stack([x] * devices), a)

  args = [place(case.params, False)] + [place(a, s) for a, s in zip(case.batch, case.split)]
  out = jax.pmap(_per_device(case, mode), axis_name=AXIS, devices=jax.devices()[:devices])(*args)
  return jax.tree.map(lambda a: a[0], out)


def _per_stage(s, stages: int):
  """Blocks grouped `stages` ways: params (L, ...) -> (stages, L/stages, ...),
  and a stage function that runs its L/stages blocks in order."""
  blocks = jax.tree.leaves(s.params)[0].shape[0]
  if blocks % stages:
    raise ValueError(f"{blocks} blocks do not split over {stages} (virtual) stages")
  per = blocks // stages
  params = jax.tree.map(lambda a: a.reshape(stages, per, *a.shape[1:]), s.params)

  def stage_fn(p, h):
    for j in range(per):
      h = s.stage_fn(jax.tree.map(lambda a, j=j: a[j], p), h)
    return h

  return stage_fn, params


def _pipeline(case: Case, schedule: str):
  s = case.stack
  if s is None:
    raise NotAStack(f"{case.name} is not a stack of identical blocks")
  mesh = jax.make_mesh((STAGES,), ("stage",), devices=jax.devices()[:STAGES])
  sched = ooo.pipeline.schedule(schedule, STAGES, 2 * STAGES)
  stage_fn, params = _per_stage(s, sched.virtual_stages)
  step = ooo.pipeline.value_and_grad(
    stage_fn, s.loss_fn, mesh=mesh, axis_name="stage", schedule=sched, input_fn=s.input_fn
  )
  got = _jit(step)(params, (s.inputs, s.targets), s.shared)

  # the pipeline's model: the mean over microbatches of the unrolled stack's loss
  micro = sched.microbatches

  def loss(params, *shared):
    total = 0.0
    for x, t in zip(
      *(
        jax.tree.map(lambda a: a.reshape(micro, -1, *a.shape[1:]), b) for b in (s.inputs, s.targets)
      )
    ):
      h = x if s.input_fn is None else s.input_fn(x, *shared)
      for j in range(sched.virtual_stages):
        h = stage_fn(jax.tree.map(lambda a, j=j: a[j], params), h)
      total = total + s.loss_fn(h, t, *shared)
    return total / micro

  extra = () if s.shared is None else (s.shared,)
  want = _jit(jax.value_and_grad(loss, argnums=tuple(range(1 + len(extra)))))(params, *extra)
  if s.shared is None:
    want = (want[0], want[1][0])
  return got, want


def _pipeline_auto(case: Case, schedule: str):
  if case.axis is not None:
    return _pipeline_auto_data(case, schedule)
  mesh = jax.make_mesh((STAGES,), ("stage",), devices=jax.devices()[:STAGES])
  sched = ooo.pipeline.schedule(schedule, STAGES, 2 * STAGES)
  step = ooo.pipeline.value_and_grad(
    case.loss, mesh=mesh, axis_name="stage", schedule=sched, has_aux=True
  )
  (loss, _), grads = _jit(step)(case.params, *case.batch)
  micro = sched.microbatches

  def mean_loss(params):  # batch leaves split on their leading axis, scalars whole
    total = 0.0
    for m in range(micro):
      part = jax.tree.map(lambda a: _micro(a, micro, m), case.batch)
      total = total + case.loss(params, *part)[0]
    return total / micro

  return (loss, grads), _jit(jax.value_and_grad(mean_loss))(case.params)


def _state_argnums(case: Case) -> tuple[int, ...]:
  """The batch arguments that are model state (BatchNorm statistics): arrays the
  case does not split over the data axis."""
  return tuple(
    i + 1
    for i, (a, s) in enumerate(zip(case.batch, case.split))
    if not s and not any(jax.numpy.ndim(x) == 0 for x in jax.tree.leaves(a))
  )


def _micro(a, micro: int, m: int):
  """Microbatch m of a batch leaf: its rows, a scalar whole, a scalar key folded
  with m (what the pipeline hands microbatch m)."""
  if ooo.pipeline.is_key(a) and a.ndim == 0:
    return jax.random.fold_in(a, m)
  if a.ndim == 0:
    return a
  return a.reshape(micro, -1, *a.shape[1:])[m]


def _pipeline_auto_data(case: Case, schedule: str):
  """A loss that names the data axis: data x stage mesh (`data_axis`), against the
  microbatch loop in `shard_map` over the data axis (replica d of microbatch m gets
  its rows [m, d]), pmean-ed."""
  data, state = DEVICES // STAGES, _state_argnums(case)
  mesh = jax.make_mesh((data, STAGES), (AXIS, "stage"), devices=jax.devices()[:DEVICES])
  sched = ooo.pipeline.schedule(schedule, STAGES, 2 * STAGES)
  step = ooo.pipeline.value_and_grad(
    case.loss,
    mesh=mesh,
    axis_name="stage",
    schedule=sched,
    has_aux=True,
    data_axis=AXIS,
    state_argnums=state,
  )
  (loss, _), grads = _jit(step)(case.params, *case.batch)
  micro = sched.microbatches
  # the split leaves as (data, micro, rows, ...): replica d's rows of every microbatch
  by_replica = [
    jax.numpy.swapaxes(a.reshape(micro, data, -1, *a.shape[1:]), 0, 1) if s else a
    for a, s in zip(case.batch, case.split)
  ]

  def per_replica(params, *batch):
    def mean_loss(p):
      total = 0.0
      for m in range(micro):
        part = [
          b[0, m] if s else b if i + 1 in state else _micro(b, micro, m)
          for i, (b, s) in enumerate(zip(batch, case.split))
        ]
        total = total + case.loss(p, *part)[0]
      return total / micro

    return jax.lax.pmean(jax.value_and_grad(mean_loss)(params), AXIS)

  dmesh = jax.sharding.Mesh(np.array(jax.devices()[:data]), (AXIS,))
  want = _jit(
    jax.shard_map(
      per_replica,
      mesh=dmesh,
      in_specs=(P(),) + tuple(P(AXIS) if s else P() for s in case.split),
      out_specs=P(),
      check_vma=False,
    )
  )(case.params, *by_replica)
  return (loss, grads), want


def cell(case: Case, mode: str, *, devices: int = DEVICES, schedule: str = "1f1b"):
  """`(got, want)` for one cell; raises what ooo raises (jax.grad's error
  type in an error case, checked by the caller)."""
  if mode not in MODES:
    raise ValueError(f"unknown matrix mode {mode!r}; allowed: {MODES}")
  if mode == "pipeline":
    return _pipeline(case, schedule)
  if mode == "pipeline_auto":
    return _pipeline_auto(case, schedule)
  if mode == "dp_pmap":
    return _pmap(case, mode, devices), _pmap(case, "jax", devices)
  if case.axis is not None or mode == "dp_shard_map":
    return _shard_map(case, mode, devices), _shard_map(case, "jax", devices)
  return _jit(_grad(case, mode))(*case.args), _jit(_grad(case, "jax"))(*case.args)


def h100(case: Case, *, devices: int = DEVICES):
  """`(k, n)`: heavy dW calls overlapped with dX work, of all heavy dW calls, in
  the single-GPU gradient compiled for a compile-only H100."""
  sd = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
  g = _grad(case, "single_gpu")
  if case.axis is None:
    s = gpu_hlo.schedule(g, *jax.tree.map(sd, case.args))
  else:
    mesh = gpu_hlo.mesh("H100", devices, (AXIS,))
    fn = jax.jit(
      jax.shard_map(
        _per_device(case, "single_gpu"),
        mesh=mesh,
        in_specs=_specs(case),
        out_specs=(P(), P()),
        check_vma=False,
      )
    )
    s = gpu_hlo.schedule(fn, *jax.tree.map(sd, case.args), mesh=mesh)
  return s.heavy_overlap()
