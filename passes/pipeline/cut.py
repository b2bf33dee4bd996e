"""pipeline.cut: a plain loss's jaxpr cut into prologue, a stack of layers, epilogue.

Contract: `cut(jaxpr, n_params, n_aux=0, state=()) -> Cut` for `jaxpr =
make_jaxpr(flat_loss)(*param_leaves, *batch_leaves)` with one scalar output, then
`n_aux` aux outputs (metrics, computed by the epilogue: `Cut.epilogue`, or updated
model state, computed by the layers: `Cut.emits`); `state` names the batch leaves
of model state; raises `CutError` (a `ValueError`) when
the program holds no stack it can pipeline. Read by `ooojax.pipeline`, which
hands `Cut.input_fn`, `Cut.stage_fn(n)` per layer count (`passes.pipeline.balance`)
and `Cut.loss_fn` to `passes.pipeline.execute.lower`.

The stack is found (`passes.pipeline.stack`) in the top-level equations
(top-level `jit` calls inlined):

* a `scan` whose xs are parameter leaves with a leading layer axis (flax
  `nn.scan`, `nnx.scan`, `lax.scan` over stacked weights), and model state
  stacked the same way: one carry (the activation), consts computed from
  constants or from the batch alone, ys only the layers' updated state;
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
every stage rebuilds them from its microbatch's `Cut.side` batch leaves. Model
state (`state`: BatchNorm statistics) travels with its layer, and the state a
layer updates comes back by `passes.pipeline.state`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ooojax.passes import _compat
from ooojax.passes.pipeline import side as side_pass, state as state_pass
from ooojax.passes.pipeline.eqns import evaluate as _evaluate
from ooojax.passes.pipeline.stack import (
  _B,
  EXPLICIT,
  CutError,
  _is_var,
  emits as _emits,
  pick as _pick,
  program as _program,
)

__all__ = ["Cut", "CutError", "cut"]


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

  def per_leaf(self, counts: Sequence[int]) -> int:
    """Stage columns per leaf of a layer: one for a scan's; `max(counts)` for a
    loop's, a row each (`passes.pipeline.state.columns`)."""
    return 1 if self.scanned else max(counts)

  def widths(self, counts: Sequence[int]) -> tuple[int, int, int]:
    """How many stage columns the executor gets: of the parameters (`stage_params`),
    then of the state and of the probes (`stage_state`); `per_leaf` per leaf."""
    r = self.per_leaf(counts)
    n_s = len(self.state[0]) if self.state else 0
    return len(self.stacked[0]) * r, n_s * r, len(self.emit_avals) * r

  def _width(self) -> int:  # leaves per layer: parameters, state, probes
    return len(self.stacked[0]) + (len(self.state[0]) if self.state else 0) + len(self.emit_avals)

  def groups(self, cols: Sequence, counts: Sequence[int]) -> list:
    """Stage columns grouped per leaf: an array (a scan's), or a loop's rows."""
    if self.scanned:
      return list(cols)
    r = self.per_leaf(counts)
    return [tuple(cols[i : i + r]) for i in range(0, len(cols), r)]

  def stage_fn(self, per: int) -> Callable:
    """`(stage_leaves, x, side=(), first=0) -> x` running the first `per` layers of
    its leaves (`stage_params` then `stage_state`'s columns of one virtual stage,
    with at least `per` rows: the stage stack is padded to the largest count);
    `side` holds the microbatch's `side` batch leaves, `first` the index of the
    stage's first layer in the stack (it picks `per_layer` rows; may be traced)."""

    def stage(p, x, side=(), first=0):
      consts = self.consts_fn(side)  # a mask: rebuilt from this microbatch's leaves
      if self.scanned:  # keep the user's loop: the split pass cuts scans into B/W scans
        p = tuple(a if a.shape[0] == per else a[:per] for a in p)
        return lax.scan(lambda h, ps: (self.layer_fn(consts, ps, h), None), x, p)[0]
      width = self._width()
      rows, extra = divmod(len(p), width)
      assert not extra and rows >= per, (len(p), width, per)
      for j in range(per):  # leaf i's row j is its own array (`state.columns`)
        own = tuple(jnp.asarray(a)[first + j] for a in self.per_layer)
        row = tuple(p[i * rows + j] for i in range(width))
        x = self.layer_fn(consts, row, x, *((own,) if own else ()))
      return x

    return stage

  def stage_params(self, leaves: Sequence[Any], counts: Sequence[int]) -> tuple:
    """The stack's leaves as the executor wants them (`passes.pipeline.state.columns`):
    virtual stage v holds the next `counts[v]` layers, then zero rows; a scan's leaf
    is one `(V, max(counts), ...)` column, a loop's `max(counts)` columns `(V, ...)`."""
    if self.scanned:
      cols = [leaves[i] for i in self.stacked[0]]
      if self.reverse:
        cols = [jnp.flip(a, 0) for a in cols]
    else:
      cols = [[leaves[row[i]] for row in self.stacked] for i in range(len(self.stacked[0]))]
    return state_pass.columns(cols, counts)

  def stage_state(self, b_leaves: Sequence[Any], counts: Sequence[int]) -> tuple:
    """The stage columns after `stage_params`': the layers' state (batch leaves), then
    a zero probe per updated leaf (`passes.pipeline.state`); `()` without state."""
    width = len(self.state[0]) if self.state else 0
    if self.scanned:  # one row of leaves stacked over the layers already
      cols = [self.layer_order(b_leaves[i]) for i in self.state[0]] if self.state else []
      cols += [jnp.zeros((self.layers, *a.shape), a.dtype) for a in self.emit_avals]
    else:
      cols = [[b_leaves[row[i]] for row in self.state] for i in range(width)]
      cols += [[jnp.zeros(a.shape, a.dtype)] * self.layers for a in self.emit_avals]
    return state_pass.columns(cols, counts) if cols else ()

  def layer_order(self, a):
    """A leaf stacked over a scan's layers, in the order the stages run them (and
    back: a reverse scan runs layer L-1 first)."""
    return jnp.flip(a, 0) if self.reverse else a

  def emitted(self, probe_grads, counts: Sequence[int], microbatches: int) -> dict:
    """`{aux index: updated leaf}` from the probes' summed gradients (their stage
    columns): the mean over microbatches of each layer's update (stacked over the
    layers when scanned)."""
    out = {}
    for k, g in enumerate(self.groups(probe_grads, counts)):
      dt = self.emit_avals[k].dtype
      if self.scanned:
        g = self.layer_order(state_pass.rows_of(g, counts) / microbatches)
        out[self.emits[0][k]] = g.astype(dt)
        continue
      for row, x in zip(self.emits, state_pass.layers_of(g, counts)):
        out[row[k]] = (x / microbatches).astype(dt)
    return out

  def grads(self, leaves: Sequence[Any], stage_grads, shared_grads, counts: Sequence[int]) -> list:
    """The gradient of every parameter leaf, in the leaves' order (zeros for unread
    ones): the inverse of `stage_params` (padding rows dropped)."""
    out: list = [None] * len(leaves)
    n = self.widths(counts)[0]
    for k, g in enumerate(self.groups(stage_grads[:n], counts)):  # not state's columns
      if self.scanned:
        g = state_pass.rows_of(g, counts)
        out[self.stacked[0][k]] = jnp.flip(g, 0) if self.reverse else g
        continue
      for row, x in zip(self.stacked, state_pass.layers_of(g, counts)):
        out[row[k]] = x
    for i, g in zip(self.shared, shared_grads):
      out[i] = g
    return [jnp.zeros_like(x) if g is None else g for x, g in zip(leaves, out)]


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
    # the stage columns are the layers' parameters, their state, then the probes
    # (`passes.pipeline.state`); the body takes the scan's xs in its own order
    s_row = stack.state[0] if stack.state else ()
    n_p, n_s = len(stack.layers[0]), len(s_row)
    col = {v: i for i, v in enumerate((*stack.layers[0], *s_row))}
    xs_cols = [col[v] for v in stack.xs]
    (k_scan,) = stack.eqns
    ys = prog.eqns[k_scan].outvars[1:]
    ys_at = [ys.index(prog.aux[a]) for a in emits[0]] if emits else []

    def consts_fn(sd):
      env = dict(consts)
      env.update(zip(s_vars, sd))
      _evaluate(c_eqns, env, [])
      return [v.val if isinstance(v, _compat.Literal) else env[v] for v in stack.body_consts]

    def layer_fn(cs, p, x):
      body = stack.body
      cols = [*p[:n_p], *(lax.stop_gradient(a) for a in p[n_p : n_p + n_s])]
      y, *out = _compat.eval_jaxpr(body.jaxpr, body.consts, *cs, x, *(cols[i] for i in xs_cols))
      if not ys_at:
        return y
      news = tuple(lax.stop_gradient(out[j]) for j in ys_at)
      return state_pass.emit(y, tuple(p[n_p + n_s :]), news)
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
