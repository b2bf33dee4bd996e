"""pipeline.ticks: the per-device program of a pipeline table, a loop over its ticks.

Contract: `tick_loop(prog, S, v, M, axis_name, lag, ...) -> body(chunks, shared,
batch_m, consts[, opt, opt_rep])`, the function `execute._shard` runs under
`shard_map` (`passes.pipeline.execute.lower`, `passes.pipeline.train`).

The program is a `lax.scan` over the ticks. Its loop body is, per device:
one `lax.switch` over the (flavor, kind, chunk) actions the table uses, then
the ppermutes and the slot writes. The switch reads the slot stacks but never
returns them: an action returns what it produces (the value it sends, a loss
term, its residual record in a one-record carry), and the tick writes the
record into its slot afterwards (on CPU a `dynamic_update_slice` under a
`cond`, so ticks that produce none write nothing; on a GPU every tick writes,
into a trash slot if it has none: `every_tick_writes_records`). Only the
gradient accumulators are updated inside the switch, by the W actions alone
(in place: no branch reads them without writing). A buffer that one branch
updates and another only reads is copied whole every tick by XLA; this layout
keeps the loop body free of slot copies (tests/test_pipeline_memory.py counts
them).

The output (an activation or an input gradient) moves one hop with `ppermute`
on the ring towards its consumer (up or down: interleaved and ZB-V chunks flow
both ways); the receive columns say which slot keeps what arrives. A hand-off
to the same device (ZB-V's tip) is local. Weights shared by the first and the
last stage (tied embeddings) get one gradient contribution from each W that
uses them and a single `psum` at the end.

A tiled table's optimizer updates run in the ticks (`tick_updates`); which
loop a mesh gets (exchange, record writes, row reads) is `tick_options`'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ooojax.passes import _compat
from ooojax.passes.pipeline import plan as plan_pass, weight_slices as slices_pass
from ooojax.passes.pipeline.link import one_way_groups
from ooojax.passes.pipeline.program import Program
from ooojax.passes.pipeline.tick_options import every_tick_writes_records
from ooojax.passes.pipeline.tick_updates import (
  broadcast_owned,
  owner_groups,
  tree_where as _where,
  update,
)

__all__ = ["tick_loop"]


def _read(env, v):
  return v.val if isinstance(v, _compat.Literal) else env[v]


def _run(jaxpr, eqn_ids, env, dyn=None, zero=None):
  """Binds `jaxpr`'s equations `eqn_ids` in `env`; those in `dyn` (a weight's
  static slice, `weight_slices.root_slices`) as dynamic slices at `zero`."""
  for k in eqn_ids:
    eqn = jaxpr.eqns[k]
    if dyn and k in dyn:
      outs = [slices_pass.read(_read(env, eqn.invars[0]), dyn[k], zero)]
    else:
      outs = _compat.bind_eqn(eqn, [_read(env, v) for v in eqn.invars])
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, _compat.DropVar):
        env[v] = x


def _row(table, t):
  """Row `t` of `table`, as a masked sum rather than a dynamic slice: XLA:GPU
  makes a slice whose offset is the loop counter a DynamicSliceFusion, which
  keeps the whole tick loop out of a command buffer (CUDA graph)."""
  hit = (jnp.arange(table.shape[0]) == t)[:, None]
  return jnp.sum(jnp.where(hit, table, 0), axis=0, dtype=table.dtype)


def _barrier(trees):
  """`lax.optimization_barrier` over the distinct leaves of `trees` (a leaf
  several trees share stays shared: `_where` leaves it unselected)."""
  leaves, tdef = jax.tree.flatten(trees)
  uniq = list({id(x): x for x in leaves}.values())
  out = dict(zip(map(id, uniq), lax.optimization_barrier(uniq)))
  return jax.tree.unflatten(tdef, [out[id(x)] for x in leaves])


def _permute(x, axis_name, pairs, split: bool):
  """`ppermute(x, pairs)`, as one-way permutes in a row with `split` (each
  device receives at most once, so the sum of the parts is the whole)."""
  if not split:
    return lax.ppermute(x, axis_name, list(pairs))
  parts = [lax.ppermute(x, axis_name, list(g)) for g in one_way_groups(pairs)]
  out = parts[0]
  for p in parts[1:]:
    out = out + p
  return out


def _gather(a, axis_name, data_axis):
  """An aux buffer written by the last stage alone, on every device; with a
  `data_axis`, the replicas' rows after each microbatch's: `(M * D, ...)`."""
  x = a.astype(jnp.int32) if a.dtype == jnp.bool_ else a
  x = lax.psum(x, axis_name).astype(a.dtype)
  if data_axis is not None:
    x = lax.all_gather(x, data_axis, axis=1)
    x = x.reshape(-1, *x.shape[2:])
  return x


def tick_loop(
  prog: Program,
  S,
  v,
  M,
  axis_name,
  lag,
  updater=None,
  steps=1,
  data_axis=None,
  owners=None,
  split=False,
  select=False,
  fsdp=None,
  scatter=None,
  records_always=None,
  masked_rows=False,
  slices="static",
):
  """The per-device program. With an `updater` (a table tiled over `steps`),
  the weights (shared ones too) and optimizer states are loop state, updated at
  the ticks whose `upd` bits name a chunk; otherwise the weights are loop
  constants. `owners[j]`: the (device, chunk, virtual stage) that alone reads
  shared leaf j, updated at that chunk's U there and broadcast at the end, or
  None (read by the first and the last stage: updated at `sync` ticks).
  With `split`, each exchange runs as one-way permutes (`one_way`). With
  `select`, the loop body holds no conditional (`lowering.tick_lowering`).
  With `fsdp` (a `fsdp.Fsdp`), the chunk weights it names arrive split over
  the data axis: each action gathers them, each W reduce-scatters their
  gradient. With `scatter` (a `fsdp.Fsdp`, `fsdp="keep"`), the weights arrive
  whole and the leaves it names have their accumulated gradient reduce-scattered
  after the loop (this replica's part of the mean), the others' all-reduced.
  `records_always`: every tick writes its records (default:
  `every_tick_writes_records()`, which the callers ask with their mesh).
  `masked_rows` (on a GPU): each tick reads its row of the table as a masked
  sum (`_row`), so that XLA can capture the loop in one CUDA graph; otherwise
  the scan slices the rows (the CPU's loop, unchanged). `slices`
  (`tick_options.weight_slices`): how the phases read a stacked weight's
  layers, `static`, `dynamic` (fused into their GEMMs on a GPU) or `hoist`
  (once before the ticks; one step, no FSDP), `passes.pipeline.weight_slices`."""
  F = plan_pass.F
  flavors, pl, x_aval, fres, bres = (prog.flavors, prog.plan, prog.x_aval, prog.fres, prog.bres)
  n_aux = max(len(fl.aux) for fl in flavors)
  train = updater is not None
  if records_always is None:
    records_always = every_tick_writes_records()
  always = select or records_always
  # The GPU's loop (`masked_rows`) hands the switch the loss so far, which a
  # branch passes through or adds to: a branch returning a constant 0 makes
  # XLA copy it into the switch's output, a kernel per B and W tick.
  pass_loss = masked_rows and not train and not select

  def body(chunks, shared, batch_m, consts, opt=None, opt_rep=None):
    inputs_m, targets_m, side_m = batch_m
    p_tree = jax.tree.structure(chunks[0])
    # Chunk c's weights (the actions of chunk c are their own branches).
    chunk_w = [[x[0] for x in jax.tree.leaves(ch)] for ch in chunks]
    sh_leaves = jax.tree.leaves(shared)
    in_leaves, tg_leaves = jax.tree.leaves(inputs_m), jax.tree.leaves(targets_m)
    sd_leaves = jax.tree.leaves(side_m)
    table = jnp.asarray(pl.rows)[:, lax.axis_index(axis_name)]  # (ticks, fields)
    vstage = jnp.asarray(prog.vstages)[lax.axis_index(axis_name)]  # (chunks,)

    def stack(n, shape, dtype):
      return jnp.zeros((n + 1, *shape), dtype)  # +1: the trash slot

    def rec_rows(name):
      return pl.counts[name] + 1 if always else max(pl.counts[name], 1)

    bufs = {
      "act": stack(pl.counts["act"], x_aval.shape, x_aval.dtype),
      "grad": stack(pl.counts["grad"], x_aval.shape, x_aval.dtype),
      # Records have a trash slot only if every tick writes one (`always`);
      # otherwise only the ticks that produce one write it.
      "fres": {dt: jnp.zeros((rec_rows("fres"), w), dt) for dt, w in fres.widths.items()},
      "bres": {dt: jnp.zeros((rec_rows("bres"), w), dt) for dt, w in bres.widths.items()},
    }
    acc = {
      "gp": [[jnp.zeros_like(x) for x in ws] for ws in chunk_w],
      "gsh": [jnp.zeros_like(x) for x in sh_leaves],
    }
    no_out = jnp.zeros(x_aval.shape, x_aval.dtype)
    zero = jnp.zeros((), jnp.float32)

    def get(b, slot):
      return lax.dynamic_index_in_dim(b, slot, keepdims=False)

    def put(b, slot, x):
      return lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), slot, 0)

    def weights_of(i, fl, c, ws):
      """The phase's constants, chunk weights and shared weights."""
      vals = [*consts[i], *(fsdp.gather(ws[0][c]) if fsdp else ws[0][c])]
      return vals + list(ws[1]) if fl.n_shared else vals

    # `hoist`: weight-only data movement once before the ticks: per (flavor,
    # chunk) the values, per flavor the equations the phases then skip.
    # `dynamic`: per flavor the weight slices read as dynamic slices.
    pre, skip, dyn = {}, [frozenset()] * len(flavors), [{}] * len(flavors)
    for i, _, c in pl.branches:
      fl = flavors[i]
      n_roots = len(consts[i]) + len(chunk_w[c]) + (len(sh_leaves) if fl.n_shared else 0)
      if slices == "dynamic":
        dyn[i] = slices_pass.root_slices(fl, n_roots)
      elif slices == "hoist" and not train and not fsdp:
        roots = weights_of(i, fl, c, (chunk_w, sh_leaves))
        ids = slices_pass.invariant(fl, n_roots)
        skip[i] = frozenset(ids)
        if (i, c) not in pre:
          env = dict(zip(fl.static, roots))
          _run(fl.jaxpr, ids, env)
          pre[i, c] = {u: env[u] for k in ids for u in fl.jaxpr.eqns[k].outvars if u in env}

    def phase(fl, i, ids, env, zero):
      """Runs phase `ids` of flavor `i` in `env` (`zero`: the tick's, `tick`)."""
      _run(fl.jaxpr, [k for k in ids if k not in skip[i]], env, dyn[i], zero)

    def env_of(i, fl, c, r, ws):
      """The phase's static inputs: constants, chunk weights, shared, this microbatch."""
      vals = weights_of(i, fl, c, ws)
      if fl.first:
        vals += [get(x, r[F["mb"]]) for x in in_leaves]
      if fl.last:
        vals += [get(x, r[F["mb"]]) for x in tg_leaves]
      vals += [get(x, r[F["mb"]]) for x in sd_leaves]  # every stage: its microbatch's side
      if fl.index:  # the chunk's virtual stage (per-layer data: dropout key constants)
        vals.append(vstage[c])
      assert len(vals) == len(fl.static), (len(vals), len(fl.static))
      return {**dict(zip(fl.static, vals)), **pre.get((i, c), {})}

    # the loss's aux outputs (metrics): the last stage's F writes microbatch m's at row m
    aux_avals = [u.aval for fl in flavors if fl.last for u in fl.aux][:n_aux]
    aux0 = tuple(jnp.zeros((steps * M, *a.shape), a.dtype) for a in aux_avals) if n_aux else ()
    no_aux = tuple(jnp.zeros(a.shape, a.dtype) for a in aux_avals)
    zero_l = (zero, no_aux)

    def unpack(recs, i, bufs, name, slot):
      """Flavor `i`'s values from slot `slot` of record stack `name`: on a GPU
      each a dynamic slice of the stack (`Records.read`), on CPU the row's slices."""
      if masked_rows:
        return recs.read(i, bufs[name], slot)
      return recs.unpack(i, {dt: get(b, slot) for dt, b in bufs[name].items()})

    def action(i, kind, c):
      fl = flavors[i]

      def run(rz, bufs, acc, f_rec, b_rec, w):
        r, z0, lsum = rz
        out, loss = no_out, zero_l if lsum is None else (lsum, no_aux)
        ws = (chunk_w, sh_leaves) if w is None else w  # constants, or training's state
        env = env_of(i, fl, c, r, ws)
        if kind == "F":
          if fl.x is not None:
            env[fl.x] = get(bufs["act"], r[F["in_slot"]])
          phase(fl, i, fl.f_eqns, env, z0)
          y = _read(env, fl.jaxpr.outvars[0])
          if fl.last:
            dl = y.astype(jnp.float32) / M
            loss = (dl if lsum is None else lsum + dl, tuple(_read(env, u) for u in fl.aux))
          else:
            out = y.astype(x_aval.dtype)
          return out, loss, acc, fres.pack(i, [_read(env, u) for u in fl.fres]), b_rec
        env.update(zip(fl.fres, unpack(fres, i, bufs, "fres", r[F["fres"]])))
        if kind in ("B", "BW"):
          ct = fl.jaxpr.invars[0]
          env[ct] = (
            jnp.asarray(1.0 / M, ct.aval.dtype) if fl.last else get(bufs["grad"], r[F["in_slot"]])
          )
          phase(fl, i, fl.b_eqns, env, z0)
          if fl.dx is not None:
            out = jnp.broadcast_to(_read(env, fl.dx), x_aval.shape).astype(x_aval.dtype)
          if kind == "B":
            return out, loss, acc, f_rec, bres.pack(i, [_read(env, u) for u in fl.bres])
        else:
          env.update(zip(fl.bres, unpack(bres, i, bufs, "bres", r[F["bres"]])))
        phase(fl, i, fl.w_eqns, env, z0)
        g = [_read(env, u) for u in fl.grads]
        n = len(chunk_w[c])
        if fsdp:  # this replica's part of the replicas' mean, at once
          g = [*fsdp.scatter(g[:n]), *g[n:]]
        gp = list(acc["gp"])
        gp[c] = [a + d.astype(a.dtype) for a, d in zip(gp[c], g[:n])]
        gsh = [a + d.astype(a.dtype) for a, d in zip(acc["gsh"], g[n:])] or acc["gsh"]
        return out, loss, {"gp": gp, "gsh": gsh}, f_rec, b_rec

      return run

    def idle(rz, bufs, acc, f_rec, b_rec, w):
      return no_out, zero_l if rz[2] is None else (rz[2], no_aux), acc, f_rec, b_rec

    aux_f = jnp.asarray(
      [0] + [int(k == "F" and flavors[i].last) for i, k, _ in pl.branches], jnp.int32
    )  # per branch: a last-stage F (writes the aux)

    branches = [idle] + [action(*b) for b in pl.branches]

    def every_action(rz, bufs, acc, f_rec, b_rec, w):
      """The `select` tick's action: every branch runs in turn, each folding
      its results into the tick's where it is the row's branch (`where`, in
      place: a branch's gradient and record die once folded in). Each branch's
      reads wait for the previous one's fold (a barrier): with all of them in
      flight the tick would hold every branch's gradient and record at once.
      The last barrier orders every read before the tick's slot writes (a
      write that need not wait for a read makes XLA copy the stack)."""
      idx = rz[0][F["branch"]]
      res = (no_out, zero_l, acc, f_rec, b_rec)  # branch 0: idle
      for k, br in enumerate(branches[1:], 1):
        bufs, res = _barrier((bufs, res))
        new = br(rz, bufs, *res[2:], w)
        res = _where(idx == k, new, res)
      return _barrier((bufs, res))

    def ring(out, r, name):
      """What arrives on one ring. With lag 0 only the pairs that carry a value
      this tick send (a switch over the table's patterns, the same on every
      device): no filler crosses a slow link. With lag 1 every pair the table
      ever uses sends, unconditionally, so that XLA can overlap it with the
      tick's action (a collective inside a conditional cannot). A 1-chunk table
      never sends from the last stage to the first, so that hop carries nothing."""
      pats = pl.patterns[name]
      if len(pats) == 1:  # nothing ever moves on this ring
        return no_out
      if lag or select:  # a receiver outside this tick's pattern keeps it in trash
        return _permute(out, axis_name, sorted(set().union(*pats)), split)
      return lax.switch(
        r[F[f"{name}_pat"]],
        [(lambda o, p=p: _permute(o, axis_name, p, split) if p else no_out) for p in pats],
        out,
      )

    def send(out, r):
      """What arrives from below (stage s - 1) and from above (s + 1)."""
      if S == 1:
        return out, out
      up = ring(out, r, "up")
      # With 2 stages both neighbours are the same device: the plan puts all on "up".
      return up, (up if S == 2 else ring(out, r, "dn"))

    def keep(bufs, name, slot, rec):
      """`rec` into slot `slot` of stack `name`, only on the ticks that produced one
      (`always`: on every tick, the others' into the trash slot `counts[name]`)."""
      if always:
        return {dt: put(b, slot, rec[dt]) for dt, b in bufs[name].items()}
      return lax.cond(
        slot < pl.counts[name],
        lambda st: {dt: put(b, slot, rec[dt]) for dt, b in st.items()},
        lambda st: st,
        bufs[name],
      )

    def tick(carry, t):
      r = _row(table, t) if masked_rows else t
      bufs, acc, (loss, aux), out, f_rec, b_rec, w, o = carry
      if lag:  # the last tick's output travels while this tick computes
        below, above = send(out, r)
      # a 0 XLA cannot fold (the branch is >= 0): the weight slices' offset
      # (`dynamic`); the loss so far (`pass_loss`)
      rz = (r, jnp.minimum(r[F["branch"]], 0) if any(dyn) else None, loss if pass_loss else None)
      if select:  # every action, the row's kept: no conditional
        bufs, (out, (dl, da), acc, f_rec, b_rec) = every_action(rz, bufs, acc, f_rec, b_rec, w)
      else:
        out, (dl, da), acc, f_rec, b_rec = lax.switch(
          r[F["branch"]], branches, rz, bufs, acc, f_rec, b_rec, w
        )
      if n_aux and select:  # row mb rewritten with itself unless this tick's F wrote it
        keep_aux = aux_f[r[F["branch"]]] == 1
        aux = tuple(
          put(b, r[F["mb"]], lax.select(keep_aux, x.astype(b.dtype), get(b, r[F["mb"]])))
          for b, x in zip(aux, da)
        )
      elif n_aux:
        aux = lax.cond(
          aux_f[r[F["branch"]]] == 1,
          lambda a: tuple(put(b, r[F["mb"]], x) for b, x in zip(a, da)),
          lambda a: a,
          aux,
        )
      if not lag:
        below, above = send(out, r)
      act, grad = bufs["act"], bufs["grad"]
      act = put(put(put(act, r[F["loc_act"]], out), r[F["up_act"]], below), r[F["dn_act"]], above)
      grad = put(
        put(put(grad, r[F["loc_grad"]], out), r[F["up_grad"]], below), r[F["dn_grad"]], above
      )
      bufs = {
        "act": act,
        "grad": grad,
        "fres": keep(bufs, "fres", r[F["f_write"]], f_rec),
        "bres": keep(bufs, "bres", r[F["b_write"]], b_rec),
      }
      if train:
        w, o, acc = update(r, w, o, acc, updater, v, groups, axis_name, select, data_axis)
        loss = loss.at[r[F["step"]]].add(dl)
      else:
        loss = dl if pass_loss else loss + dl
      return (bufs, acc, (loss, aux), out, f_rec, b_rec, w, o), None

    groups = owner_groups(owners, len(sh_leaves))
    bcast = functools.partial(broadcast_owned, groups, axis_name)

    w0 = o0 = None
    if train:
      w0 = (chunk_w, list(sh_leaves))
      o0 = ([jax.tree.map(lambda x: x[0], oc) for oc in opt], updater.start(opt_rep))
    loss0 = jnp.zeros((steps,), jnp.float32) if train else zero
    init = (bufs, acc, (loss0, aux0), no_out, fres.empty(), bres.empty(), w0, o0)
    rows = jnp.arange(table.shape[0]) if masked_rows else table
    (_, acc, (loss, aux), _, _, _, w, o), _ = lax.scan(tick, init, rows)
    loss = lax.psum(loss, axis_name)
    if train and data_axis is not None:  # each step's loss: the mean over the replicas
      loss = lax.pmean(loss, data_axis)
    if n_aux:  # the last stage's rows (the others hold zeros), on every device
      aux = tuple(_gather(a, axis_name, data_axis) for a in aux)
      loss = (loss, aux)
    if train:
      sh = list(w[1])
      for key, (_, _, js) in groups.items():
        for j in js:
          sh[j] = bcast(key, sh[j])
      return (
        loss,
        tuple(p_tree.unflatten([x[None] for x in ws]) for ws in w[0]),
        jax.tree.unflatten(jax.tree.structure(shared), sh),
        tuple(jax.tree.map(lambda x: x[None], oc) for oc in o[0]),
        updater.finish(o[1], bcast),
      )
    gsh = [lax.psum(g, axis_name) for g in acc["gsh"]]
    if data_axis is not None:  # the mean over the data replicas' slices
      if n_aux:
        loss = (lax.pmean(loss[0], data_axis), loss[1])
      else:
        loss = lax.pmean(loss, data_axis)
      gsh = [lax.pmean(g, data_axis) for g in gsh]
      done = fsdp or scatter  # its leaves: reduce-scattered by each W, or here (keep)
      acc["gp"] = [
        [g if done and done.split(k) else lax.pmean(g, data_axis) for k, g in enumerate(gs)]
        for gs in (scatter.scatter_after(gs) if scatter else gs for gs in acc["gp"])
      ]
    gp = tuple(p_tree.unflatten([g[None] for g in gs]) for gs in acc["gp"])
    return loss, gp, jax.tree.unflatten(jax.tree.structure(shared), gsh)

  return body
