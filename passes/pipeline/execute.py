"""pipeline.execute: lower a pipeline table to one SPMD `shard_map` program.

Contract: `lower(stage_fn, loss_fn, sched, mesh, axis_name, input_fn=None)
-> step(stage_params, batch, shared=None) -> (loss, grads)`.

Each stage kind ("flavor": first, middle, last virtual stage) is cut into
F / B / W phases by `passes.pipeline.flavor` (the split pass; scanned layers
split into a B-scan and W-scans).

The program is a `lax.scan` over the table's ticks; at each tick every device
runs its cell's compute action through `lax.switch` (branch = flavor x kind),
then the tick's output (an activation or an input gradient) moves one hop
with `ppermute` on the ring towards its consumer (up or down: interleaved and
ZB-V chunks flow both ways); the receive columns of the table say which slot
keeps what arrives. A hand-off to the same device (ZB-V's tip) is local.
Slots are assigned from the table by interval colouring, so a device's buffers
hold what `peak_activations()` says, not one per microbatch. Weights shared by
the first and the last stage (tied embeddings) get one gradient contribution
from each W that uses them and a single `psum` at the end.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from passes import _compat
from passes.pipeline.flavor import Flavor, make_flavor
from passes.pipeline.schedule import PipelineSchedule

__all__ = ["Flavor", "lower", "make_flavor", "plan_table"]

_KINDS = ("F", "B", "W", "BW")


def _read(env, v):
  return v.val if isinstance(v, _compat.Literal) else env[v]


def _run(jaxpr, eqn_ids, env):
  for k in eqn_ids:
    eqn = jaxpr.eqns[k]
    outs = _compat.bind_eqn(eqn, [_read(env, v) for v in eqn.invars])
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, _compat.DropVar):
        env[v] = x


# --- slots ---------------------------------------------------------------------
def _colour(intervals):
  """Interval colouring: `intervals` [(start, end, key)] -> ({key: slot}, n_slots).

  A slot is reusable by an interval starting after (or, for receive buffers
  read before the write, at) the tick its previous holder ended.
  """
  free_at: list[int] = []
  slot = {}
  for start, end, key in sorted(intervals):
    for i, f in enumerate(free_at):
      if f <= start:
        free_at[i] = end
        slot[key] = i
        break
    else:
      slot[key] = len(free_at)
      free_at.append(end)
  return slot, len(free_at)


# Per (tick, stage) integers. Transfers: a device sends at most one value a tick
# (its F output or its B output), to stage s + 1 ("up" ring) or s - 1 ("dn");
# the receiver writes what arrives on each ring into an activation or gradient
# slot (trash slots absorb the rest). A hand-off to the same device (the tip of
# ZB-V's V) is written locally at the end of the producer's tick.
_FIELDS = ("branch", "mb", "chunk", "in_slot", "fres_slot", "bres_slot", "up_src", "dn_src",
           "up_act", "up_grad", "dn_act", "dn_grad", "loc_act", "loc_grad")
_F = {name: i for i, name in enumerate(_FIELDS)}


def plan_table(sched: PipelineSchedule, flavor_of: Callable[[int, int], int]):
  """Per (tick, stage) integer rows for the scan, and slot counts per buffer."""
  S, T, V = sched.stages, sched.ticks, sched.virtual_stages
  ev: dict[tuple, int] = {}
  for s, row in enumerate(sched.grid):
    for t, cell in enumerate(row):
      for a in cell:
        ev[(a.kind, s, a.microbatch, a.chunk)] = t
  ivs: dict[str, list] = {"act": [], "grad": []}
  for (kind, s, m, c), t in ev.items():
    f = flavor_of(s, c)
    if kind == "RF":
      ivs["act"].append((t, ev[("F", s, m, c)], (s, m, c)))
    elif kind == "RB":
      b = ev.get(("B", s, m, c), ev.get(("BW", s, m, c)))
      ivs["grad"].append((t, b, (s, m, c)))
    elif kind == "F":
      vs = sched.vstage(s, c)
      if vs < V - 1 and sched.place(vs + 1)[0] == s:  # local hand-off to the next chunk
        nc = sched.place(vs + 1)[1]
        ivs["act"].append((t, ev[("F", s, m, nc)], (s, m, nc)))
      end = ev.get(("W", s, m, c), ev.get(("BW", s, m, c)))
      # +1: a closed interval (F writes and W reads its slot during compute).
      ivs.setdefault(f"fres{f}", []).append((t, end + 1, (s, m, c)))
    if kind in ("B", "BW"):
      vs = sched.vstage(s, c)
      if vs > 0 and sched.place(vs - 1)[0] == s:
        pc = sched.place(vs - 1)[1]
        ivs["grad"].append((t, ev.get(("B", s, m, pc), ev.get(("BW", s, m, pc))), (s, m, pc)))
    if kind == "B":
      ivs.setdefault(f"bres{f}", []).append((t, ev[("W", s, m, c)] + 1, (s, m, c)))
  slots, counts = {}, {}
  for name, iv in ivs.items():
    # Colour per device (buffers are per device); a buffer's size is the max.
    n = 0
    for s in range(S):
      sl, k = _colour([x for x in iv if x[2][0] == s])
      slots.update({(name, *key): v for key, v in sl.items()})
      n = max(n, k)
    counts[name] = n
  rows = np.zeros((T, S, len(_FIELDS)), np.int32)
  for name in ("up_act", "dn_act", "loc_act"):
    rows[:, :, _F[name]] = counts["act"]    # the trash slot
  for name in ("up_grad", "dn_grad", "loc_grad"):
    rows[:, :, _F[name]] = counts["grad"]
  lag = sched.lag
  for s, row in enumerate(sched.grid):
    for t, cell in enumerate(row):
      for a in cell:
        key = (s, a.microbatch, a.chunk)
        f = flavor_of(s, a.chunk)
        r = rows[t, s]
        if a.kind in _KINDS:
          r[0] = 1 + f * len(_KINDS) + _KINDS.index(a.kind)
          r[1], r[2] = a.microbatch, a.chunk
          if a.kind == "F":
            r[3] = slots.get(("act", *key), 0)
          elif a.kind in ("B", "BW"):
            r[3] = slots.get(("grad", *key), 0)
          r[4] = slots[(f"fres{f}", *key)]
          r[5] = slots.get((f"bres{f}", *key), 0)
          vs = sched.vstage(s, a.chunk)
          tvs = vs + 1 if a.kind == "F" else vs - 1
          if 0 <= tvs < V:
            ds, dc = sched.place(tvs)
            buf = "act" if a.kind == "F" else "grad"
            if ds == s:
              r[_F["loc_" + buf]] = slots[(buf, s, a.microbatch, dc)]
            else:  # the sender's ring; S == 2 sends everything "up"
              ring = "up" if ds == (s + 1) % S else "dn"
              # with lag 1 the ring carries this tick's send during the next tick
              rows[t + lag, s, _F[ring + "_src"]] = 0 if a.kind == "F" else 1
        elif a.kind in ("RF", "RB"):
          vs = sched.vstage(s, a.chunk)
          ps = sched.place(vs - 1 if a.kind == "RF" else vs + 1)[0]
          ring = "up" if s == (ps + 1) % S else "dn"
          buf = "act" if a.kind == "RF" else "grad"
          r[_F[f"{ring}_{buf}"]] = slots[(buf, *key)]
  # Only the (flavor, kind) branches the table uses are compiled.
  used = sorted(set(rows[:, :, 0].ravel().tolist()) | {0})
  rows[:, :, 0] = np.searchsorted(np.asarray(used), rows[:, :, 0])
  return rows, counts, tuple(used)


# --- the program ------------------------------------------------------------------
def lower(stage_fn: Callable, loss_fn: Callable, sched: PipelineSchedule, mesh,
          axis_name: str, input_fn: Callable | None = None) -> Callable:
  """Returns `step(stage_params, batch, shared=None) -> (loss, grads)`; see the module doc.

  `stage_params` leaves are stacked on a leading axis of `sched.virtual_stages`;
  `batch = (inputs, targets)` with a leading batch axis split into
  `sched.microbatches`. `grads` mirrors `stage_params`, or is
  `(stage_grads, shared_grads)` when `shared` is given.
  """
  S, V, M, v = sched.stages, sched.virtual_stages, sched.microbatches, sched.chunks
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh "
                     f"{dict(mesh.shape)}")
  if mesh.shape[axis_name] != S:
    raise ValueError(f"the schedule has {S} stages but mesh axis {axis_name!r} has "
                     f"{mesh.shape[axis_name]} devices; generate it with stages="
                     f"{mesh.shape[axis_name]}")
  if S == 1 and v > 1:
    raise ValueError("an interleaved schedule needs at least 2 stages to execute")
  if sched.lag not in (0, 1):
    raise ValueError(f"the executor runs tables with lag 0 or 1, got {sched.lag}")

  def step(stage_params, batch, shared=None):
    inputs, targets = batch
    for leaf in jax.tree.leaves(stage_params):
      if jnp.ndim(leaf) < 1 or jnp.shape(leaf)[0] != V:
        raise ValueError(f"stage_params leaves must be stacked on a leading axis of "
                         f"{V} (virtual) stages; got a leaf of shape {jnp.shape(leaf)}")
    bsz = {jnp.shape(x)[0] for x in jax.tree.leaves((inputs, targets))}
    if len(bsz) != 1 or next(iter(bsz)) % M:
      raise ValueError(f"inputs and targets need one leading batch size divisible by "
                       f"microbatches={M}; got leading sizes {sorted(bsz)}")
    mbs = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jnp.reshape(x, (M, x.shape[0] // M, *x.shape[1:])), t)
    inputs_m, targets_m = mbs(inputs), mbs(targets)
    aval = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))  # noqa: E731
    p_aval = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stage_params)
    in_aval = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), inputs_m)
    tg_aval = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), targets_m)
    sh_aval = None if shared is None else jax.tree.map(aval, shared)
    extra = () if shared is None else (sh_aval,)
    x_aval = (jax.eval_shape(input_fn, in_aval, *extra) if input_fn is not None else in_aval)
    if not isinstance(x_aval, jax.ShapeDtypeStruct):
      raise TypeError("the activation passed between stages must be one array; got "
                      f"{x_aval}")
    y_aval = jax.eval_shape(stage_fn, p_aval, x_aval)
    if (getattr(y_aval, "shape", None), getattr(y_aval, "dtype", None)) != (
        x_aval.shape, x_aval.dtype):
      raise ValueError(f"stage_fn must map the activation to one of the same shape and "
                       f"dtype ({x_aval.shape} {x_aval.dtype}); got {y_aval}")
    x_aval = jax.ShapeDtypeStruct(x_aval.shape, x_aval.dtype)
    kinds = sorted({(vs == 0, vs == V - 1) for vs in range(V)}, reverse=True)
    flavors = [make_flavor(fi, la, stage_fn, loss_fn, input_fn, p_aval, sh_aval, x_aval,
                           in_aval, tg_aval) for fi, la in kinds]
    flavor_of = lambda s, c: kinds.index(  # noqa: E731
        (sched.vstage(s, c) == 0, sched.vstage(s, c) == V - 1))
    rows, counts, used = plan_table(sched, flavor_of)
    # (V, ...) -> (S, v, ...): device s holds virtual stages sched.vstage(s, c).
    idx = np.array([[sched.vstage(s, c) for c in range(v)] for s in range(S)])
    inv = np.argsort(idx.ravel())
    to_dev = lambda x: x[idx]  # noqa: E731
    from_dev = lambda x: jnp.reshape(x, (V, *x.shape[2:]))[inv]  # noqa: E731
    consts = [fl.consts for fl in flavors]
    body = _body(flavors, counts, rows, used, S, M, x_aval, axis_name, sched.lag)
    p_spec = jax.tree.map(lambda _: P(axis_name), stage_params)
    rep = lambda t: jax.tree.map(lambda _: P(), t)  # noqa: E731
    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(p_spec, rep(shared), rep(inputs_m), rep(targets_m),
                                 rep(consts)),
                       out_specs=(P(), p_spec, rep(shared)), check_vma=False)
    args = (jax.tree.map(to_dev, stage_params), shared, inputs_m, targets_m, consts)
    if _explicit(mesh):  # explicit-sharding meshes want arguments already placed
      specs = (p_spec, rep(shared), rep(inputs_m), rep(targets_m), rep(consts))
      args = tuple(jax.tree.map(lambda x, sp: jax.reshard(x, NamedSharding(mesh, sp)),
                                args, specs))
    loss, gp, gsh = fn(*args)
    if _explicit(mesh):  # the (S, v) -> V reshape needs an unsharded operand there
      gp = jax.tree.map(lambda x: jax.reshard(x, NamedSharding(mesh, P())), gp)
    gp = jax.tree.map(from_dev, gp)
    return loss, (gp if shared is None else (gp, gsh))

  return step


def _explicit(mesh) -> bool:
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()))


def _body(flavors, counts, rows, used, S, M, x_aval, axis_name, lag):
  n_kinds = len(_KINDS)

  def body(params, shared, inputs_m, targets_m, consts):
    params = jax.tree.map(lambda x: x[0], params)           # (v, ...) on this device
    p_leaves, p_tree = jax.tree.flatten(params)
    sh_leaves = jax.tree.leaves(shared)
    me = lax.axis_index(axis_name)
    table = jnp.asarray(rows)[:, me]                          # (T, fields)

    def buf(n, var):
      return jnp.zeros((n + 1, *var.aval.shape), var.aval.dtype)  # +1: a trash slot

    state = {
        "act": jnp.zeros((counts["act"] + 1, *x_aval.shape), x_aval.dtype),
        "grad": jnp.zeros((counts["grad"] + 1, *x_aval.shape), x_aval.dtype),
        "fres": [[buf(counts.get(f"fres{i}", 0), u) for u in fl.fres]
                 for i, fl in enumerate(flavors)],
        "bres": [[buf(counts.get(f"bres{i}", 0), u) for u in fl.bres]
                 for i, fl in enumerate(flavors)],
        "gp": jax.tree.map(jnp.zeros_like, p_leaves),
        "gsh": jax.tree.map(jnp.zeros_like, sh_leaves),
        "loss": jnp.zeros((), jnp.float32),
        "send_f": jnp.zeros(x_aval.shape, x_aval.dtype),
        "send_b": jnp.zeros(x_aval.shape, x_aval.dtype),
    }

    def statics(i, fl, mb, chunk):
      vals = [*consts[i], *(lax.dynamic_index_in_dim(x, chunk, keepdims=False)
                            for x in p_leaves)]
      if fl.n_shared:
        vals += sh_leaves
      if fl.first:
        vals += [lax.dynamic_index_in_dim(x, mb, keepdims=False)
                 for x in jax.tree.leaves(inputs_m)]
      if fl.last:
        vals += [lax.dynamic_index_in_dim(x, mb, keepdims=False)
                 for x in jax.tree.leaves(targets_m)]
      assert len(vals) == len(fl.static), (len(vals), len(fl.static))
      return dict(zip(fl.static, vals))

    def put(b, slot, x):
      return lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), slot, 0)

    def get(b, slot):
      return lax.dynamic_index_in_dim(b, slot, keepdims=False)

    def do_f(i, fl, st, r):
      env = statics(i, fl, r[1], r[2])
      if fl.x is not None:
        env[fl.x] = get(st["act"], r[3])
      _run(fl.jaxpr, fl.f_eqns, env)
      y = _read(env, fl.jaxpr.outvars[0])
      st = dict(st)
      st["fres"] = list(st["fres"])
      st["fres"][i] = [put(b, r[4], _read(env, u)) for b, u in zip(st["fres"][i], fl.fres)]
      if fl.last:
        st["loss"] = st["loss"] + y.astype(jnp.float32) / M
      else:
        st["send_f"] = y.astype(st["send_f"].dtype)
      return st

    def do_b(i, fl, st, r, then_w):
      env = statics(i, fl, r[1], r[2])
      env.update(zip(fl.fres, [get(b, r[4]) for b in st["fres"][i]]))
      ct = fl.jaxpr.invars[0]
      env[ct] = (jnp.asarray(1.0 / M, ct.aval.dtype) if fl.last else get(st["grad"], r[3]))
      _run(fl.jaxpr, fl.b_eqns, env)
      st = dict(st)
      if fl.dx is not None:
        st["send_b"] = jnp.broadcast_to(_read(env, fl.dx), x_aval.shape).astype(x_aval.dtype)
      if then_w:
        return do_w(i, fl, st, r, env)
      st["bres"] = list(st["bres"])
      st["bres"][i] = [put(b, r[5], _read(env, u)) for b, u in zip(st["bres"][i], fl.bres)]
      return st

    def do_w(i, fl, st, r, env=None):
      if env is None:
        env = statics(i, fl, r[1], r[2])
        env.update(zip(fl.fres, [get(b, r[4]) for b in st["fres"][i]]))
        env.update(zip(fl.bres, [get(b, r[5]) for b in st["bres"][i]]))
      _run(fl.jaxpr, fl.w_eqns, env)
      g = [_read(env, u) for u in fl.grads]
      st = dict(st)
      chunk = r[2]
      st["gp"] = [lax.dynamic_update_index_in_dim(
          acc, get(acc, chunk) + d.astype(acc.dtype), chunk, 0)
          for acc, d in zip(st["gp"], g[:len(p_leaves)])]
      if len(g) > len(p_leaves):
        st["gsh"] = [acc + d.astype(acc.dtype) for acc, d in zip(st["gsh"], g[len(p_leaves):])]
      return st

    branches = [lambda st, r: st]
    for i, fl in enumerate(flavors):
      branches += [
          lambda st, r, i=i, fl=fl: do_f(i, fl, st, r),
          lambda st, r, i=i, fl=fl: do_b(i, fl, st, r, False),
          lambda st, r, i=i, fl=fl: do_w(i, fl, st, r),
          lambda st, r, i=i, fl=fl: do_b(i, fl, st, r, True),
      ]
    assert len(branches) == 1 + n_kinds * len(flavors)
    branches = [branches[u] for u in used]
    ring_up = [(k, (k + 1) % S) for k in range(S)]
    ring_dn = [(k, (k - 1) % S) for k in range(S)]
    F = _F

    def send(st, r):
      up = jnp.where(r[F["up_src"]] == 0, st["send_f"], st["send_b"])
      dn = jnp.where(r[F["dn_src"]] == 0, st["send_f"], st["send_b"])
      return lax.ppermute(up, axis_name, ring_up), lax.ppermute(dn, axis_name, ring_dn)

    def tick(st, r):
      if lag:  # last tick's send travels while this tick computes
        from_below, from_above = send(st, r)
      st = lax.switch(r[0], branches, st, r)
      if not lag:
        from_below, from_above = send(st, r)
      st = dict(st)
      act, grad = st["act"], st["grad"]
      act = put(act, r[F["loc_act"]], st["send_f"])
      grad = put(grad, r[F["loc_grad"]], st["send_b"])
      act = put(put(act, r[F["up_act"]], from_below), r[F["dn_act"]], from_above)
      grad = put(put(grad, r[F["up_grad"]], from_below), r[F["dn_grad"]], from_above)
      st["act"], st["grad"] = act, grad
      return st, None

    st, _ = lax.scan(tick, state, table)
    loss = lax.psum(st["loss"], axis_name)
    gp = p_tree.unflatten([g[None] for g in st["gp"]])
    gsh = jax.tree.unflatten(jax.tree.structure(shared),
                             [lax.psum(g, axis_name) for g in st["gsh"]])
    return loss, gp, gsh

  return body
