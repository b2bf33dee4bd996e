"""emit: re-bind the scheduled equations in the caller's trace.

Contract: `emit(split, schedule, consts, leaves, ordering=...) -> outputs`.

Under `jax.jit` the result is an XLA module that carries the schedule:

* each side-stream `Call` of the schedule (the dW clusters issued after one
  dX segment) becomes one non-inlined `call` with `_xla_stream_annotation`
  (via `compute_on("gpu_stream:1")`), the only form XLA GPU turns into an
  async call on another stream. Its outputs leave the call flattened, so a
  layout change (a conv filter comes back in cuDNN's layout) happens inside
  the call on the side stream rather than as a transpose right after it;
  under Explicit mesh axes (a type that names a mesh axis) the operands and
  outputs go in and out as they are (`_compat.sharded_over_mesh`);
* the call's window is pinned by data (see `passes.ir.Call`): "barriers"
  ties the call's inputs to the anchor equation's inputs (the anchor cannot
  run before the call starts) and the call's outputs to the anchor's output,
  whose readers read the tied copy (the done comes after the anchor and
  before its readers), with `lax.optimization_barrier`, which compiles to
  tuples, not kernels; a call that waits (`Call.wait`, at most two in
  flight: `passes.slots`) ties its inputs to the awaited call's outputs;
* "control_deps" adds XLA control edges between consecutive side calls where
  XLA can keep them (the CPU compiler's control-dep-rewriter); the choice is
  made per lowering platform, so one trace compiles for CPU and for GPU;
* "scheduling_group" tags each call and the segment that runs beside it with
  one `_scheduling_group_id` (read by XLA's latency-hiding scheduler).

In a module partitioned over several devices (GSPMD: a sharded jit, or a
`shard_map` leaving mesh axes automatic) the control edges are left out and
the stream calls lower inline, barriers kept (`passes._compat.on_stream`,
`control_deps`; docs/guides/sharded-jit.md says why).

`ordering="auto"` is barriers plus control edges on CPU. Each unit's
equations run under `jax.named_scope("ooo_<unit>")`, so compiled HLO names
the unit in its op metadata.

Under a staging trace (`jit`, `make_jaxpr`) the program is not re-bound
equation by equation: the traced equations themselves, in schedule order,
with the stream calls and barriers built as equations beside them, go into
one nested `jit` equation (`passes.stage.CallStager`; XLA inlines the call), so
emission costs about one object per equation and the caller's trace holds a
single equation. Elsewhere (eager, under `vmap`) each equation is bound.

The stream calls, the anchors that pin their windows and the late-bound
leaves of the deferred step live in `passes.stream_calls`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax

from ooojax.passes import _compat, stage
from ooojax.passes.ir import Call, Kind, Schedule, Split
from ooojax.passes.scan import skew as scan_skew
from ooojax.passes.stream_calls import (
  Anchor,
  Close,
  Late,
  LateLeaves,
  anchor_folds,
  calls_of,
  on_stream,
)

ORDERINGS = ("auto", "barriers", "control_deps", "scheduling_group", "none")


def _read(env, v):
  return v.val if isinstance(v, _compat.Literal) else env[v]


class _Lifetimes:
  """Frees what emission no longer needs, so two programs are not held at once.

  A value leaves `env` after its last reader is emitted; with `consume`, an
  emitted source equation also leaves the source jaxpr (the caller owns it).
  The stacks dict shares name stacks across `_compat.emit_eqns` calls, and
  `sites` the stream calls of equal clusters (`passes.stream_calls.on_stream`).

  When the caller's trace stages a jaxpr, the equations of consecutive units
  wait in `pending` (each with its unit's name scope) until something must
  read their values (a stream call, an anchor, a collective, the outputs);
  `flush` then stages them as one nested call holding the equations as they
  are (`passes.stage.CallStager`) instead of copying each one into the trace.
  """

  def __init__(self, jaxpr, env: dict, skip, consume: bool):
    self.eqns, self.env, self.stacks = jaxpr.eqns, env, {}
    self.sites: dict = {}  # exact_key -> StreamCall (see `stream_calls.on_stream`)
    self.consume = consume and isinstance(self.eqns, list)
    self.uses: dict = {}
    for k, eqn in enumerate(self.eqns):
      if not skip[k]:
        for v in eqn.invars:
          if isinstance(v, _compat.Var):
            self.uses[v] = self.uses.get(v, 0) + 1
    for v in jaxpr.outvars:  # read at the end: never freed
      if isinstance(v, _compat.Var):
        self.uses[v] = -1
    self.stager = stage.CallStager()
    self.base = _compat.name_stack()
    self.pending: list = []  # scoped equations not yet emitted
    self.waiting: list = []  # inputs of source equations taken, released after the flush
    # A stream call's outputs come from its unpack's new vars: readers of the
    # cluster's vars read those (`subst`); `back` maps them to the cluster's.
    self.subst: dict = {}
    self.back: dict = {}
    self.fresh: list = []  # aliases made since the last flush

  def add(self, eqns) -> None:
    """Appends equations (source or new) to `pending`, in the current name scope."""
    self.pending += stage.scoped_eqns(eqns, self.base, self.stacks, self.subst)

  def alias(self, srcs, news) -> None:
    for s, n in zip(srcs, news):
      self.subst[s] = n
      self.back[n] = s
      self.fresh.append((s, n))

  def keep(self, v) -> None:
    """`v` (a new var) is read after emission: it leaves the staged call."""
    self.uses[v] = -1

  def _live(self, v, reads: int) -> bool:
    n = self.uses.get(self.back.get(v, v), 0)
    return n == -1 or n > reads

  def flush(self) -> None:
    """Emits the pending equations, then frees what they were the last to read."""
    if self.pending:
      run, self.pending = self.pending, []
      env = self.env
      with _compat.at_name_stack(self.base):  # the equations carry their scopes
        if len(run) < _MIN_CALL or not self.stager(run, env, self._live):
          _compat.emit_eqns(run, env, self.stacks)
      fresh, self.fresh = self.fresh, []
      for s, n in fresh:  # a later reader outside the call reads the cluster's var
        if n in env:
          env[s] = env[n]
    waiting, self.waiting = self.waiting, []
    self._release(waiting)

  def take(self, ks) -> None:
    """Source equations `ks` are pending: their inputs are released at the next flush."""
    eqns = self.eqns
    for k in ks:
      if eqns[k] is not None:
        self.waiting.append(eqns[k].invars)
        if self.consume:  # the pending copy is all that is left of it
          eqns[k] = None

  def done(self, ks) -> None:
    eqns = self.eqns
    self._release([eqns[k].invars for k in ks if eqns[k] is not None])
    if self.consume:
      for k in ks:
        eqns[k] = None

  def _release(self, invar_lists) -> None:
    uses, env = self.uses, self.env
    for invars in invar_lists:
      for v in invars:
        n = uses.get(v, 0) if isinstance(v, _compat.Var) else 0
        if n > 1:
          uses[v] = n - 1
        elif n == 1:  # the last reader: drop the value and the var (a key holds it)
          del uses[v]
          env.pop(v, None)


# Pending equations fewer than this are copied: a nested call costs about as
# much to lower as staging ~10 equations without copying saves.
_MIN_CALL = 16


def _run_eqns(eqns, env, skip=None, anchors=None, life=None, stacks=None):
  deferred = life is not None and life.stager.ok
  run: list = []  # a stretch of equations with no anchor: staged in one go
  if life is not None:
    stacks = life.stacks
  for k, eqn in eqns:
    if skip is not None and skip[k]:
      continue
    hook = anchors.get(k) if anchors else None
    if hook is None and (not deferred or _compat.plain_eqn(eqn)):
      run.append(eqn)
      continue
    if deferred:
      life.add(run)
      run = []
      if hook is not None:
        if _compat.plain_eqn(eqn) and not isinstance(eqn.outvars[0], _compat.DropVar):
          hook.stage(eqn, life)
          continue
        hook.unpin(life)  # pragma: no cover - an effectful anchor: outputs unpinned
      life.flush()
      _compat.emit_eqns([eqn], env, stacks)  # an equation a nested call cannot hold
      continue
    _compat.emit_eqns(run, env, stacks)
    run = []
    invals = hook.before([_read(env, v) for v in eqn.invars])
    outs = hook.after(list(_compat.bind_eqn(eqn, invals)))
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, _compat.DropVar):
        env[v] = x
  if deferred:
    life.add(run)
    life.take([k for k, _ in eqns])
    return
  _compat.emit_eqns(run, env, stacks)
  if life is not None:
    life.done([k for k, _ in eqns])


def emit(
  split: Split,
  sched: Schedule,
  consts: Sequence[Any],
  leaves: Sequence[Any],
  *,
  ordering: str = "auto",
  annotate: bool = True,
  collectives=None,
  consume: bool = False,
  late: LateLeaves | None = None,
) -> list[Any]:
  """Evaluates the split jaxpr in schedule order in the current trace.

  Args:
    split: from `passes.split.split`.
    sched: from `passes.schedule.schedule` (units name equation indices of `split`).
    consts: values for the split's const inputs.
    leaves: the dynamic input leaves (arrays or tracers).
    ordering: one of `ORDERINGS` (see the module docstring).
    annotate: wrap side-stream calls in a stream-annotated call. False keeps
      the order but emits plain equations (the in-order baseline's form).
    collectives: a `passes.collectives.emit.BucketEmitter` (data-parallel
      mode): issues each gradient bucket's reduction after its last unit.
    consume: the caller hands over `split`'s jaxpr: emitted equations are
      removed from it as emission goes (lower peak memory); do not use the
      split afterwards.
    late: leaves bound mid-emission (`LateLeaves`); their entries in `leaves`
      are ignored.

  Returns:
    The flat outputs `(value, *aux, *grads)`.
  """
  if ordering not in ORDERINGS:
    raise ValueError(f"ordering must be one of {ORDERINGS}, got {ordering!r}")
  barriers = annotate and ordering in ("auto", "barriers")
  edges = annotate and ordering in ("auto", "control_deps")
  # A split backward scan becomes one scan running B(i) and W(i-1) together
  # (W on stream 1 when annotating): one loop instead of 1 + #W-scans.
  # Data parallel: the loop all-reduces each layer's dW slice (passes.collectives.loops).
  split, sched = scan_skew.fuse(
    split,
    sched,
    stream=1 if annotate else None,
    pin=barriers,
    reduce_ys=getattr(collectives, "reduce_ys", None),
  )
  jaxpr = split.jaxpr.jaxpr
  ct_aval = jaxpr.invars[0].aval
  env: dict = {}
  ct = jax.lax.full((), 1, ct_aval.dtype)
  skip_in = set() if late is None else {1 + len(consts) + i for i in late.leaves}
  for i, (v, x) in enumerate(zip(jaxpr.invars, [ct, *consts, *leaves])):
    if i not in skip_in:
      env[v] = x
  dead = [k is Kind.DEAD for k in split.kinds]
  units = {u.name: u for u in sched.units}
  main = [units[a.unit] for a in sched.streams[0]]
  calls_after: dict[str, list[Call]] = {}
  for c in calls_of(sched, units):
    calls_after.setdefault(c.after, []).append(c)
  anchors: dict[int, Any] = {}  # equation -> its hook (`Anchor`, `Close`, `Late`)
  folds = {}
  if barriers:
    ids = {c.anchor for cs in calls_after.values() for c in cs if c.anchor >= 0}
    folds = anchor_folds(jaxpr, ids - {late.anchor} if late else ids, main, dead)
  done: dict = {}  # unit name -> its call's tied buffers (`Call.wait`)
  side_outs: list = []
  life = _Lifetimes(jaxpr, env, dead, consume)
  if late is not None:
    hook = Late(env, [jaxpr.invars[1 + len(consts) + i] for i in late.leaves], late)
    if late.anchor < 0:
      hook.bind(None)
    else:
      if split.kinds[late.anchor] is not Kind.FORWARD or late.anchor in anchors:
        raise ValueError(f"LateLeaves.anchor={late.anchor} is not a free forward equation")
      anchors[late.anchor] = hook

  def meta(gid):
    if ordering != "scheduling_group":
      return contextlib.nullcontext()
    from jax.experimental.xla_metadata import set_xla_metadata

    return set_xla_metadata(_scheduling_group_id=gid)

  for group, u in enumerate(main, 1):
    with jax.named_scope(f"ooo_{u.name}"), meta(group):
      _run_eqns([(k, jaxpr.eqns[k]) for k in u.eqns], env, dead, anchors, life)
    for c in calls_after.get(u.name, ()):
      eqn_ids = [k for name in c.units for k in units[name].eqns]
      label = "+".join(c.units)
      if not annotate:
        with jax.named_scope(f"ooo_{label}"):
          _run_eqns([(k, jaxpr.eqns[k]) for k in eqn_ids], env, dead, life=life)
        continue
      # the call runs beside the next segment: it shares that segment's group
      pinned = barriers and c.anchor >= 0
      wait = next((done[w] for w in c.wait if w in done), ()) if barriers else ()
      with jax.named_scope(f"ooo_{label}"), meta(group + 1):
        ins, outs, flat, unpack = on_stream(jaxpr, eqn_ids, env, c.stream, life, pinned, wait)
      if pinned and outs:
        hook = anchors.get(c.anchor)
        if hook is None:
          tie, close = folds.get(c.anchor, (None, c.anchor))
          hook = anchors[c.anchor] = Anchor(env, done, tie)
          if close != c.anchor and close not in anchors:
            anchors[close] = Close(hook)
        hook.calls.append((ins, outs, flat, unpack, c.units))
      if flat:
        side_outs.append(flat[0])
        if life.stager.ok and edges:
          life.keep(flat[0])  # read by the control edges after emission
    if collectives is not None and collectives.reads_after(u.name):
      life.flush()
      collectives.after_unit(u.name, env)
  life.flush()
  if life.stager.ok:
    side_outs = [env[v] for v in side_outs] if edges else []
  if edges and len(side_outs) > 1:
    _compat.control_deps(list(zip(side_outs, side_outs[1:])))
  outs = [_read(env, v) for v in jaxpr.outvars]
  return outs if collectives is None else collectives.outputs(outs, env)
