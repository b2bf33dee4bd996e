"""pipeline.cut: a plain loss's jaxpr cut into prologue, a stack of layers, epilogue.

Contract: `cut(jaxpr, n_params, n_aux=0) -> Cut` for `jaxpr = make_jaxpr(flat_loss)(
*param_leaves, *batch_leaves)` with one scalar output, then `n_aux` aux outputs
(metrics, computed by the epilogue: `Cut.epilogue`); raises `CutError` (a `ValueError`) when
the program holds no stack it can pipeline. Read by `ooojax.pipeline`, which
hands `Cut.input_fn`, `Cut.stage_fn(n)` per layer count (`passes.pipeline.balance`)
and `Cut.loss_fn` to `passes.pipeline.execute.lower`.

The stack is found in the top-level equations (top-level `jit` calls inlined):

* a `scan` whose xs are parameter leaves with a leading layer axis (flax
  `nn.scan`, `nnx.scan`, `lax.scan` over stacked weights): one carry (the
  activation), consts computed from constants or from the batch alone;
* a run of structurally identical blocks (a Python loop of layers): the
  batch-dependent equations (those of the batch alone moved to just before
  their first use, or left out and recomputed where read) are cut where a
  single value is live, the activation. Each piece, with the values of
  parameters alone and of the batch alone it reads recomputed inside it, gets a
  key (primitives, params, literals, wiring, shapes; parameter leaves by
  position; `fingerprint.structure_key`), and the run of a repeated group of
  pieces covering the most equations is the stack: one group per layer, each
  reading its own parameter leaves, of equal shapes.

Of the two, the one holding more parameters wins. Values of parameters or of
the batch alone (a weight cast, labels sliced from the tokens) are computed
where they are read: the prologue is the backward slice of the stack's input,
the epilogue the slice of the loss from the stack's output; both may
recompute the same value. Parameter leaves either reads (tied embeddings, the
head) become the executor's `shared` weights. Values of the batch alone that
the layers read (a padding mask) are side inputs (`passes.pipeline.side`):
every stage rebuilds them from its microbatch's `Cut.side` batch leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ooojax.passes import _compat, fingerprint
from ooojax.passes.pipeline import side as side_pass, state as state_pass
from ooojax.passes.pipeline.eqns import evaluate as _evaluate, flatten as _flatten

__all__ = ["Cut", "CutError", "cut"]

EXPLICIT = (
  "; pipeline it with the explicit API instead: ooo.pipeline.value_and_grad("
  "stage_fn, loss_fn, input_fn=..., mesh=..., axis_name=...) with parameters "
  "stacked on a stage axis (docs/pipeline.md)"
)


class CutError(ValueError):
  """The loss holds no stack of layers that automatic cutting can pipeline."""


@dataclasses.dataclass(frozen=True)
class Cut:
  """A loss as `loss_fn(stack(input_fn(inputs, shared)), targets, shared)`.

  Leaf indices refer to the traced function's parameter leaves (`stacked`,
  `shared`) and batch leaves (`inputs`, `targets`).
  """

  layers: int
  scanned: bool  # one scan: `stacked[0]` leaves carry the layer axis
  reverse: bool  # a reverse scan runs layer L-1 first
  stacked: tuple[tuple[int, ...], ...]  # per layer (one row when scanned): its leaves
  shared: tuple[int, ...]  # leaves the prologue or the epilogue read
  inputs: tuple[int, ...]  # batch leaves the prologue reads
  targets: tuple[int, ...]  # batch leaves the epilogue reads
  input_fn: Callable  # (inputs, shared) -> activation
  loss_fn: Callable  # (activation, targets, shared) -> scalar
  layer_fn: Callable = dataclasses.field(repr=False)  # (consts, layer_leaves, x) -> x
  consts_fn: Callable = dataclasses.field(repr=False)  # (side) -> the layers' constants
  side: tuple[int, ...] = ()  # batch leaves every layer reads (a mask's tokens)
  # per-layer data that is no parameter: one (layers, ...) array per value a layer
  # folds into the batch key (flax's per-module dropout keys); stage_fn's `first`
  per_layer: tuple = dataclasses.field(default=(), repr=False)
  n_aux: int = 0  # aux outputs (`epilogue`)
  epilogue: Callable | None = dataclasses.field(default=None, repr=False)
  # ^ (activation, targets, shared) -> (scalar, aux outputs): the loss and the aux
  # model state (`passes.pipeline.state`): per layer, the batch leaves of its state
  # (stage columns after the parameters'), and the loss's aux outputs it updates
  # (`emits`, one zero probe column each, after the state's); `aux_at[i]`: where
  # aux output i comes from, ("epilogue", k) or ("layer", slot)
  state: tuple[tuple[int, ...], ...] = ()
  emits: tuple[tuple[int, ...], ...] = ()
  emit_avals: tuple = ()
  aux_at: tuple = ()

  def stage_fn(self, per: int) -> Callable:
    """`(stage_leaves, x, side=(), first=0) -> x` running the first `per` layers of
    its leaves (`(rows, ...)`, rows >= per: the stage stack is padded to the
    largest count); `side` holds the microbatch's `side` batch leaves, `first` the
    index of the stage's first layer in the stack (it picks `per_layer` rows; may
    be traced)."""

    def stage(p, x, side=(), first=0):
      consts = self.consts_fn(side)  # a mask: rebuilt from this microbatch's leaves
      if self.scanned:  # keep the user's loop: the split pass cuts scans into B/W scans
        p = tuple(a if a.shape[0] == per else a[:per] for a in p)
        return lax.scan(lambda h, ps: (self.layer_fn(consts, ps, h), None), x, p)[0]
      for j in range(per):
        own = tuple(jnp.asarray(a)[first + j] for a in self.per_layer)
        x = self.layer_fn(consts, tuple(a[j] for a in p), x, *((own,) if own else ()))
      return x

    return stage

  def stage_params(self, leaves: Sequence[Any], counts: Sequence[int]) -> tuple:
    """The stack's leaves as the executor wants them: `(V, max(counts), ...)`, virtual
    stage v holding the next `counts[v]` layers, then zero rows (`balance.balance`)."""
    if self.scanned:
      cols = [leaves[i] for i in self.stacked[0]]
      if self.reverse:
        cols = [jnp.flip(a, 0) for a in cols]
    else:
      cols = [
        jnp.stack([leaves[row[i]] for row in self.stacked]) for i in range(len(self.stacked[0]))
      ]
    return state_pass.columns(cols, counts)

  def stage_state(self, b_leaves: Sequence[Any], counts: Sequence[int]) -> tuple:
    """The stage columns after `stage_params`': the layers' state (batch leaves), then
    a zero probe per updated leaf (`passes.pipeline.state`); `()` without state."""
    width = len(self.state[0]) if self.state else 0
    cols = [jnp.stack([b_leaves[row[i]] for row in self.state]) for i in range(width)]
    cols += [jnp.zeros((self.layers, *a.shape), a.dtype) for a in self.emit_avals]
    return state_pass.columns(cols, counts) if cols else ()

  def emitted(self, probe_grads, counts: Sequence[int], microbatches: int) -> dict:
    """`{aux index: updated leaf}` from the probes' summed gradients: the mean over
    microbatches of each layer's update."""
    out = {}
    for k, g in enumerate(probe_grads):
      g = state_pass.rows_of(g, counts) / microbatches
      for j, row in enumerate(self.emits):
        out[row[k]] = g[j].astype(self.emit_avals[k].dtype)
    return out

  def grads(self, leaves: Sequence[Any], stage_grads, shared_grads, counts: Sequence[int]) -> list:
    """The gradient of every parameter leaf, in the leaves' order (zeros for unread
    ones): the inverse of `stage_params` (padding rows dropped)."""
    out: list = [None] * len(leaves)
    for k, g in enumerate(stage_grads[: len(self.stacked[0])]):  # not state's columns
      g = state_pass.rows_of(g, counts)
      if self.scanned:
        out[self.stacked[0][k]] = jnp.flip(g, 0) if self.reverse else g
      else:
        for j, row in enumerate(self.stacked):
          out[row[k]] = g[j]
    for i, g in zip(self.shared, shared_grads):
      out[i] = g
    return [jnp.zeros_like(x) if g is None else g for x, g in zip(leaves, out)]


# --- the program's equations ------------------------------------------------------
_P, _B = 1, 2  # depends on a parameter / on the batch
_PINNED = 4  # effectful: never recomputed elsewhere


def _is_var(v) -> bool:
  return isinstance(v, _compat.Var) and not isinstance(v, _compat.DropVar)


@dataclasses.dataclass(frozen=True)
class _Program:
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


def _program(closed, n_params: int, n_aux: int = 0, state: Sequence[int] = ()) -> _Program:
  eqns, outs, consts = _flatten(closed)
  invars = list(closed.jaxpr.invars)
  dep = {v: _P for v in invars[:n_params]}
  dep.update({v: _B for v in invars[n_params:]})
  state_vars = frozenset(invars[n_params + i] for i in state)
  dep.update({v: _P for v in state_vars})  # model state goes with its layer, as weights do
  producer = {}
  lits: set = set()
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
  return _Program(
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
class _Stack:
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
  state: tuple = ()  # per layer: its model-state invars (loop stacks)
  layer_ids: tuple = ()  # per layer: its equations, position i of each alike (loop stacks)


def _scan_stack(prog: _Program) -> _Stack | None:
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
  if any(_is_var(v) and v in prog.state_vars for v in (*consts, *xs)):
    raise CutError(
      f"{where} reads model state (state_argnums: BatchNorm statistics); automatic "
      "cutting carries per-layer state through a Python loop of blocks, not a scan" + EXPLICIT
    )
  other = [v for v in xs if not (_is_var(v) and v in params)]
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
  return _Stack(
    carry[0],
    e.outvars[0],
    frozenset([best]),
    (tuple(xs),),
    True,
    info.reverse,
    info.length,
    body=info.body,
    body_consts=tuple(consts),
  )


def _segments(prog: _Program, inputs_live: bool):
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


def _piece(prog: _Program, ids, x_in, x_out, memo):
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


def _runs(prog: _Program, inputs_live: bool, memo: dict):
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


def _loop_stack(prog: _Program) -> _Stack | None:
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
  return _Stack(
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


def _pick(prog: _Program) -> _Stack | None:
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


def _emits(prog: _Program, stack: _Stack):
  """The aux outputs the stack's layers compute (updated model state), as
  `(per layer: its aux indices by slot, the slots' avals, the other aux indices)`;
  a slot is (position in the layer's equations, output), alike in every layer."""
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


def cut(jaxpr, n_params: int, n_aux: int = 0, state: Sequence[int] = ()) -> Cut:
  """Cuts `jaxpr` (`(*param_leaves, *batch_leaves) -> (loss, *aux)`) into prologue,
  stack, epilogue (which computes the aux outputs too). `state`: batch leaves of
  model state (BatchNorm statistics), each read by one layer of the stack (or by the
  prologue or epilogue, then passed whole): see `passes.pipeline.state`."""
  prog = _program(jaxpr, n_params, n_aux, state)
  stack = _pick(prog)
  if stack is None:
    rand = side_pass.check(
      [e for k, e in enumerate(prog.eqns) if prog.bits(k) == _B], (), "the loss"
    )
    raise CutError(
      "found no repeated stack of layers in the loss: neither a scan over "
      "stacked parameters (nn.scan, nnx.scan, lax.scan) nor a run of "
      "identical blocks whose parameters have equal shapes (blocks that also "
      "read a per-example value computed from parameters and the batch are "
      "not cut either)" + (f"; {rand}" if rand else "") + EXPLICIT
    )
  emits, emit_avals, rest = _emits(prog, stack)
  aux = [prog.aux[a] for a in rest]  # computed by the epilogue; the others by the layers
  aux_at = {a: ("epilogue", k) for k, a in enumerate(rest)}
  aux_at.update({a: ("layer", k) for row in emits for k, a in enumerate(row)})
  pro = prog.slice([stack.x_in])
  epi = prog.slice([prog.loss], stop=[stack.x_out])
  epi_aux = prog.slice([prog.loss, *aux], stop=[stack.x_out])
  inside = stack.eqns.intersection(pro + epi_aux)
  if inside:
    e = prog.eqns[min(inside)]
    what = "the loss" if stack.eqns.intersection(pro + epi) else "the aux output"
    raise CutError(
      f"{what} reads a value from inside the stack ({e.primitive.name} -> "
      f"{e.outvars[0].aval}, e.g. per-layer outputs, sown intermediates or "
      "mutated batch statistics: name their argument with state_argnums); only "
      "the last layer's output may leave the stack" + EXPLICIT
    )
  index = {v: i for i, v in enumerate(prog.param_vars)}
  b_index = {v: i for i, v in enumerate(prog.batch_vars)}
  stack_params = {v for row in stack.layers for v in row}
  direct = {v for v in prog.aux if _is_var(v)}  # aux leaves that are inputs themselves
  outside = (prog.reads(pro) | prog.reads(epi_aux) | direct) & set(prog.param_vars)
  if outside & stack_params:
    v = next(iter(outside & stack_params))
    raise CutError(
      f"a parameter of the stack ({v.aval}) is also read outside it; automatic "
      "cutting shares only weights outside the stack" + EXPLICIT
    )
  stack_state = {v for row in stack.state for v in row}
  if stack_state & (prog.reads(pro) | prog.reads(epi_aux) | direct):
    raise CutError(
      "model state a layer of the stack reads is also read outside it; automatic "
      "cutting keeps each layer's state with its layer" + EXPLICIT
    )
  shared = tuple(sorted(index[v] for v in outside))
  inputs = tuple(sorted(b_index[v] for v in (prog.reads(pro) | {stack.x_in}) if v in b_index))
  targets = tuple(sorted(b_index[v] for v in prog.reads(epi_aux) | direct if v in b_index))
  consts = prog.consts
  pro_eqns = [prog.eqns[k] for k in pro]
  epi_eqns = [prog.eqns[k] for k in epi]
  aux_eqns = [prog.eqns[k] for k in epi_aux]
  shared_vars = [prog.param_vars[i] for i in shared]

  def input_fn(ins, sh):
    env = dict(consts)
    env.update(zip([prog.batch_vars[i] for i in inputs], ins))
    env.update(zip(shared_vars, sh))
    return _evaluate(pro_eqns, env, [stack.x_in])[0]

  def loss_fn(y, tg, sh):
    env = dict(consts)
    env.update(zip([prog.batch_vars[i] for i in targets], tg))
    env.update(zip(shared_vars, sh))
    env[stack.x_out] = y
    return _evaluate(epi_eqns, env, [prog.loss])[0]

  def epilogue(y, tg, sh):
    env = dict(consts)
    env.update(zip([prog.batch_vars[i] for i in targets], tg))
    env.update(zip(shared_vars, sh))
    env[stack.x_out] = y
    loss, *out = _evaluate(aux_eqns, env, [prog.loss, *aux])
    return loss, tuple(out)

  # side inputs: values of the batch alone every layer reads (a mask), rebuilt per
  # microbatch from the batch leaves `side` on every stage (`passes.pipeline.side`)
  if stack.scanned:
    c_vars = [v for v in stack.body_consts if _is_var(v)]
    c_ids = prog.slice(c_vars)
    c_eqns = [prog.eqns[k] for k in c_ids]
    side_vars = [v for v in prog.reads(c_ids) | set(c_vars) if v in b_index]
    side_eqns = [prog.eqns[k] for k in c_ids if prog.bits(k) == _B]
    why = side_pass.check(side_eqns, [v for v in c_vars if prog.dep.get(v) == _B], "the stack")
  else:
    side_vars = [v for v in stack.layer_ins[1:] if v in b_index and v not in stack_state]
    side_eqns = [prog.eqns[k] for k in stack.layer_eqns if prog.bits(k) == _B]
    why = side_pass.check(side_eqns, side_vars, "the stack")
  if why:
    raise CutError(why + EXPLICIT)
  side = tuple(sorted(b_index[v] for v in side_vars))
  s_vars = [prog.batch_vars[i] for i in side]

  if stack.scanned:

    def consts_fn(sd):
      env = dict(consts)
      env.update(zip(s_vars, sd))
      _evaluate(c_eqns, env, [])
      return [v.val if isinstance(v, _compat.Literal) else env[v] for v in stack.body_consts]

    def layer_fn(cs, p, x):
      body = stack.body
      return _compat.eval_jaxpr(body.jaxpr, body.consts, *cs, x, *p)[0]
  else:
    l_eqns = [prog.eqns[k] for k in stack.layer_eqns]
    l_params = [v for v in stack.layer_ins[1:] if v in stack_params]
    l_lits = [v for v in stack.layer_ins[1:] if v in prog.lits]
    l_state = list(stack.state[0]) if stack.state else []
    l_emits = [prog.aux[a] for a in emits[0]] if emits else []
    n_p, n_s = len(l_params), len(l_state)

    def consts_fn(sd):
      return sd

    def layer_fn(cs, p, x, own=()):  # own: this layer's `per_layer` values (else layer 0's)
      env = dict(consts)
      env.update(zip(s_vars, cs))
      env[stack.layer_ins[0]] = x
      env.update(zip(l_params, p[:n_p]))
      # state (p[n_p:n_p + n_s]) is not differentiated; the updated state leaves by
      # the probes (p[n_p + n_s:]) (`passes.pipeline.state`)
      env.update(zip(l_state, (lax.stop_gradient(a) for a in p[n_p : n_p + n_s])))
      env.update(zip(l_lits, own))
      y, *news = _evaluate(l_eqns, env, [stack.layer_out, *l_emits])
      if not news:
        return y
      news = tuple(lax.stop_gradient(a) for a in news)
      return state_pass.emit(y, tuple(p[n_p + n_s :]), news)

  return Cut(
    stack.length,
    stack.scanned,
    stack.reverse,
    tuple(tuple(index[v] for v in row) for row in stack.layers),
    shared,
    inputs,
    targets,
    input_fn,
    loss_fn,
    layer_fn,
    consts_fn,
    side,
    tuple(np.stack(col) for col in zip(*stack.lits)) if stack.lits else (),
    len(rest),
    epilogue,
    tuple(tuple(b_index[v] for v in row) for row in stack.state),
    emits,
    emit_avals,
    tuple(aux_at[a] for a in range(len(prog.aux))),
  )
