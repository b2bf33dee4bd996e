"""emit: re-bind the scheduled equations in the caller's trace.

Contract: `emit(split, schedule, consts, leaves, ordering=...) -> outputs`.

Under `jax.jit` the result is an XLA module that carries the schedule:

* each side-stream `Call` of the schedule (the dW clusters issued after one
  dX segment) becomes one non-inlined `call` with `_xla_stream_annotation`
  (via `compute_on("gpu_stream:1")`), the only form XLA GPU turns into an
  async call on another stream. Its outputs leave the call flattened, so a
  layout change (a conv filter comes back in cuDNN's layout) happens inside
  the call on the side stream rather than as a transpose right after it;
* the call's window is pinned by data, because XLA:GPU's latency-hiding
  scheduler never moves these calls (see `passes.ir.Call`): "barriers" ties
  the call's inputs to the anchor equation's inputs (the anchor cannot run
  before the call starts) and the call's outputs to the anchor's output (the
  done cannot come before the anchor), with `lax.optimization_barrier`,
  which compiles to tuples, not kernels;
* "control_deps" adds XLA control edges between consecutive side calls where
  XLA can keep them (the CPU compiler's control-dep-rewriter); the choice is
  made per lowering platform, so one trace compiles for CPU and for GPU;
* "scheduling_group" tags each call and the segment that runs beside it with
  one `_scheduling_group_id` (read by XLA's latency-hiding scheduler).

`ordering="auto"` is barriers plus control edges on CPU. Each unit's
equations run under `jax.named_scope("ooo_<unit>")`, so compiled HLO names
the unit in its op metadata.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from passes import _compat, scan_skew
from passes.ir import Call, Kind, Schedule, Split

ORDERINGS = ("auto", "barriers", "control_deps", "scheduling_group", "none")


def _read(env, v):
  return v.val if isinstance(v, _compat.Literal) else env[v]


def _run_eqns(eqns, env, skip=None, anchors=None):
  for k, eqn in eqns:
    if skip is not None and skip[k]:
      continue
    invals = [_read(env, v) for v in eqn.invars]
    hook = anchors.get(k) if anchors else None
    if hook is not None:
      invals = hook.before(invals)
    outs = _compat.bind_eqn(eqn, invals)
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, _compat.DropVar):
        env[v] = x
    if hook is not None:
      hook.after(outs)


def _cluster_io(jaxpr, eqn_ids: Sequence[int]):
  eqns = jaxpr.eqns
  defined = set()
  ins: list = []
  seen = set()
  for k in eqn_ids:
    for v in eqns[k].invars:
      if isinstance(v, _compat.Var) and v not in defined and v not in seen:
        seen.add(v)
        ins.append(v)
    defined.update(eqns[k].outvars)
  pos = _out_positions(jaxpr)
  outs = sorted({v for v in defined if v in pos}, key=pos.__getitem__)
  return ins, outs


_last_outs: list = [None, {}]  # (weakref to a jaxpr, its outvar -> first position)


def _out_positions(jaxpr) -> dict:
  # Built once per jaxpr: scanning all outputs per cluster was quadratic in depth.
  ref = _last_outs[0]
  if ref is None or ref() is not jaxpr:
    pos: dict = {}
    for i, v in enumerate(jaxpr.outvars):
      if isinstance(v, _compat.Var):
        pos.setdefault(v, i)
    _last_outs[:] = [weakref.ref(jaxpr), pos]
  return _last_outs[1]


def _on_stream(jaxpr, eqn_ids, env, stream: int) -> tuple[list, list, list, Any]:
  """Binds the equations as one stream-annotated call.

  The call returns one flat buffer per dtype (its outputs flattened and
  concatenated). Flat: the layout change XLA adds for a conv's filter
  gradient then happens inside the call, on the side stream, instead of as a
  transpose right after the done. One buffer: XLA schedules a done right
  before its first user, and the element reads of a multi-output done are
  users that the memory scheduler places early; a single output's first user
  is whatever the emitter ties it to.

  Returns (the call's operands, output vars, the flat buffers, unpack)
  where `unpack(buffers)` gives the outputs in their shapes; `env` gets
  them now.
  """
  ins, outs = _cluster_io(jaxpr, eqn_ids)
  eqns = [(k, jaxpr.eqns[k]) for k in eqn_ids]
  in_shapes = [tuple(np.shape(v.aval)) for v in ins]
  shapes = [tuple(np.shape(v.aval)) for v in outs]
  sizes = [int(np.prod(s)) for s in shapes]
  dtypes = list(dict.fromkeys(v.aval.dtype for v in outs))
  slot = [dtypes.index(v.aval.dtype) for v in outs]

  def body(*vals):
    local = {v: x.reshape(s) if len(s) >= 2 else x for v, x, s in zip(ins, vals, in_shapes)}
    _run_eqns(eqns, local)
    parts: list[list] = [[] for _ in dtypes]
    for v, i in zip(outs, slot):
      parts[i].append(local[v].reshape(-1))
    return tuple(p[0] if len(p) == 1 else jax.numpy.concatenate(p) for p in parts)

  def unpack(bufs):
    offset = [0] * len(dtypes)
    res = []
    for s, n, i in zip(shapes, sizes, slot):
      res.append(bufs[i][offset[i]:offset[i] + n].reshape(s))
      offset[i] += n
    return res

  # Inputs go in flat as well: a layout change XLA needs for an operand is
  # then made on the value the emitter pins (see `_Anchor.before`), not on a
  # copy the memory scheduler may compute late, holding back the start.
  flat_ins = [env[v].reshape(-1) if len(s) >= 2 else env[v] for v, s in zip(ins, in_shapes)]
  results = list(_compat.on_stream(body, stream, len(dtypes))(*flat_ins))
  env.update(zip(outs, unpack(results)))
  return flat_ins, outs, results, unpack


def _calls_of(sched: Schedule, units) -> tuple[Call, ...]:
  if sched.calls or len(sched.streams) < 2:
    return sched.calls
  # A schedule built by hand without calls: one call per side unit, no anchor.
  return tuple(Call((a.unit,), a.stream, units[a.unit].deps[0])
               for s in sched.streams[1:] for a in s)


class _Anchor:
  """The calls whose window closes at one main-stream equation.

  `before` ties the calls' inputs to the equation's inputs, so the equation
  cannot run before the calls start; `after` ties the calls' flat outputs to
  its output, so the calls' dones cannot be scheduled before it.
  """

  def __init__(self, env):
    self.env = env
    self.calls: list = []  # (input values, output vars, flat buffers, unpack)

  def before(self, invals):
    ins = [x for c in self.calls for x in c[0]]
    _, invals = jax.lax.optimization_barrier((ins, list(invals)))
    return invals

  def after(self, outs):
    # Tie the flat buffers themselves: any op on the done before the
    # barrier (a slice, a reshape) is a user XLA may schedule early.
    tied, _ = jax.lax.optimization_barrier(([c[2] for c in self.calls], outs[0]))
    # Again, chained: XLA's simplifier drops an unused barrier element whose
    # only user is the barrier (e.g. a layout bitcast of the anchor made for
    # it); two barriers make two users, so the anchor stays in both.
    tied, _ = jax.lax.optimization_barrier((tied, outs[0]))
    for (_, out_vars, _, unpack), flat in zip(self.calls, tied):
      self.env.update(zip(out_vars, unpack(flat)))


def emit(split: Split, sched: Schedule, consts: Sequence[Any],
         leaves: Sequence[Any], *, ordering: str = "auto",
         annotate: bool = True, collectives=None) -> list[Any]:
  """Evaluates the split jaxpr in schedule order in the current trace.

  Args:
    split: from `passes.split.split`.
    sched: from `passes.schedule.schedule` (units name equation indices of `split`).
    consts: values for the split's const inputs.
    leaves: the dynamic input leaves (arrays or tracers).
    ordering: one of `ORDERINGS` (see the module docstring).
    annotate: wrap side-stream calls in a stream-annotated call. False keeps
      the order but emits plain equations (the in-order baseline's form).
    collectives: a `passes.emit_collectives.BucketEmitter` (data-parallel
      mode): issues each gradient bucket's reduction after its last unit.

  Returns:
    The flat outputs `(value, *aux, *grads)`.
  """
  if ordering not in ORDERINGS:
    raise ValueError(f"ordering must be one of {ORDERINGS}, got {ordering!r}")
  barriers = annotate and ordering in ("auto", "barriers")
  edges = annotate and ordering in ("auto", "control_deps")
  # A split backward scan becomes one scan running B(i) and W(i-1) together
  # (W on stream 1 when annotating): one loop instead of 1 + #W-scans.
  # Data parallel: the loop all-reduces each layer's dW slice (passes.scan_collectives).
  split, sched = scan_skew.fuse(split, sched, stream=1 if annotate else None, pin=barriers,
                                reduce_ys=getattr(collectives, "reduce_ys", None))
  jaxpr = split.jaxpr.jaxpr
  ct_aval = jaxpr.invars[0].aval
  env: dict = {}
  ct = jax.lax.full((), 1, ct_aval.dtype)
  for v, x in zip(jaxpr.invars, [ct, *consts, *leaves]):
    env[v] = x
  dead = [k is Kind.DEAD for k in split.kinds]
  units = {u.name: u for u in sched.units}
  main = [units[a.unit] for a in sched.streams[0]]
  calls_after: dict[str, list[Call]] = {}
  for c in _calls_of(sched, units):
    calls_after.setdefault(c.after, []).append(c)
  anchors: dict[int, _Anchor] = {}
  side_outs: list = []

  def meta(gid):
    if ordering != "scheduling_group":
      return contextlib.nullcontext()
    from jax.experimental.xla_metadata import set_xla_metadata
    return set_xla_metadata(_scheduling_group_id=gid)

  for group, u in enumerate(main, 1):
    with jax.named_scope(f"ooo_{u.name}"), meta(group):
      _run_eqns([(k, jaxpr.eqns[k]) for k in u.eqns], env, dead, anchors)
    for c in calls_after.get(u.name, ()):
      eqn_ids = [k for name in c.units for k in units[name].eqns]
      label = "+".join(c.units)
      if not annotate:
        with jax.named_scope(f"ooo_{label}"):
          _run_eqns([(k, jaxpr.eqns[k]) for k in eqn_ids], env, dead)
        continue
      # the call runs beside the next segment: it shares that segment's group
      with jax.named_scope(f"ooo_{label}"), meta(group + 1):
        ins, outs, flat, unpack = _on_stream(jaxpr, eqn_ids, env, c.stream)
      if barriers and c.anchor >= 0 and outs:
        hook = anchors.setdefault(c.anchor, _Anchor(env))
        hook.calls.append((ins, outs, flat, unpack))
      if flat:
        side_outs.append(flat[0])
    if collectives is not None:
      collectives.after_unit(u.name, env)
  if edges and len(side_outs) > 1:
    _compat.control_deps(list(zip(side_outs, side_outs[1:])))
  outs = [_read(env, v) for v in jaxpr.outvars]
  return outs if collectives is None else collectives.outputs(outs, env)
