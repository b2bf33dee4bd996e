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

Under a staging trace (`jit`, `make_jaxpr`) the program is not re-bound
equation by equation: the traced equations themselves, in schedule order,
with the stream calls and barriers built as equations beside them, go into
one nested `jit` equation (`passes.stage.CallStager`; XLA inlines the call), so
emission costs about one object per equation and the caller's trace holds a
single equation. Elsewhere (eager, under `vmap`) each equation is bound.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from passes import _compat, stage
from passes.scan import skew as scan_skew
from passes.fingerprint import exact_key
from passes.ir import Call, Kind, Schedule, Split

ORDERINGS = ("auto", "barriers", "control_deps", "scheduling_group", "none")


def _read(env, v):
  return v.val if isinstance(v, _compat.Literal) else env[v]


class _Lifetimes:
  """Frees what emission no longer needs, so two programs are not held at once.

  A value leaves `env` after its last reader is emitted; with `consume`, an
  emitted source equation also leaves the source jaxpr (the caller owns it).
  The stacks dict shares name stacks across `_compat.emit_eqns` calls, and
  `sites` the stream calls of equal clusters.

  When the caller's trace stages a jaxpr, the equations of consecutive units
  wait in `pending` (each with its unit's name scope) until something must
  read their values (a stream call, an anchor, a collective, the outputs);
  `flush` then stages them as one nested call holding the equations as they
  are (`passes.stage.CallStager`) instead of copying each one into the trace.
  """

  def __init__(self, jaxpr, env: dict, skip, consume: bool):
    self.eqns, self.env, self.stacks = jaxpr.eqns, env, {}
    self.sites: dict = {}  # exact_key -> _StreamCall (see `_on_stream`)
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
    outs = _compat.bind_eqn(eqn, invals)
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, _compat.DropVar):
        env[v] = x
    hook.after(outs)
  if deferred:
    life.add(run)
    life.take([k for k, _ in eqns])
    return
  _compat.emit_eqns(run, env, stacks)
  if life is not None:
    life.done([k for k, _ in eqns])


def free_inputs(eqns, eqn_ids: Sequence[int]) -> tuple[list, set]:
  """(vars the equations `eqn_ids` read but do not define, in first-read order;
  the vars they define)."""
  defined: set = set()
  ins: list = []
  seen: set = set()
  for k in eqn_ids:
    for v in eqns[k].invars:
      if isinstance(v, _compat.Var) and v not in defined and v not in seen:
        seen.add(v)
        ins.append(v)
    defined.update(eqns[k].outvars)
  return ins, defined


def _cluster_io(jaxpr, eqn_ids: Sequence[int]):
  ins, defined = free_inputs(jaxpr.eqns, eqn_ids)
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


def _on_stream(jaxpr, eqn_ids, env, stream: int, life,
               pinned: bool = False) -> tuple[list, list, list, Any]:
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
  them now unless `pinned` (then `_Anchor.after` does).
  """
  ins, outs = _cluster_io(jaxpr, eqn_ids)
  eqns = [jaxpr.eqns[k] for k in eqn_ids]
  # the context is part of the key: a site's equations are copied with the
  # context they were traced in (e.g. ordering="scheduling_group"'s group id)
  key = (exact_key(eqns, ins, outs), _compat.eqn_context())
  site = life.sites.get(key)
  if site is None:
    site = life.sites[key] = _StreamCall(eqns, ins, outs, stream, life.stacks)
  if life.stager.ok:  # as equations, staged with the rest (see `_Lifetimes`)
    flat = site.pack.staged([life.subst.get(v, v) for v in ins], life)
    life.take(eqn_ids)
    if pinned:
      # Its anchor reads these later, maybe after a flush (an equation the stager
      # cannot hold in between, e.g. a psum with effects inside shard_map).
      for v in flat:
        life.keep(v)

    def unpack(bufs):
      vals = site.unpack.staged(bufs, life)
      life.alias(outs, vals)
      return vals
  else:
    flat = site.pack([env[v] for v in ins], life.stacks)
    life.done(eqn_ids)

    def unpack(bufs):
      vals = site.unpack(bufs, life.stacks)
      env.update(zip(outs, vals))
      return vals
  flat_ins, results = flat[:len(ins)], flat[len(ins):]
  if not pinned:  # a pinned call's outputs are unpacked after its anchor
    unpack(results)
  return flat_ins, outs, results, unpack


class _StreamCall:
  """A cluster's stream call, traced once and copied to every equal cluster.

  Clusters with one `exact_key` (a deep model's layers) compute the same
  function, so they share these equations, the call's body among them: it is
  traced once, and JAX's lowering cache lowers it once. `pack` takes the
  cluster's inputs to (*flat inputs, *flat buffers); `unpack` takes the
  buffers to the outputs in their shapes. A site copies the few equations
  (`_compat.emit_eqns`) rather than tracing them again.
  """

  def __init__(self, eqns, ins, outs, stream: int, stacks):
    in_shapes = [tuple(np.shape(v.aval)) for v in ins]
    shapes = [tuple(np.shape(v.aval)) for v in outs]
    sizes = [int(np.prod(s)) for s in shapes]
    dtypes = list(dict.fromkeys(v.aval.dtype for v in outs))
    slot = [dtypes.index(v.aval.dtype) for v in outs]
    call = _compat.on_stream(_body(eqns, ins, outs, in_shapes, dtypes, slot, stacks),
                             stream, len(dtypes))

    def pack(*vals):
      # Inputs go in flat as well: a layout change XLA needs for an operand is
      # then made on the value the emitter pins (see `_Anchor.before`), not on
      # a copy the memory scheduler may compute late, holding back the start.
      flat = [lax.reshape(x, (int(np.prod(s)),)) if len(s) >= 2 else x
              for x, s in zip(vals, in_shapes)]
      return (*flat, *call(*flat))

    def unpack(*bufs):
      # one split per buffer, not a slice per output: fewer equations to trace and lower
      pieces = []
      for i, b in enumerate(bufs):
        ns = [n for n, j in zip(sizes, slot) if j == i]
        pieces.append(iter(lax.split(b, ns) if len(ns) > 1 else [b]))
      return [lax.reshape(next(pieces[i]), s) for s, i in zip(shapes, slot)]

    self.pack = _Traced(pack, [v.aval for v in ins])
    self.unpack = _Traced(unpack, self.pack.out_avals[len(ins):])


class _Traced:
  """`fun` traced once for `avals`; a call copies its equations into the current trace."""

  def __init__(self, fun, avals):
    self.fun = fun
    self.closed = jax.make_jaxpr(fun)(*[_compat.shape_dtype(a) for a in avals])
    self.out_avals = self.closed.out_avals
    self.in_avals = list(avals)

  def __call__(self, vals, stacks) -> list:
    if [jax.typeof(x) for x in vals] != self.in_avals:  # pragma: no cover - a type the
      return list(self.fun(*vals))                       # spec did not capture: trace
    jaxpr = self.closed.jaxpr
    env = dict(zip(jaxpr.constvars, self.closed.consts))
    env.update(zip(jaxpr.invars, vals))
    _compat.emit_eqns(jaxpr.eqns, env, stacks)
    return [_read(env, v) for v in jaxpr.outvars]

  def staged(self, ins, life) -> list:
    """Appends the equations, reading the vars `ins`, to `life.pending`; returns the output vars."""
    if self.closed.consts:  # pragma: no cover - the templates here have none
      raise NotImplementedError("a staged template with consts")
    eqns, outs = stage.renamed(self.closed.jaxpr, ins)
    life.add(eqns)
    return outs


def side_call(jaxpr, vals: Sequence[Any], stream: int = 1) -> tuple[list, Callable]:
  """Evaluates `jaxpr` (no consts) as one call annotated for GPU stream `stream`.

  Returns `(buffers, unpack)`: the call's flat outputs (one per dtype) and
  `unpack(buffers) -> outputs` in `jaxpr.outvars`' shapes. Tie the buffers to
  main-stream work (`lax.optimization_barrier`) before unpacking them to keep
  the call's window open until that work (see `_Anchor`).
  """
  site = _StreamCall(list(jaxpr.eqns), list(jaxpr.invars), list(jaxpr.outvars), stream, {})
  flat = site.pack(list(vals), {})
  return list(flat[len(jaxpr.invars):]), lambda bufs: site.unpack(list(bufs), {})


def _body(eqns, ins, outs, in_shapes, dtypes, slot, stacks):
  """The call's body: flat operands in, one flat buffer per dtype out."""
  eqns = list(enumerate(eqns))

  def body(*vals):
    local = {v: lax.reshape(x, s) if len(s) >= 2 else x for v, x, s in zip(ins, vals, in_shapes)}
    # the body's values are its own: share only the name stacks
    _run_eqns(eqns, local, stacks=stacks)
    parts: list[list] = [[] for _ in dtypes]
    for v, i in zip(outs, slot):
      parts[i].append(lax.reshape(local[v], (int(np.prod(np.shape(v.aval))),)))
    return tuple(p[0] if len(p) == 1 else lax.concatenate(p, 0) for p in parts)
  return body


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

  def stage(self, eqn, life) -> None:
    """`before`, the equation and `after` as equations pending in `life` (vars, not values)."""
    ins = [x for c in self.calls for x in c[0]]
    ivars = [v if isinstance(v, _compat.Literal) else life.subst.get(v, v) for v in eqn.invars]
    b1, tied_in = stage.barrier_eqn([*ins, *ivars])  # literals too, as `before` ties them
    anchor = eqn.replace(invars=tied_in[len(ins):])
    out = eqn.outvars[0]
    flats = [x for c in self.calls for x in c[2]]
    b2, t2 = stage.barrier_eqn([*flats, out])
    b3, t3 = stage.barrier_eqn([*t2[:-1], out])  # chained: see `after`
    life.add([b1, anchor, b2, b3])
    if life.uses.get(out, 0):  # the barriers' two reads are not the program's: its
      life.keep(out)           # readers may come after a flush (an unstageable equation)
    it = iter(t3[:-1])
    for c in self.calls:
      c[3]([next(it) for _ in c[2]])

  def unpin(self, life) -> None:  # pragma: no cover - see `_run_eqns`
    for c in self.calls:
      c[3](c[2])

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


@dataclasses.dataclass(frozen=True)
class LateLeaves:
  """Input leaves bound mid-emission, after forward equation `anchor` (-1: before the forward).

  `bind(anchor_value)` (the anchor's output, or None) returns the values of
  the dynamic leaves at positions `leaves`. Until then those leaves are
  unbound: a reader emitted earlier fails loudly (KeyError) rather than
  reading a stale value. The single-GPU deferred-dW step binds the deferred
  parameters this way, once their gradients, computed beside the forward,
  are tied to the anchor (see `ooojax.single_gpu`).
  """
  anchor: int
  leaves: tuple[int, ...]
  bind: Callable[[Any], Sequence[Any]] = dataclasses.field(compare=False)


class _Late:
  """The anchor hook of `LateLeaves` (the `_Anchor` interface of `_run_eqns`)."""

  def __init__(self, env, invars, late: LateLeaves):
    self.env, self.invars, self.late = env, invars, late

  def bind(self, value) -> None:
    vals = list(self.late.bind(value))
    if len(vals) != len(self.invars):
      raise ValueError(f"LateLeaves.bind returned {len(vals)} values for "
                       f"{len(self.invars)} leaves")
    self.env.update(zip(self.invars, vals))

  def stage(self, eqn, life) -> None:
    life.add([eqn])
    out = eqn.outvars[0]
    life.keep(out)
    life.flush()  # the late values are computed in the caller's trace
    self.bind(self.env[out])

  def unpin(self, life) -> None:  # pragma: no cover - an effectful anchor
    life.flush()
    self.bind(None)

  def before(self, invals):
    return invals

  def after(self, outs):
    self.bind(outs[0])


def emit(split: Split, sched: Schedule, consts: Sequence[Any],
         leaves: Sequence[Any], *, ordering: str = "auto",
         annotate: bool = True, collectives=None, consume: bool = False,
         late: LateLeaves | None = None) -> list[Any]:
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
  split, sched = scan_skew.fuse(split, sched, stream=1 if annotate else None, pin=barriers,
                                reduce_ys=getattr(collectives, "reduce_ys", None))
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
  for c in _calls_of(sched, units):
    calls_after.setdefault(c.after, []).append(c)
  anchors: dict[int, _Anchor] = {}
  side_outs: list = []
  life = _Lifetimes(jaxpr, env, dead, consume)
  if late is not None:
    hook = _Late(env, [jaxpr.invars[1 + len(consts) + i] for i in late.leaves], late)
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
      with jax.named_scope(f"ooo_{label}"), meta(group + 1):
        ins, outs, flat, unpack = _on_stream(jaxpr, eqn_ids, env, c.stream, life, pinned)
      if pinned and outs:
        hook = anchors.setdefault(c.anchor, _Anchor(env))
        hook.calls.append((ins, outs, flat, unpack))
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
