"""Model state (BatchNorm statistics) carried through a tiled train step.

`make_train_step(..., steps=n, state_argnums=...)` runs n steps in one table;
step t + 1's layers read the statistics step t updated, so the update must
happen inside the tick loop. The stack's per-layer state travels as extra
stage columns (`passes.pipeline.state`: the state, then zero probes whose
summed "gradient" is the microbatches' updates). At a chunk's `U` tick (after
every W of its step, before any F of the next) the carried updater
(`carry_updater`) sets each state column to its probe's sum / M, the mean
update the one-step step returns, and records the sums per step (the per-step
aux). Which aux leaf updates which state leaf is found by structure: the aux
holds a subtree shaped like the state argument (flax: `{"batch_stats":
updates["batch_stats"], ...}`), each leaf emitted by the layer that reads the
state leaf (`state_sources`).

State outside the stack that only the last stage reads (a BatchNorm in the head,
or in the stem trained on batch statistics: its forward normalises with the
batch's own, and only its update reads the running ones, recomputed by the last
stage's epilogue, `Cut.targets`) travels as that stage's shared weights
(`outside`, `outside_loss`, `outside_updater`): the epilogue hands its update to the leaf as the
leaf's "gradient" (`passes.pipeline.state.emit` on the loss), and the owner's
update at its U tick sets the leaf to the sum over the step's microbatches / M.
State the first stage's forward reads (a stem BatchNorm that normalises with
its running statistics) would wait for the last stage's update of the step
before: refused with a named error (`steps=1` carries it).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ooojax.passes.pipeline import state as state_pass
from ooojax.passes.pipeline.train import Updater

_FIX = (
  "; use steps=1 and pass the state returned in each step's aux to the next "
  "(docs/guides/pipeline-real-losses.md)"
)


def _subtrees(node):
  yield node
  if jax.tree_util.treedef_is_leaf(jax.tree.structure(node)):
    return
  for child in jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]:
    yield from _subtrees(child)


def check_carried(cut, b_leaves: Sequence, args: Sequence) -> None:
  """Refuses state leaves the first stage's forward reads (see the module)."""
  in_stack = {b for row in cut.state for b in row}
  early = [b for _, pos in args for b in pos if b not in in_stack and b in (*cut.inputs, *cut.side)]
  if early:
    x = b_leaves[early[0]]
    raise ValueError(
      f"make_train_step(steps>1) carries the state of the stack's layers and the "
      f"state only the last stage reads; a state leaf "
      f"({jnp.result_type(x)}{list(jnp.shape(x))}) is read by the first stage's "
      "forward (a BatchNorm in the stem that normalises with its running "
      "statistics), which would wait for the last stage's update of the step "
      "before" + _FIX
    )


def outside(cut, args: Sequence) -> tuple[int, ...]:
  """The state leaves outside the stack (a BatchNorm in the stem trained on batch
  statistics, or in the head): only the last stage reads them, to compute their
  update (`Cut.targets`), so they travel as its shared weights."""
  in_stack = {b for row in cut.state for b in row}
  return tuple(b for _, pos in args for b in pos if b not in in_stack and b in cut.targets)


def state_sources(cut, b_leaves: Sequence, args: Sequence, aux_tree, aux_leaves: Sequence) -> tuple:
  """`(per state column of `cut` (`cut.state[row][i]`) the probe column `k`
  (`cut.emits[row][k]`) that carries its update, or None (not updated); {state leaf
  outside the stack: the index of the epilogue's aux output that updates it})`.
  `args`: the state arguments as `(treedef, batch leaf positions)`; `aux_leaves`:
  the aux outputs' shapes, one microbatch's."""
  check_carried(cut, b_leaves, args)
  in_stack = {b: (r, i) for r, row in enumerate(cut.state) for i, b in enumerate(row)}
  if aux_tree is None:
    raise ValueError(
      "state_argnums needs has_aux=True: the loss returns the updated state in its aux"
    )
  emit_at = {a: (r, k) for r, row in enumerate(cut.emits) for k, a in enumerate(row)}
  epi_at = {a: k for a, (kind, k) in enumerate(cut.aux_at) if kind == "epilogue"}
  idx = aux_tree.unflatten(list(range(aux_tree.num_leaves)))
  width = len(cut.state[0]) if cut.state else 0
  src: list = [None] * width
  out: dict = {}  # state leaf outside the stack -> the epilogue's aux output updating it
  for treedef, pos in args:

    def fits(sub, pos=pos):  # each leaf emitted by the layer reading it, same shape
      if jax.tree.structure(sub) != treedef:
        return False
      for a, b in zip(jax.tree.leaves(sub), pos):
        if b not in in_stack:  # outside the stack: the epilogue's, of the leaf's shape
          fit = a in epi_at and jnp.shape(b_leaves[b]) == jnp.shape(aux_leaves[a])
          if not fit or jnp.result_type(b_leaves[b]) != jnp.result_type(aux_leaves[a]):
            return False
          continue
        r, i = in_stack[b]
        if a not in emit_at or emit_at[a][0] != r:
          return False
        aval = cut.emit_avals[emit_at[a][1]]
        shape = (cut.layers, *aval.shape) if cut.scanned else aval.shape  # stacked: whole
        if shape != jnp.shape(b_leaves[b]) or aval.dtype != jnp.result_type(b_leaves[b]):
          return False
      return True

    found = [s for s in _subtrees(idx) if fits(s)]
    if len(found) != 1:
      raise ValueError(
        "make_train_step(steps>1) feeds each step's updated model state to the next "
        "step inside one program, so it must find the update in the aux: "
        + (
          "no subtree of the aux has the state argument's structure, each leaf "
          "updated by the layer that reads it; return it (flax: {'batch_stats': "
          "updates['batch_stats'], ...})"
          if not found
          else f"{len(found)} subtrees of the aux match the state argument; return one"
        )
        + _FIX
      )
    for a, b in zip(jax.tree.leaves(found[0]), pos):
      if b not in in_stack:
        out[b] = epi_at[a]
        continue
      r, i = in_stack[b]
      k = emit_at[a][1]
      if src[i] not in (None, k):  # rows disagree: cannot happen for equal layers
        raise ValueError("the stack's layers update their state leaves in different orders" + _FIX)
      src[i] = k
  return tuple(src), out


def carry_updater(inner: Updater, n: int, src: dict, microbatches: int, rows: int = 1) -> Updater:
  """`inner` (the parameters' updater, over the first `n` stage columns) with the
  state columns after them set to their probe sums / M at each U tick
  (`src["cols"]`: `state_sources`, filled before the program is traced), and the
  probe sums recorded per step in the chunk's optimizer rows `(inner's, sums
  (steps, ...) per probe, the step count)`. `rows`: stage columns per leaf (a
  loop's layers: one per row, `Cut.widths`)."""

  def chunk(c, w, g, o_c, o_rep):
    o_in, hist, count = o_c
    new, o_in, o_rep = inner.chunk(c, w[:n], g[:n], o_in, o_rep)
    cols = [None if k is None else k * rows + j for k in src["cols"] for j in range(rows)]
    sums = g[n + len(cols) :]
    st = [
      w[n + i] if k is None else (sums[k] / microbatches).astype(w[n + i].dtype)
      for i, k in enumerate(cols)
    ]
    hist = tuple(h.at[count].set(s.astype(h.dtype)) for h, s in zip(hist, sums))
    return [*new, *st, *w[n + len(cols) :]], (o_in, hist, count + 1), o_rep

  return Updater(chunk, inner.shared, inner.start, inner.finish)


def history(probe_cols: Sequence, steps: int) -> tuple:
  """The per-step record's initial rows: per probe column `(V, ...)`, zeros
  `(V, steps, ...)`; and the step count per virtual stage."""
  hist = tuple(jnp.zeros((p.shape[0], steps, *p.shape[1:]), p.dtype) for p in probe_cols)
  V = probe_cols[0].shape[0] if probe_cols else 1
  return hist, jnp.zeros((V,), jnp.int32)


def final_state(
  cut, cols, counts, order, b_leaves: Sequence, args: Sequence, outside_vals=None
) -> tuple:
  """The state arguments' trees after the last step, from the carried state
  columns (`cols`, stage rows in `order` or virtual-stage order) and the carried
  leaves outside the stack (`outside_vals`: {batch leaf: value})."""
  if order is not None:
    cols = [x[np.argsort(order)] for x in cols]
  out = list(b_leaves)
  for b, x in (outside_vals or {}).items():
    out[b] = x
  for i, col in enumerate(cut.groups(cols, counts)):
    if cut.scanned:
      out[cut.state[0][i]] = cut.layer_order(state_pass.rows_of(col, counts))
      continue
    for row, x in zip(cut.state, state_pass.layers_of(col, counts)):
      out[row[i]] = x
  return tuple(treedef.unflatten([out[b] for b in pos]) for treedef, pos in args)


def outside_loss(loss_fn, targets, outs, n_p: int, src: dict):
  """`loss_fn` (`(y, targets, shared) -> (loss, aux)`) with the state leaves `outs`
  (batch leaves among `targets`) taken from the shared weights after the first
  `n_p` instead, not differentiated; the aux outputs that update them
  (`src["outside"]`) become their "gradient" (`passes.pipeline.state.emit`)."""
  at = [targets.index(b) for b in outs]
  keep = [k for k in range(len(targets)) if k not in at]

  def loss(y, tg, sh):
    full = [None] * len(targets)
    for k, x in zip(keep, tg):
      full[k] = x
    for k, x in zip(at, sh[n_p:]):
      full[k] = jax.lax.stop_gradient(x)[None]  # a row: the loss reads state at [0]
    val, aux = loss_fn(y, tuple(full), tuple(sh[:n_p]))
    upd = [(x, k) for x, k in zip(sh[n_p:], src["outside"]) if k is not None]
    probes = tuple(x for x, _ in upd)
    news = tuple(jax.lax.stop_gradient(aux[k]).astype(x.dtype) for x, k in upd)
    return state_pass.emit(val, probes, news), aux

  return loss


def outside_updater(inner: Updater, n_params: int, src: dict, microbatches: int) -> Updater:
  """`inner` with the shared leaves after the first `n_params` (the state leaves
  outside the stack, `outside`) set at their owner's update to their summed
  "gradient" / M: the mean of the step's updates (`src["outside"][j]`: the aux
  output updating leaf j, or None: never updated, kept)."""

  def shared(key, js, sh, g, o_rep):
    new = list(sh)
    mine = [i for i, j in enumerate(js) if j < n_params]
    if mine:
      out, o_rep = inner.shared(
        key, [js[i] for i in mine], [sh[i] for i in mine], [g[i] for i in mine], o_rep
      )
      for i, x in zip(mine, out):
        new[i] = x
    for i, j in enumerate(js):
      if j >= n_params and src["outside"][j - n_params] is not None:
        new[i] = (g[i] / microbatches).astype(sh[i].dtype)
    return new, o_rep

  return Updater(inner.chunk, shared, inner.start, inner.finish)
