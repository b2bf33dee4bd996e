"""pipeline.stack: the stack of layers found in a plain loss's equations.

Contract: `program(jaxpr, n_params, n_aux, state) -> Program` (the flattened
equations, each value's dependence on parameters / the batch, per-layer key
data folded to constants), `pick(prog) -> Stack | None` (the scan or the loop of
identical blocks holding the most parameters, checked) and `emits(prog, stack)`
(the aux outputs the layers compute: updated model state). Raises `CutError`
(a `ValueError`) for a stack automatic cutting cannot take. Read by
`passes.pipeline.cut`, which turns the stack into the prologue, layer and
epilogue functions; the module docstring there describes the search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ooojax.passes import _compat, fingerprint
from ooojax.passes.pipeline import layer_keys, side as side_pass
from ooojax.passes.pipeline.eqns import flatten as _flatten

__all__ = ["EXPLICIT", "CutError", "Program", "Stack", "emits", "pick", "program"]

EXPLICIT = (
  "; pipeline it with the explicit API instead: ooo.pipeline.value_and_grad("
  "stage_fn, loss_fn, input_fn=..., mesh=..., axis_name=...) with parameters "
  "stacked on a stage axis (docs/pipeline.md)"
)


class CutError(ValueError):
  """The loss holds no stack of layers that automatic cutting can pipeline."""


# --- the program's equations ------------------------------------------------------
_P, _B = 1, 2  # depends on a parameter / on the batch
_PINNED = 4  # effectful: never recomputed elsewhere


def _is_var(v) -> bool:
  return isinstance(v, _compat.Var) and not isinstance(v, _compat.DropVar)


@dataclasses.dataclass(frozen=True)
class Program:
  eqns: list
  consts: dict  # constvar -> value
  param_vars: list  # parameter invars
  batch_vars: list  # batch invars
  loss: Any  # the scalar output
  aux: tuple  # the aux outputs (vars or literals)
  dep: dict  # var -> _P | _B bits
  producer: dict  # var -> defining equation index
  lits: frozenset = frozenset()  # constvars that were a fold_in's literal (`_per_layer_data`)
  state_vars: frozenset = frozenset()  # batch invars of model state (dep `_P`: per layer)

  def slice(self, roots, stop=()) -> list[int]:
    """Indices of the equations `roots` need, not looking past the `stop` vars."""
    todo, seen, stop = [v for v in roots if _is_var(v)], set(), set(stop)
    while todo:
      v = todo.pop()
      k = self.producer.get(v)
      if v in stop or k is None or k in seen:
        continue
      seen.add(k)
      todo += [u for u in self.eqns[k].invars if _is_var(u)]
    return sorted(seen)

  def reads(self, ids) -> set:
    return {v for k in ids for v in self.eqns[k].invars if _is_var(v)}

  def bits(self, k) -> int:
    outs = [v for v in self.eqns[k].outvars if _is_var(v)]
    return self.dep[outs[0]] if outs else _PINNED


def _per_layer_data(e, dep, consts, lits, eqns, producer):
  """`side.per_layer_constant` of `e` when it folds data into a batch key."""
  if e.primitive.name != "random_fold_in" or not dep.get(e.invars[0], 0) & _B:
    return e
  data = e.invars[1]
  if isinstance(data, _compat.Literal):
    val = data.val
  elif dep.get(data, 0) == 0 and data not in consts:  # of constants alone: fold it now
    ids = []
    todo = [data]
    while todo:
      k = producer.get(todo.pop())
      if k is not None and k not in ids:
        ids.append(k)
        todo += [u for u in eqns[k].invars if _is_var(u)]
    if any(eqns[k].effects for k in ids):
      return e
    val = side_pass.evaluate_now([eqns[k] for k in sorted(ids)], consts, data)
  else:
    return e
  e, v, consts[v] = side_pass.per_layer_constant(e, val)
  lits.add(v)
  return e


def program(closed, n_params: int, n_aux: int = 0, state: Sequence[int] = ()) -> Program:
  eqns, outs, consts = _flatten(closed)
  lits: set = set()
  # per-layer keys (`keys[i]` of a split): read at a per-layer constant index
  eqns = layer_keys.expand(eqns, consts, lits)
  invars = list(closed.jaxpr.invars)
  dep = {v: _P for v in invars[:n_params]}
  dep.update({v: _B for v in invars[n_params:]})
  state_vars = frozenset(invars[n_params + i] for i in state)
  dep.update({v: _P for v in state_vars})  # model state goes with its layer, as weights do
  producer = {}
  for k, e in enumerate(eqns):
    e = eqns[k] = _per_layer_data(e, dep, consts, lits, eqns, producer)
    # a value of the data axis (axis_index, a psum over it) is recomputed like any other:
    # every replica of a stage runs the same table
    bits = _PINNED if _compat.pinning_effects(e) else 0
    for v in e.invars:
      if _is_var(v):
        bits |= dep.get(v, 0)
    for v in e.outvars:
      if _is_var(v):
        dep[v], producer[v] = bits, k
  if len(outs) != 1 + n_aux:
    raise CutError(
      f"the traced loss returns {len(outs)} values; it must return one scalar"
      + (f" and {n_aux} aux leaves" if n_aux else "")
    )
  return Program(
    eqns,
    consts,
    invars[:n_params],
    invars[n_params:],
    outs[0],
    tuple(outs[1:]),
    dep,
    producer,
    frozenset(lits),
    state_vars,
  )


# --- the stack -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Stack:
  x_in: Any  # the first layer's input (a var)
  x_out: Any  # the last layer's output
  eqns: frozenset  # the stack's equation indices (not its floating definers)
  layers: tuple  # per layer: its parameter invars (one row when scanned)
  scanned: bool
  reverse: bool
  length: int  # layers
  layer_eqns: tuple = ()  # layer 0's equations, in order (loop stacks)
  layer_ins: tuple = ()  # (x, *layer 0's parameter and constant vars) (loop stacks)
  layer_out: Any = None  # layer 0's output (loop stacks)
  body: Any = None  # the scan body (scanned)
  body_consts: tuple = ()  # the scan's consts (vars computed from constants alone)
  lits: tuple = ()  # per layer: its values of layer 0's `prog.lits` inputs
  state: tuple = ()  # per layer: its model-state invars (one row of stacked ones when scanned)
  layer_ids: tuple = ()  # per layer: its equations, position i of each alike (loop stacks)
  xs: tuple = ()  # the scan's xs, parameters and state as its body reads them (scanned)


def _scan_stack(prog: Program) -> Stack | None:
  """The scan over the largest stacked parameters, checked; None if there is none."""
  params = set(prog.param_vars)
  best, size = None, -1
  for k, e in enumerate(prog.eqns):
    if not _compat.is_scan(e):
      continue
    _, _, xs = _compat.scan_info(e).split_in(e.invars)
    n = sum(int(np.prod(v.aval.shape)) for v in xs if _is_var(v) and v in params)
    if n > size and n > 0:
      best, size = k, n
  if best is None:
    return None
  e = prog.eqns[best]
  info = _compat.scan_info(e)
  consts, carry, xs = info.split_in(e.invars)
  where = f"the scan over {info.length} layers"
  if any(_is_var(v) and v in prog.state_vars for v in consts):
    raise CutError(
      f"{where} reads model state in every layer (state_argnums: one BatchNorm's "
      "statistics shared by the layers); automatic cutting keeps each layer's "
      "state with its layer" + EXPLICIT
    )
  # per-layer model state scanned over (nn.scan with variable_axes={"batch_stats": 0})
  # travels with its layer, as the parameters do (`passes.pipeline.state`)
  state = [v for v in xs if _is_var(v) and v in prog.state_vars]
  other = [v for v in xs if not (_is_var(v) and (v in params or v in prog.state_vars))]
  rand = side_pass.check(
    [prog.eqns[k] for k in prog.slice(other) if prog.bits(k) == _B], other, where
  )
  if rand:
    raise CutError(rand + EXPLICIT)
  if any(_is_var(v) and side_pass.is_key(v.aval) for v in other):
    raise CutError(
      f"{where} scans over per-layer keys split from a key in the batch "
      "(nn.scan with split_rngs={'dropout': True}); automatic cutting draws "
      "per-layer dropout keys in a Python loop of blocks (each block folds "
      "its own constant into the key, as flax does), not over a scan" + EXPLICIT
    )
  if other:
    raise CutError(
      f"{where} also scans over {len(other)} per-layer input(s) that are not "
      f"parameters ({', '.join(str(v.aval) for v in other)}); automatic "
      "cutting scans over parameter leaves only" + EXPLICIT
    )
  if len(carry) != 1 or not _is_var(carry[0]) or not prog.dep.get(carry[0], 0) & _B:
    raise CutError(
      f"{where} carries {len(carry)} value(s) "
      f"({', '.join(str(v.aval) for v in carry)}); automatic cutting needs "
      "exactly one carry, the activation, computed from the batch" + EXPLICIT
    )
  for v in consts:  # values of the batch alone (a mask) are side inputs (`side_pass`)
    bits = prog.dep.get(v, 0) if _is_var(v) else 0
    if bits & _P and bits & _B:
      raise CutError(side_pass.PARAMS.format(where=where, aval=v.aval) + EXPLICIT)
    if bits & _P:
      raise CutError(
        f"{where} reads a parameter in every layer ({v.aval}): weights shared "
        "by the layers cannot be split over stages automatically" + EXPLICIT
      )
    if bits & ~_B:
      raise CutError(
        f"{where} reads a value of an effectful equation ({v.aval}); "
        "automatic cutting rebuilds side inputs on every stage" + EXPLICIT
      )
  return Stack(
    carry[0],
    e.outvars[0],
    frozenset([best]),
    (tuple(v for v in xs if v not in state),),
    True,
    info.reverse,
    info.length,
    body=info.body,
    body_consts=tuple(consts),
    state=(tuple(state),) if state else (),
    xs=tuple(xs),
  )


def _segments(prog: Program, inputs_live: bool):
  """The batch-dependent equations cut where one value is live: [(ids, x_in, x_out)].

  Values of parameters alone are not among them (recomputed where read). When
  `inputs_live` (a raw input that is the first layer's input must be, for that
  layer to cut as the others do) a batch input is live from its first use to
  its last and a value of the batch alone is computed just before its first
  use; else neither is ever live (tokens read at the top and again by the
  loss; a mask every layer reads): such values are recomputed where read, as
  side inputs.
  """
  data = [
    k
    for k in range(len(prog.eqns))
    if prog.bits(k) & (_B | _PINNED) and (inputs_live or prog.bits(k) != _B)
  ]
  users: dict = {}
  for k in data:
    for v in prog.eqns[k].invars:
      if _is_var(v):
        users.setdefault(v, []).append(k)
  at = {}
  for k in reversed(data):
    uses = [at[u] for v in prog.eqns[k].outvars if _is_var(v) for u in users.get(v, ())]
    at[k] = min(uses) if prog.bits(k) == _B and uses else k
  data.sort(key=lambda k: (at[k], k))
  pos = {k: i for i, k in enumerate(data)}
  first: dict = {}
  last: dict = {}
  for i, k in enumerate(data):
    for v in prog.eqns[k].invars:
      if _is_var(v) and prog.dep.get(v, 0) & _B and (inputs_live or prog.dep[v] != _B):
        d = pos.get(prog.producer.get(v))
        first.setdefault(v, i if d is None else d)  # batch inputs: from their first use
        last[v] = i
  if _is_var(prog.loss) and prog.producer.get(prog.loss) in pos:
    first.setdefault(prog.loss, pos[prog.producer[prog.loss]])
    last[prog.loss] = len(data)
  # v is live at boundary i (just before data[i]) for first[v] < i <= last[v]
  starts: dict = {}
  for v, i in first.items():
    starts.setdefault(i + 1, []).append(v)
  ends: dict = {}
  for v, i in last.items():
    ends.setdefault(i + 1, []).append(v)
  live: set = set()
  cuts = []  # (position, the live var or None)
  for i in range(len(data) + 1):
    live.update(starts.get(i, ()))
    live.difference_update(ends.get(i, ()))
    if len(live) <= 1:
      cuts.append((i, next(iter(live), None)))
  return [(tuple(data[a:b]), x_in, x_out) for (a, x_in), (b, x_out) in zip(cuts, cuts[1:])]


def _piece(prog: Program, ids, x_in, x_out, memo):
  """One piece of a stack: (its equations, with the values of parameters alone and
  of the batch alone (side inputs: a mask) it reads recomputed; its inputs (x,
  *parameter, constant and batch vars); its key), or None when it reads a value
  of parameters and the batch besides its input x."""
  own = set(ids)
  pulled: set = set()
  outer = [v for v in prog.reads(ids) if prog.producer.get(v) not in own]
  acts = [v for v in outer if prog.dep.get(v, 0) & _B and prog.dep[v] != _B]
  sides = [v for v in outer if prog.dep.get(v, 0) == _B]
  if x_in is None:  # a raw input read by the first layer
    x_in = acts[0] if len(acts) == 1 else sides[0] if len(sides) == 1 and not acts else None
  if x_in is None or x_out is None or any(v is not x_in for v in acts):
    return None
  for v in outer:  # values of parameters and constants, or of the batch, alone
    if v is not x_in and prog.producer.get(v) is not None:
      pulled.update(prog.slice([v]))
  eqns = sorted(own | pulled)
  ins, seen = [x_in], {x_in}
  for k in eqns:
    for v in prog.eqns[k].invars:
      if _is_var(v) and v not in seen and prog.producer.get(v) is None:
        ins.append(v)
        seen.add(v)
  key = (
    fingerprint.structure_key([prog.eqns[k] for k in eqns], ins, [x_out], memo),
    tuple(
      fingerprint.value_key(prog.consts[v]) for v in ins if v in prog.consts and v not in prog.lits
    ),
  )
  return eqns, tuple(ins), key


def _runs(prog: Program, inputs_live: bool, memo: dict):
  """The pieces, and the best run as `((equations, layers), (start, period, layers))`."""
  segs = _segments(prog, inputs_live)
  pieces = [_piece(prog, ids, x_in, x_out, memo) for ids, x_in, x_out in segs]
  ident: dict = {}
  keys = [None if p is None else ident.setdefault(p[2], len(ident)) for p in pieces]
  params = set(prog.param_vars)
  S = len(segs)
  n_par = np.cumsum([0] + [0 if p is None else sum(v in params for v in p[1]) for p in pieces])
  size = np.cumsum([0] + [len(ids) for ids, _, _ in segs])
  best, score = None, (0, 0)
  for per in range(1, S // 2 + 1):
    # run[i]: how many pieces from i on equal the piece `per` later (O(S) per period)
    run = [0] * (S + 1)
    for i in range(S - per - 1, -1, -1):
      same = keys[i] is not None and keys[i] == keys[i + per]
      run[i] = run[i + 1] + 1 if same else 0
    for s in range(S - 2 * per + 1):
      n = run[s] // per + 1  # layers: the group at s, repeated
      if n < 2 or (s >= per and run[s - per] >= per):
        continue  # no repeat, or not the start of a run (one starting earlier covers it)
      x_in, x_out = pieces[s][1][0], segs[s + per - 1][2]
      if (
        n_par[s + per] == n_par[s]
        or x_out is None
        or (x_in.aval.shape, x_in.aval.dtype) != (x_out.aval.shape, x_out.aval.dtype)
      ):
        continue
      cand = (int(size[s + n * per] - size[s]), n)
      if cand > score:
        best, score = (s, per, n), cand
  return segs, pieces, score, best


def _loop_stack(prog: Program) -> Stack | None:
  """The longest run of a repeated group of pieces with parameters, checked."""
  memo: dict = {}
  segs, pieces, score, best = max(
    (_runs(prog, live, memo) for live in (True, False)), key=lambda r: r[2]
  )
  params, batch = set(prog.param_vars), set(prog.batch_vars) - prog.state_vars
  if best is None:
    return None
  s, per, n = best
  layers, all_eqns, lits, states, layer_ids = [], set(), [], [], []
  key0 = None
  for j in range(n):
    a, b = s + j * per, s + (j + 1) * per
    ids = [k for ids, _, _ in segs[a:b] for k in ids]
    all_eqns.update(ids)
    eqns, ins, key = _piece(prog, ids, pieces[a][1][0], segs[b - 1][2], memo) or (None, None, None)
    if key is None or (key0 is not None and key != key0):
      raise CutError(
        f"layers 0 and {j} of the repeated stack ({n} layers) differ in how "
        "they use their parameters" + EXPLICIT
      )
    if j == 0:
      key0, layer_eqns, layer_ins = key, eqns, ins
    if [v for v in ins[1:] if v in batch] != [v for v in layer_ins[1:] if v in batch]:
      raise CutError(
        f"layers 0 and {j} of the repeated stack ({n} layers) read different "
        "batch leaves besides the activation; automatic cutting rebuilds one "
        "side input (a mask) for every layer" + EXPLICIT
      )
    layers.append(tuple(v for v in ins[1:] if v in params))
    states.append(tuple(v for v in ins[1:] if v in prog.state_vars))
    layer_ids.append(tuple(eqns))
    lits.append(tuple(prog.consts[v] for v in ins[1:] if v in prog.lits))
  used = [v for row in (*layers, *states) for v in row]
  if len(set(used)) != len(used):
    raise CutError(
      f"the {n} repeated layers share parameter leaves: weights shared by the "
      "layers cannot be split over stages automatically" + EXPLICIT
    )
  return Stack(
    pieces[s][1][0],
    segs[s + n * per - 1][2],
    frozenset(all_eqns),
    tuple(layers),
    False,
    False,
    n,
    tuple(layer_eqns),
    layer_ins,
    segs[s + per - 1][2],
    lits=tuple(lits) if lits and lits[0] else (),
    state=tuple(states) if states and states[0] else (),
    layer_ids=tuple(layer_ids),
  )


def pick(prog: Program) -> Stack | None:
  """The scan stack or the loop stack, whichever holds more parameters (a loop of
  blocks may hold small scans of its own)."""
  loop = _loop_stack(prog)
  try:
    scan = _scan_stack(prog)
  except CutError:
    if loop is None:
      raise
    return loop
  weight = lambda st: sum(
    int(np.prod(v.aval.shape))  # noqa: E731
    for row in st.layers
    for v in row
  )
  if scan is None or (loop is not None and weight(loop) > weight(scan)):
    return loop
  return scan


def emits(prog: Program, stack: Stack):
  """The aux outputs the stack's layers compute (updated model state), as
  `(per layer: its aux indices by slot, the slots' avals, the other aux indices)`;
  a slot is (position in the layer's equations, output), alike in every layer."""
  if stack.scanned:
    return _scan_emits(prog, stack)
  where = {k: (j, i) for j, ids in enumerate(stack.layer_ids) for i, k in enumerate(ids)}
  found: dict = {}  # layer -> {slot: aux index}
  rest = []
  for a, v in enumerate(prog.aux):
    k = prog.producer.get(v) if _is_var(v) else None
    if k is None or k not in where or not stack.state:
      rest.append(a)
      continue
    j, i = where[k]
    found.setdefault(j, {})[(i, prog.eqns[k].outvars.index(v))] = a
  if not found:
    return (), (), tuple(rest)
  slots = sorted(found.get(0, {}))
  if len(found) != stack.length or any(sorted(f) != slots for f in found.values()):
    raise CutError(
      f"the aux returns values computed inside {len(found)} of the stack's "
      f"{stack.length} layers, or different ones per layer; updated model state "
      "must come from every layer alike" + EXPLICIT
    )
  emits = tuple(tuple(found[j][sl] for sl in slots) for j in range(stack.length))
  avals = tuple(prog.aux[a].aval for a in emits[0])
  return emits, avals, tuple(rest)


def _scan_emits(prog: Program, stack: Stack):
  """`emits` of a scanned stack: the aux outputs that are the scan's per-layer outputs
  (ys: the layers' updated state), as one row (the whole stack's) of aux indices,
  their per-layer avals, the other aux indices."""
  (k,) = stack.eqns
  ys = prog.eqns[k].outvars[1:]  # after the one carry
  row = [a for a, v in enumerate(prog.aux) if stack.state and _is_var(v) and v in ys]
  rest = tuple(a for a in range(len(prog.aux)) if a not in row)
  if not row:
    return (), (), rest
  avals = tuple(
    jax.ShapeDtypeStruct(prog.aux[a].aval.shape[1:], prog.aux[a].aval.dtype) for a in row
  )
  return (tuple(row),), avals, rest
