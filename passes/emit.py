"""emit: re-bind the scheduled equations in the caller's trace.

Contract: `emit(split, schedule, consts, leaves, ordering=...) -> outputs`.

Under `jax.jit` the result is an XLA module that carries the schedule:

* each dW cluster placed on stream 1 becomes one non-inlined `call` with
  `_xla_stream_annotation` (via `compute_on2("gpu_stream:1")`), the only form
  XLA GPU turns into an async call on another stream;
* the stream-1 order is pinned at cluster granularity, so XLA may still fuse
  freely inside each cluster and along the dX chain. Ordering mechanisms:
  "control_deps" (an XLA control edge between consecutive stream-1 calls),
  "scheduling_group" (`_scheduling_group_id` metadata tying each dW cluster
  to the dX segment that feeds it, read by XLA's latency-hiding scheduler),
  or "none".
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import jax

from passes import _compat
from passes.ir import Kind, Schedule, Split

ORDERINGS = ("control_deps", "scheduling_group", "none")


def _read(env, v):
  return v.val if isinstance(v, _compat.Literal) else env[v]


def _run_eqns(eqns, env, skip=None):
  for k, eqn in eqns:
    if skip is not None and skip[k]:
      continue
    outs = _compat.bind_eqn(eqn, [_read(env, v) for v in eqn.invars])
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, _compat.DropVar):
        env[v] = x


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


def _on_stream(jaxpr, eqn_ids, env, stream: int) -> list:
  ins, outs = _cluster_io(jaxpr, eqn_ids)
  eqns = [(k, jaxpr.eqns[k]) for k in eqn_ids]

  def body(*vals):
    local = dict(zip(ins, vals))
    _run_eqns(eqns, local)
    return tuple(local[v] for v in outs)

  results = _compat.on_stream(body, stream, len(outs))(*[env[v] for v in ins])
  for v, x in zip(outs, results):
    env[v] = x
  return list(results)


def emit(split: Split, sched: Schedule, consts: Sequence[Any],
         leaves: Sequence[Any], *, ordering: str = "control_deps",
         annotate: bool = True) -> list[Any]:
  """Evaluates the split jaxpr in schedule order in the current trace.

  Args:
    split: from `passes.split.split`.
    sched: from `passes.schedule.schedule` (units name equation indices of `split`).
    consts: values for the split's const inputs.
    leaves: the dynamic input leaves (arrays or tracers).
    ordering: one of `ORDERINGS`.
    annotate: wrap stream-1 clusters in a stream-annotated call. False keeps
      the order but emits plain equations (the in-order baseline's form).

  Returns:
    The flat outputs `(value, *aux, *grads)`.
  """
  if ordering not in ORDERINGS:
    raise ValueError(f"ordering must be one of {ORDERINGS}, got {ordering!r}")
  if ordering == "control_deps" and jax.default_backend() == "gpu":
    # XLA's control-dep-rewriter runs in the CPU compiler only; on GPU the
    # custom call reaches codegen and fails ("No FFI handler ... control_dep").
    raise ValueError("ordering='control_deps' does not compile on GPU (XLA GPU has no "
                     "control-dep-rewriter pass); use ordering='scheduling_group' or "
                     "'none' (the GPU default).")
  jaxpr = split.jaxpr.jaxpr
  ct_aval = jaxpr.invars[0].aval
  env: dict = {}
  ct = jax.lax.full((), 1, ct_aval.dtype)
  for v, x in zip(jaxpr.invars, [ct, *consts, *leaves]):
    env[v] = x
  dead = [k is Kind.DEAD for k in split.kinds]
  units = {u.name: u for u in sched.units}
  main = list(sched.streams[0])
  side = list(sched.streams[1]) if len(sched.streams) > 1 else []
  side_after: dict[str, list] = {}
  for a in side:
    side_after.setdefault(units[a.unit].deps[0], []).append(a)

  prev_side_out = None
  group = 0

  def meta(gid):
    if ordering != "scheduling_group":
      return contextlib.nullcontext()
    from jax.experimental.xla_metadata import set_xla_metadata
    return set_xla_metadata(_scheduling_group_id=gid)

  for a in main:
    u = units[a.unit]
    group += 1
    with meta(group):
      # `ooo_<unit>` in every op's name stack maps compiled HLO back to units
      # (passes.hlo_compare reads it from op_name metadata).
      with jax.named_scope(f"ooo_{a.unit}"):
        _run_eqns([(k, jaxpr.eqns[k]) for k in u.eqns], env, dead)
      for s in side_after.get(a.unit, ()):
        w = units[s.unit]
        with jax.named_scope(f"ooo_{s.unit}"):
          if annotate:
            outs = _on_stream(jaxpr, w.eqns, env, s.stream)
          else:
            _run_eqns([(k, jaxpr.eqns[k]) for k in w.eqns], env, dead)
            outs = [env[v] for v in _cluster_io(jaxpr, w.eqns)[1]]
        if ordering == "control_deps" and outs:
          if prev_side_out is not None:
            _compat.control_dep(prev_side_out, outs[0])
          prev_side_out = outs[0]
  return [_read(env, v) for v in jaxpr.outvars]

