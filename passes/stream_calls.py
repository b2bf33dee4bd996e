"""stream_calls: dW clusters as stream-annotated calls, and what pins their windows.

The second half of `passes.emit`: what emission builds beside the scheduled
equations.

* `on_stream` binds a cluster of equations as one non-inlined call annotated
  for a GPU side stream (`StreamCall`, traced once per distinct cluster and
  copied to every equal one); `side_call` does the same for a whole jaxpr.
* `Anchor` ties the calls whose window closes at one main-stream equation to
  that equation with `lax.optimization_barrier`, on both sides: data is what
  bounds each window (jax 0.11's XLA:GPU never moves such a call; 0.12's
  latency-hiding scheduler places it within these bounds, see `passes.slots`).
* `LateLeaves` / `Late`: input leaves bound mid-emission, after a forward
  equation (the single-GPU deferred-dW step binds the deferred parameters
  this way, see `ooojax.single_gpu`).

The hooks (`Anchor`, `Late`) share one interface that `passes.emit` calls:
`stage(eqn, life)` under a staging trace, else `before(invals)` /
`after(outs) -> outs` around binding the equation; `unpin(life)` for an
anchor that cannot be staged.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from ooojax.passes import _compat, stage
from ooojax.passes.fingerprint import exact_key
from ooojax.passes.ir import Call, Schedule


def _read(env, v):
  return v.val if isinstance(v, _compat.Literal) else env[v]


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


def on_stream(
  jaxpr, eqn_ids, env, stream: int, life, pinned: bool = False, wait: Sequence[Any] = ()
) -> tuple[list, list, list, Any]:
  """Binds the equations as one stream-annotated call.

  The call returns one flat buffer per dtype (its outputs flattened and
  concatenated). Flat: the layout change XLA adds for a conv's filter
  gradient then happens inside the call, on the side stream, instead of as a
  transpose right after the done. One buffer: XLA schedules a done right
  before its first user, and the element reads of a multi-output done are
  users that the memory scheduler places early; a single output's first user
  is whatever the emitter ties it to.

  `wait`: outputs of an earlier call (as `Anchor` tied them); the inputs are
  tied to them, so this call starts after that one's done (`passes.slots`).

  Returns (the call's operands, output vars, the flat buffers, unpack)
  where `unpack(buffers)` gives the outputs in their shapes; `env` gets
  them now unless `pinned` (then `Anchor.after` does).
  """
  ins, outs = _cluster_io(jaxpr, eqn_ids)
  eqns = [jaxpr.eqns[k] for k in eqn_ids]
  # the context is part of the key: a site's equations are copied with the
  # context they were traced in (e.g. ordering="scheduling_group"'s group id)
  key = (exact_key(eqns, ins, outs), _compat.eqn_context())
  site = life.sites.get(key)
  if site is None:
    site = life.sites[key] = StreamCall(eqns, ins, outs, stream, life.stacks)
  if life.stager.ok:  # as equations, staged with the rest (see `_Lifetimes`)
    in_vars = [life.subst.get(v, v) for v in ins]
    if wait and in_vars:
      b, tied = stage.barrier_eqn([*in_vars, *wait])
      life.add([b])
      in_vars = tied[: len(in_vars)]
    flat = site.pack.staged(in_vars, life)
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
    vals = [env[v] for v in ins]
    if wait and vals:
      vals, _ = lax.optimization_barrier((vals, list(wait)))
    flat = site.pack(vals, life.stacks)
    life.done(eqn_ids)

    def unpack(bufs):
      vals = site.unpack(bufs, life.stacks)
      env.update(zip(outs, vals))
      return vals

  flat_ins, results = flat[: len(ins)], flat[len(ins) :]
  if not pinned:  # a pinned call's outputs are unpacked after its anchor
    unpack(results)
  return flat_ins, outs, results, unpack


class StreamCall:
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
    if _compat.sharded_over_mesh([v.aval for v in (*ins, *outs)]):
      # Explicit sharding: as they are (see `_compat.sharded_over_mesh`)
      plain = _compat.on_stream(_plain_body(eqns, ins, outs, stacks), stream, len(outs))
      self.pack = _Traced(lambda *vals: (*vals, *plain(*vals)), [v.aval for v in ins])
      self.unpack = _Traced(lambda *bufs: list(bufs), [v.aval for v in outs])
      return
    call = _compat.on_stream(
      _body(eqns, ins, outs, in_shapes, dtypes, slot, stacks), stream, len(dtypes)
    )

    def pack(*vals):
      # Inputs go in flat as well: a layout change XLA needs for an operand is
      # then made on the value the emitter pins (see `Anchor.before`), not on
      # a copy the memory scheduler may compute late, holding back the start.
      # (Measured free: bitcasts on ResNet-50, compile-only H100.)
      flat = [
        lax.reshape(x, (int(np.prod(s)),)) if len(s) >= 2 else x for x, s in zip(vals, in_shapes)
      ]
      return (*flat, *call(*flat))

    def unpack(*bufs):
      # one split per buffer, not a slice per output: fewer equations to trace and lower
      pieces = []
      for i, b in enumerate(bufs):
        ns = [n for n, j in zip(sizes, slot) if j == i]
        pieces.append(iter(lax.split(b, ns) if len(ns) > 1 else [b]))
      return [lax.reshape(next(pieces[i]), s) for s, i in zip(shapes, slot)]

    self.pack = _Traced(pack, [v.aval for v in ins])
    self.unpack = _Traced(unpack, self.pack.out_avals[len(ins) :])


class _Traced:
  """`fun` traced once for `avals`; a call copies its equations into the current trace."""

  def __init__(self, fun, avals):
    self.fun = fun
    self.closed = jax.make_jaxpr(fun)(*[_compat.shape_dtype(a) for a in avals])
    self.out_avals = self.closed.out_avals
    self.in_avals = list(avals)

  def __call__(self, vals, stacks) -> list:
    if [jax.typeof(x) for x in vals] != self.in_avals:  # pragma: no cover - a type the
      return list(self.fun(*vals))  # spec did not capture: trace
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
  the call's window open until that work (see `Anchor`).
  """
  site = StreamCall(list(jaxpr.eqns), list(jaxpr.invars), list(jaxpr.outvars), stream, {})
  flat = site.pack(list(vals), {})
  return list(flat[len(jaxpr.invars) :]), lambda bufs: site.unpack(list(bufs), {})


def _body(eqns, ins, outs, in_shapes, dtypes, slot, stacks):
  """The call's body: flat operands in, one flat buffer per dtype out."""

  def body(*vals):
    local = {v: lax.reshape(x, s) if len(s) >= 2 else x for v, x, s in zip(ins, vals, in_shapes)}
    # the body's values are its own: share only the name stacks
    _compat.emit_eqns(eqns, local, stacks)
    parts: list[list] = [[] for _ in dtypes]
    for v, i in zip(outs, slot):
      parts[i].append(lax.reshape(local[v], (int(np.prod(np.shape(v.aval))),)))
    return tuple(p[0] if len(p) == 1 else lax.concatenate(p, 0) for p in parts)

  return body


def _plain_body(eqns, ins, outs, stacks):
  """The call's body with its operands and outputs as they are."""

  def body(*vals):
    local = dict(zip(ins, vals))
    _compat.emit_eqns(eqns, local, stacks)
    return tuple(local[v] for v in outs)

  return body


def calls_of(sched: Schedule, units) -> tuple[Call, ...]:
  if sched.calls or len(sched.streams) < 2:
    return sched.calls
  # A schedule built by hand without calls: one call per side unit, no anchor.
  return tuple(
    Call((a.unit,), a.stream, units[a.unit].deps[0]) for s in sched.streams[1:] for a in s
  )


# Producers XLA folds into a conv or dot reading their output: a tie between
# them hides the pattern (a reversed filter makes a backward-input conv).
_FOLDED = frozenset(
  {"rev", "transpose", "reshape", "convert_element_type", "broadcast_in_dim", "squeeze"}
)
# An anchor's only reader that cuDNN fuses into the conv (a residual's gradient
# added as the side input): the window closes after it, not between them.
_EPILOGUE = frozenset({"add", "add_any"})


def anchor_folds(jaxpr, anchor_ids, units, dead) -> dict[int, tuple[list[bool] | None, int]]:
  """For each anchor equation: (which operands `Anchor` ties, None for all;
  the equation its window closes at, itself or its epilogue: see `Anchor`).

  `units`: the main stream's units in order (their `eqns`); an epilogue must
  follow its anchor in the same unit and be nobody's anchor itself.
  """
  eqns = jaxpr.eqns
  anchor_ids = set(anchor_ids)
  where = {k: (i, j) for i, u in enumerate(units) for j, k in enumerate(u.eqns)}
  wanted = {v for k in anchor_ids for v in eqns[k].invars if isinstance(v, _compat.Var)}
  producer: dict = {}
  readers: dict = {eqns[k].outvars[0]: [] for k in anchor_ids if len(eqns[k].outvars) == 1}
  for k, e in enumerate(eqns):
    if dead[k]:
      continue
    for v in e.outvars:
      if v in wanted:
        producer[v] = e.primitive.name
    for v in e.invars:
      if isinstance(v, _compat.Var) and v in readers:
        readers[v].append(k)
  final = {v for v in jaxpr.outvars if isinstance(v, _compat.Var)}
  result = {}
  for k in anchor_ids:
    ops = eqns[k].invars
    tie = [not (isinstance(v, _compat.Var) and producer.get(v) in _FOLDED) for v in ops]
    if all(tie) or not any(t for t, v in zip(tie, ops) if isinstance(v, _compat.Var)):
      tie = None  # nothing folded, or every operand is: tie them all
    close = k
    out = eqns[k].outvars[0] if len(eqns[k].outvars) == 1 else None
    read = readers.get(out, [])
    j = read[0] if len(read) == 1 else None
    if (
      j is not None
      and out not in final
      and j not in anchor_ids
      and eqns[j].primitive.name in _EPILOGUE
      and k in where
      and j in where
      and where[j][0] == where[k][0]
      and where[j][1] > where[k][1]
    ):
      close = j
    result[k] = (tie, close)
  return result


class Anchor:
  """The calls whose window closes at one main-stream equation.

  `before` ties the calls' inputs to the equation's inputs, so the equation
  cannot run before the calls start; `after` ties the calls' flat outputs to
  its output, so the calls' dones cannot be scheduled before it, and returns
  the tied copy of the output for its readers, so the dones cannot be
  scheduled after them either. `done` collects each call's tied buffers by
  unit name, for a later call that waits for it (`Call.wait`).

  A tie hides what it ties from XLA's pattern matching. `tie` (one flag per
  operand; None: all) leaves out operands XLA folds into the equation (a
  reversed filter makes a conv a backward-input conv); `close` (see `Close`)
  moves the output tie past an epilogue cuDNN fuses into the conv (the add of
  a residual's gradient), so a pinned window costs no fusion.
  """

  def __init__(self, env, done: dict | None = None, tie: Sequence[bool] | None = None):
    self.env = env
    self.calls: list = []  # (input values, output vars, flat buffers, unpack, units)
    # unit name -> its call's tied buffers, for a later call's `wait` (vars when staged)
    self.done = {} if done is None else done
    self.tie = tie
    self.close: Close | None = None  # the window closes at a later equation
    self.unpinned = False

  def _mask(self, n: int) -> list[bool]:
    return [True] * n if self.tie is None else list(self.tie)

  def stage(self, eqn, life) -> None:
    """`before`, the equation and `after` as equations pending in `life` (vars, not values)."""
    ins = [x for c in self.calls for x in c[0]]
    ivars = [v if isinstance(v, _compat.Literal) else life.subst.get(v, v) for v in eqn.invars]
    mask = self._mask(len(ivars))
    b1, tied_in = stage.barrier_eqn([*ins, *(v for v, t in zip(ivars, mask) if t)])
    it = iter(tied_in[len(ins) :])
    anchor = eqn.replace(invars=[next(it) if t else v for v, t in zip(ivars, mask)])
    life.add([b1, anchor])
    if self.close is None:
      self.stage_close(eqn.outvars[0], life)

  def stage_close(self, out, life) -> None:
    """`after` as equations: ties the calls' buffers to `out`, whose readers read the tie."""
    flats = [x for c in self.calls for x in c[2]]
    b2, t2 = stage.barrier_eqn([*flats, out])
    b3, t3 = stage.barrier_eqn([*t2[:-1], out])  # chained: see `after`
    life.add([b2, b3])
    life.alias([out], [t3[-1]])  # readers read the tied copy: see `after`
    if life.uses.get(out, 0):  # the barriers' two reads are not the program's: its
      life.keep(out)  # readers may come after a flush (an unstageable equation)
    it = iter(t3[:-1])
    for c in self.calls:
      bufs = [next(it) for _ in c[2]]
      c[3](bufs)
      for v in bufs:  # a waiting call may read them after a flush
        life.keep(v)
      self.done.update(dict.fromkeys(c[4], bufs))

  def unpin(self, life) -> None:  # pragma: no cover - see `passes.emit._run_eqns`
    if self.unpinned:
      return
    self.unpinned = True
    for c in self.calls:
      c[3](c[2])
      self.done.update(dict.fromkeys(c[4], c[2]))

  def before(self, invals):
    ins = [x for c in self.calls for x in c[0]]
    mask = self._mask(len(invals))
    _, tied = jax.lax.optimization_barrier((ins, [x for x, t in zip(invals, mask) if t]))
    it = iter(tied)
    return [next(it) if t else x for x, t in zip(invals, mask)]

  def after(self, outs):
    return outs if self.close is not None else self.tie_outputs(outs)

  def tie_outputs(self, outs):
    # Tie the flat buffers themselves: any op on the done before the
    # barrier (a slice, a reshape) is a user XLA may schedule early.
    tied, _ = jax.lax.optimization_barrier(([c[2] for c in self.calls], outs[0]))
    # Again, chained: XLA's simplifier drops an unused barrier element whose
    # only user is the barrier (e.g. a layout bitcast of the anchor made for
    # it); two barriers make two users, so the anchor stays in both.
    tied, out = jax.lax.optimization_barrier((tied, outs[0]))
    for (_, out_vars, _, unpack, names), flat in zip(self.calls, tied):
      self.env.update(zip(out_vars, unpack(flat)))
      self.done.update(dict.fromkeys(names, list(flat)))
    # The equation's readers read the tied copy, so the dones come before them
    # too: the window closes at the anchor. Left open, XLA:GPU's latency-hiding
    # scheduler (jax >= 0.12) stretches a done down to the next call that waits
    # for it, and then places that call's start after its own anchor.
    return [out, *outs[1:]]


class Close:
  """The hook at the equation where an `Anchor`'s window closes, when that is
  not the anchor itself but its epilogue (`passes.emit` picks it: the anchor's
  only reader, an add XLA fuses into the conv)."""

  def __init__(self, anchor: Anchor):
    self.anchor = anchor
    anchor.close = self

  def stage(self, eqn, life) -> None:
    life.add([eqn])
    if not self.anchor.unpinned:
      self.anchor.stage_close(eqn.outvars[0], life)

  def unpin(self, life) -> None:  # pragma: no cover - an effectful epilogue
    self.anchor.unpin(life)

  def before(self, invals):
    return invals

  def after(self, outs):
    return outs if self.anchor.unpinned else self.anchor.tie_outputs(outs)


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


class Late:
  """The anchor hook of `LateLeaves` (the `Anchor` interface `passes.emit` calls)."""

  def __init__(self, env, invars, late: LateLeaves):
    self.env, self.invars, self.late = env, invars, late

  def bind(self, value) -> None:
    vals = list(self.late.bind(value))
    if len(vals) != len(self.invars):
      raise ValueError(f"LateLeaves.bind returned {len(vals)} values for {len(self.invars)} leaves")
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
    return outs
