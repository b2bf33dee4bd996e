"""Several pipelined train steps per call of a plain loss: `make_train_step(steps=n)`.

One call runs a table tiled over `n` steps (`passes.pipeline.steps.tile`): step
t + 1's warm-up overlaps step t's drain, and each stage's optimizer update runs
inside the tick loop at its `U` tick, on its own shard. The state is
`make_train_step`'s (`PipelineTrainState`: `StageParams`, and the optimizer
state of `optimizer.init(StageParams)`), so the two checkpoint alike.

Per tick the optimizer sees one group of leaves, the others replaced by scalar
placeholders (a leaf-wise update ignores them):

* chunk c's layers (`stacked`, its rows), at its `U` tick;
* `shared` leaves one end alone reads (the embedding on the first stage; a
  final norm, an untied head on the last; found with JAX's DCE on the two
  ends' jaxprs): at that stage's `U` tick on its device, broadcast to the
  others' replicas at the end of the call;
* `shared` leaves both ends read (tied embeddings), at the plan's `sync` tick:
  their gradient summed over the stages, the same update on every device. The
  table is then tiled with `shared=True`, so the first stage's next forward
  waits for the last stage's update: a barrier (1F1B: free; ZB-H2: its first
  stage waits for the last stage's deferred W, so its steady bubble is its
  one-step bubble again, `steady_state(shared=True)`);
* the `rest` (leaves the loss never reads: zero gradients), after the loop,
  one update per step.

State that is not a parameter's (Adam's step count) advances once per step in
each group's own copy. This is exact for optimizers that act leaf by leaf
(sgd, momentum, adam, adamw, schedules); `init` refuses one whose update of a
leaf reads another leaf's gradient (`clip_by_global_norm`), found on the
optimizer's jaxpr: a stage cannot update before every stage's gradient is in,
which is what tiling removes. Use `steps=1` for those (exact there).

Model state (`state_argnums`: BatchNorm statistics of the stack's layers)
rides along as extra stage columns, set at each chunk's `U` tick to the
step's update (`ooojax.pipeline._tiled_state`); the call then returns
`state, losses, model_state`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from ooojax.passes import _compat
from ooojax.passes.pipeline.steps import tile
from ooojax.passes.pipeline.train import Updater, lower_updates
from ooojax.pipeline._train import PipelineTrainState, PipelineTrainStep, StageParams


@dataclasses.dataclass(frozen=True)
class _Label:
  """Which parameter leaf an optimizer-state leaf mirrors (`kind` in stacked /
  shared / rest), or `kind == "n"`: not a parameter's (a step count)."""

  kind: str
  index: int


class _Groups:
  """The optimizer state's leaves sorted by what they mirror, and the updates of
  one group with the other groups' leaves as scalar placeholders."""

  def __init__(self, optimizer, params: StageParams, opt_state):
    self.opt = optimizer
    labels = StageParams(
      tuple(_Label("s", k) for k in range(len(params.stacked))),
      tuple(_Label("h", j) for j in range(len(params.shared))),
      tuple(_Label("r", j) for j in range(len(params.rest))),
    )
    mapped = optax.tree_map_params(
      optimizer,
      lambda _, lab: lab,
      opt_state,
      labels,
      transform_non_params=lambda x: jax.tree.map(lambda _: _Label("n", 0), x),
    )
    leaves, self.treedef = jax.tree.flatten(opt_state)
    self.labels = jax.tree.leaves(mapped, is_leaf=lambda x: isinstance(x, _Label))
    if len(self.labels) != len(leaves):
      raise TypeError(
        "make_train_step(steps>1) could not match the optimizer state's "
        "leaves to the parameters (optax.tree_map_params); use steps=1"
      )
    self.dtypes = [x.dtype for x in leaves]
    self.p_dtypes = jax.tree.map(lambda x: x.dtype, params)
    self.sizes = (len(params.stacked), len(params.shared), len(params.rest))

  def split(self, opt_state):
    """`(o_stage, o_rep)`: stage-sharded leaves, and the others by kind."""
    leaves = jax.tree.leaves(opt_state)
    pick = lambda kind: tuple(
      x
      for x, lab in zip(leaves, self.labels)  # noqa: E731
      if lab.kind == kind
    )
    return pick("s"), {"h": pick("h"), "r": pick("r"), "n": pick("n")}

  def join(self, o_stage, o_rep):
    its = {"s": iter(o_stage), "h": iter(o_rep["h"]), "r": iter(o_rep["r"]), "n": iter(o_rep["n"])}
    return self.treedef.unflatten([next(its[lab.kind]) for lab in self.labels])

  def update(self, kind: str, params, grads, state, js=None):
    """One group's update: `params` / `grads` its leaves (those at positions `js`
    of its part of `StageParams`, default all), `state` its state leaves by kind
    ("s"/"h"/"r", then "n"); returns (new params, new state)."""
    slot = {"s": 0, "h": 1, "r": 2}[kind]
    dts = (self.p_dtypes.stacked, self.p_dtypes.shared, self.p_dtypes.rest)
    js = list(range(len(dts[slot]))) if js is None else list(js)
    mine = lambda lab: lab.kind == "n" or (lab.kind == kind and lab.index in js)  # noqa: E731

    def tree(vals):
      parts = [[jnp.zeros((), dt) for dt in d] for d in dts]
      for j, x in zip(js, vals):
        parts[slot][j] = x
      return StageParams(*map(tuple, parts))

    its = {k: iter(v) for k, v in state.items()}
    st = self.treedef.unflatten(
      [
        next(its[lab.kind]) if mine(lab) else jnp.zeros((), dt)
        for lab, dt in zip(self.labels, self.dtypes)
      ]
    )
    u, st = self.opt.update(tree(grads), st, tree(params))
    ups = (u.stacked, u.shared, u.rest)[slot]
    new = [(a + ups[j]).astype(a.dtype) for a, j in zip(params, js)]
    flat = jax.tree.leaves(st)
    return new, {
      k: tuple(x for x, lab in zip(flat, self.labels) if mine(lab) and lab.kind == k)
      for k in (kind, "n")
    }

  def updater(self, chunks: int, owners) -> Updater:
    """The executor's updater. `o_rep["n"]` becomes one copy per chunk and one per
    group of shared leaves (`owners`: tied, or read by one virtual stage), each
    advanced by its own group's updates."""
    keys = [None, *sorted({o for o in owners if o is not None})]
    h = [lab.index for lab in self.labels if lab.kind == "h"]  # shared leaf per "h" leaf

    def chunk(c, w, g, o_c, o_rep):
      new, st = self.update("s", w, g, {"s": o_c, "n": o_rep["n"][c]})
      n = list(o_rep["n"])
      n[c] = st["n"]
      return new, st["s"], {**o_rep, "n": tuple(n)}

    def shared(key, js, sh, g, o_rep):
      k = chunks + keys.index(key)
      pos = [i for i, j in enumerate(h) if j in js]
      new, st = self.update("h", sh, g, {"h": [o_rep["h"][i] for i in pos], "n": o_rep["n"][k]}, js)
      hs, n = list(o_rep["h"]), list(o_rep["n"])
      for i, x in zip(pos, st["h"]):
        hs[i] = x
      n[k] = st["n"]
      return new, {"h": tuple(hs), "n": tuple(n)}

    def finish(o, bcast):  # owned leaves' state as their owner holds it
      return {"h": tuple(bcast(owners[j], x) for j, x in zip(h, o["h"])), "n": o["n"][0]}

    return Updater(
      chunk,
      shared,
      start=lambda o: {"h": o["h"], "n": (o["n"],) * (chunks + len(keys))},
      finish=finish,
    )

  def coupled(self, params, opt_state) -> tuple[int, int] | None:
    """(i, j) where the update of parameter leaf i reads leaf j's gradient, or None."""
    sds = lambda t: jax.tree.map(  # noqa: E731
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), t
    )
    closed = jax.make_jaxpr(lambda g, s, p: jax.tree.leaves(self.opt.update(g, s, p)[0]))(
      sds(params), sds(opt_state), sds(params)
    )
    n = len(jax.tree.leaves(params))
    if len(closed.jaxpr.outvars) != n:
      return None  # updates not in the parameters' structure: nothing to compare
    for i in range(n):
      used = _compat.used_inputs(closed, [k == i for k in range(n)])
      for j in range(n):
        if j != i and used[j]:
          return i, j
    return None


def _owners(input_fn, loss_fn, ins, tgs, shared, vstages: int) -> list:
  """Per shared leaf: the virtual stage that alone reads it (0: the prologue's
  embedding; the last: a final norm, an untied head), or None when both ends do
  (tied embeddings), from JAX's DCE on the two ends' jaxprs."""

  def used(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    u = _compat.used_inputs(closed, [True] * len(closed.jaxpr.outvars))
    return u[len(u) - len(shared) :]

  x = jax.eval_shape(input_fn, ins, shared)
  first, last = used(input_fn, ins, shared), used(loss_fn, x, tgs, shared)
  return [None if a and b else (0 if a else vstages - 1) for a, b in zip(first, last)]


class TiledTrainStep(PipelineTrainStep):
  """`state, losses = step(state, *batches)`: `steps` steps per call, the batch
  leaves stacked on a leading axis of `steps`; built by `make_train_step(steps=n)`.
  With `state_argnums`, the state arguments are passed once and `state, losses,
  model_state = step(state, *batches)` (the model state after the last step).

  >>> import jax, jax.numpy as jnp, optax
  >>> from ooojax.pipeline import make_train_step
  >>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
  >>> def loss(w, x, t):
  ...   h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]
  ...   return jnp.mean((h - t) ** 2)
  >>> step = make_train_step(loss, optax.adam(0.01), mesh=mesh, axis_name="stage",
  ...                        schedule="zb-h2", microbatches=2, steps=3)
  >>> xs, ts = jnp.ones((3, 4, 3)), jnp.zeros((3, 4, 3))   # one batch per step
  >>> state = step.init(jnp.ones((2, 3, 3)) * 0.1, xs, ts)
  >>> state, losses = step(state, xs, ts)                   # 3 steps, one program
  >>> losses.shape, int(state.step), bool(losses[2] < losses[0])
  ((3,), 3, True)
  """

  def __init__(self, *args, steps: int):
    super().__init__(*args)
    self.steps = steps
    self._extra_outputs = 1 if self.state_argnums else 0  # the final model state
    self._groups: _Groups | None = None
    self.table = None  # the table tiled over steps that the last trace ran

  def _split_columns(self, leaves, c, counts):
    return None  # the tick loop's weights are loop state, whole per stage

  def value_and_grad(self, state, *batch):
    raise TypeError(
      f"value_and_grad is one step's gradient; this step runs steps="
      f"{self.steps} per call with their updates: build it with steps=1 (the "
      "state's layout is the same)"
    )

  def _state(self, batches) -> tuple[int, ...]:
    """The batch leaves of model state (`state_argnums`): passed once, not per step."""
    from ooojax.pipeline._automatic import state_leaves

    return state_leaves(batches, self.state_argnums)

  def _state_args(self, batches) -> list:
    """`(treedef, batch leaf positions)` per state argument."""
    nums = self.state_argnums
    nums = (nums,) if isinstance(nums, int) else tuple(nums)
    out, at = [], 0
    for i, b in enumerate(batches):
      n = len(jax.tree.leaves(b))
      if i + 1 in nums:
        out.append((jax.tree.structure(b), tuple(range(at, at + n))))
      at += n
    return out

  def _one(self, batches):
    """One step's batch (shapes only) from the stacked batches (the state: as is)."""
    leaves, tree = jax.tree.flatten(batches)
    state = set(self._state(batches))
    lead = {
      jnp.shape(x)[0] if jnp.ndim(x) else None for i, x in enumerate(leaves) if i not in state
    }
    if lead != {self.steps}:
      raise ValueError(
        f"every batch leaf needs a leading axis of steps={self.steps} (one "
        f"batch per step; model state, state_argnums, once); got leading sizes "
        f"{sorted(lead, key=str)}"
      )
    return tree.unflatten(
      [
        jax.ShapeDtypeStruct(jnp.shape(x)[0 if i in state else 1 :], jnp.result_type(x))
        for i, x in enumerate(leaves)
      ]
    )

  def _make(self, params, batch):
    make, shardings = super()._make(params, self._one(batch))
    if self.state_argnums:  # state outside the stack: refused before any compile
      from ooojax.pipeline._tiled_state import check_carried

      check_carried(self._layout.cut, jax.tree.leaves(batch), self._state_args(batch))
    shape = jax.eval_shape(make, params)
    g = _Groups(self.optimizer, shape.params, shape.opt_state)
    pair = g.coupled(shape.params, shape.opt_state)
    if pair is not None:
      msg = self._coupling_message(pair)
      self._layout = None  # no step from this optimizer
      raise ValueError(msg)
    self._groups = g
    return make, shardings

  def _coupling_message(self, pair) -> str:
    from ooojax.single_gpu import _COUPLING, _transform_names

    lay = self._layout
    paths = [
      jax.tree_util.keystr(k)
      for k, _ in jax.tree_util.tree_flatten_with_path(lay.treedef.unflatten(lay.avals))[0]
    ]
    c = lay.cut
    r = c.per_leaf(lay.balance.counts)
    where = [paths[i] for i in c.stacked[0] for _ in range(r)]
    where += [paths[i] for i in (*c.shared, *lay.rest)]
    names = [n for n in dict.fromkeys(_transform_names(self.optimizer.update)) if n in _COUPLING]
    what = f"optax.{names[0]}" if names else "a transform that reads every leaf"
    i, j = pair
    return (
      f"the optimizer couples parameter leaves ({what}): the update of {where[i]} "
      f"reads the gradient of {where[j]}, so no stage could update before every "
      f"stage's gradient is in, and steps={self.steps} tiles steps by updating each "
      "stage on its own. Use steps=1 (exact there: the update follows the whole "
      "gradient), or a per-leaf transform (e.g. optax.clip instead of "
      "clip_by_global_norm)."
    )

  def _body(self, state: PipelineTrainState, *batches):
    from ooojax.pipeline import _tiled_state as carry

    lay, g = self._layout, self._groups
    sp = state.params
    o_stage, o_rep = g.split(state.opt_state)

    b_leaves = jax.tree.leaves(batches)
    st_ids = set(self._state(batches))
    rows = {jnp.shape(x)[1] for i, x in enumerate(b_leaves) if jnp.ndim(x) > 1 and i not in st_ids}
    mb = next(iter(rows)) // self.sched.microbatches
    src: dict = {}  # the state columns' probes (`carry.state_sources`), once traced
    outs: list = []  # state leaves outside the stack (`carry.outside`), set by `lowering`

    def lowering(c, stage_fn, loss_fn, input_fn):
      outs[:] = carry.outside(c, self._state_args(batches)) if st_ids else ()
      n_p = len(c.shared)
      per_mb = (
        lambda ids: tuple(
          jax.ShapeDtypeStruct(  # noqa: E731
            # state: passed once, whole (a row per example); the rest per step
            (mb, *jnp.shape(b_leaves[i])[0 if i in st_ids else 2 :]),
            jnp.result_type(b_leaves[i]),
          )
          for i in ids
        )
      )
      owners = _owners(
        input_fn,
        loss_fn,
        per_mb(c.inputs),
        per_mb(c.targets),
        tuple(lay.avals[i] for i in c.shared),
        self.sched.virtual_stages,
      )
      if outs:  # the last stage's shared weights, updated by the epilogue's aux
        loss_fn = carry.outside_loss(loss_fn, c.targets, outs, n_p, src)
        owners = [*owners, *[self.sched.virtual_stages - 1] * len(outs)]
      # only weights both ends read need the cross-stage barrier
      sched = self.table = tile(self.sched, self.steps, shared=None in owners)
      updater = g.updater(self.sched.chunks, owners[:n_p])
      if c.state:
        n = c.widths(lay.balance.counts)[0]
        per_leaf = c.per_leaf(lay.balance.counts)  # a loop's rows are columns of their own
        updater = carry.carry_updater(updater, n, src, self.sched.microbatches, per_leaf)
      if outs:
        updater = carry.outside_updater(updater, n_p, src, self.sched.microbatches)
      return lower_updates(
        stage_fn,
        loss_fn,
        sched,
        self.mesh,
        self.axis_name,
        updater,
        input_fn,
        device_major=True,
        owners=owners,
        has_aux=c.n_aux > 0,
        data_axis=self.data_axis,
      )

    first = jax.tree.unflatten(
      jax.tree.structure(batches),
      [x if i in st_ids else x[0] for i, x in enumerate(b_leaves)],
    )
    prog = self._program(list(lay.avals), lay.treedef, first, lay.balance.counts, lowering)
    c = prog.cut
    cols, (n, n_st, _) = prog.state_cols, c.widths(lay.balance.counts)
    if st_ids:
      aux_leaves = jax.tree.leaves(
        jax.eval_shape(
          lambda p, *b: self.loss_fn(p, *b)[1], lay.treedef.unflatten(lay.avals), *first
        )
      )
      src["cols"], by_aux = carry.state_sources(
        c,
        b_leaves,
        self._state_args(batches),
        prog.aux_tree if self.has_aux else None,
        aux_leaves,
      )
      src["outside"] = [by_aux.get(b) for b in outs]
    if c.state:
      o_stage = (o_stage, *carry.history(cols[n_st:], self.steps))
    from ooojax.pipeline._automatic import is_key, microbatch_keys

    def per_step(x):  # a scalar per step as a row per example (a key: per microbatch)
      if is_key(x):
        return jax.vmap(lambda k: microbatch_keys(k, *rows, self.sched.microbatches))(x)
      return jnp.broadcast_to(x[:, None], (self.steps, *rows))

    stacked = lambda ids: tuple(  # noqa: E731
      per_step(b_leaves[i]) if jnp.ndim(b_leaves[i]) == 1 else b_leaves[i] for i in ids
    )
    tg_ids = [b for b in c.targets if b not in outs]
    p, sh, o_stage, o_run, out = prog.run(
      tuple(sp.stacked) + cols,
      (*sp.shared, *(b_leaves[b] for b in outs)),
      o_stage,
      {"h": o_rep["h"], "n": o_rep["n"]},
      (stacked(c.inputs), stacked(tg_ids), *((stacked(c.side),) if c.side else ())),
    )
    n_p = len(sp.shared)
    sh, outside_vals = sh[:n_p], dict(zip(outs, sh[n_p:]))
    if c.state:
      o_stage, hist, _ = o_stage
    if self.has_aux:  # (steps * M, ...) per leaf: each step's microbatches reduced
      M = self.sched.microbatches
      losses, aux = out if c.n_aux else (out, ())
      aux = tuple(x.reshape(self.steps, M, *x.shape[1:]) for x in aux)
      per = []
      for t in range(self.steps):  # the layers' updates: step t's probe sums
        gp = (None,) * (n + n_st) + tuple(h[:, t] for h in hist) if c.emits else None
        per.append(
          prog.split((losses[t], tuple(x[t] for x in aux)) if c.n_aux else losses[t], gp)[1]
        )
      aux = jax.vmap(lambda a: prog.aux(a, self.aux_reduce))(
        tuple(jnp.stack(xs) for xs in zip(*per))
      )
      losses = (losses, aux)
    else:
      losses = out
    # The rest (never read, zero gradients): one update per step, after the loop.
    rest, rst = list(sp.rest), {"r": o_rep["r"], "n": o_rep["n"]}
    for _ in range(self.steps):
      rest, rst = g.update("r", rest, [jnp.zeros_like(x) for x in rest], rst)
    opt_state = g.join(o_stage, {"h": o_run["h"], "r": rst["r"], "n": rst["n"]})
    new = PipelineTrainState(
      state.step + self.steps, StageParams(tuple(p[:n]), tuple(sh), tuple(rest)), opt_state
    )
    if not st_ids:
      return new, losses
    model = carry.final_state(
      c,
      [prog.whole(x) for x in p[n : n + n_st]],
      lay.balance.counts,
      prog.order,
      b_leaves,
      self._state_args(batches),
      outside_vals,
    )
    return new, losses, model[0] if isinstance(self.state_argnums, int) else model
