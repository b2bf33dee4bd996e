"""pipeline.flavor: cut one stage kind's forward + vjp into F, B and W phases.

Contract: `make_flavor(first, last, stage_fn, loss_fn, input_fn, p_aval, sh_aval,
x_aval, in_aval, tg_aval, sd_aval=None) -> Flavor`, read by `passes.pipeline.execute`.
With `sd_aval` (a per-microbatch side input every stage reads: a padding mask,
segment ids) the stage is `stage_fn(p, x, side)`; like the inputs and targets,
side is not differentiated.

Per stage kind ("flavor": first, middle, last virtual stage) the stage's
forward + vjp is traced once and cut by `passes.split` into three phases:

* F: the forward equations the stage output (or, on the last stage, the loss)
  needs. Its residuals (what B and W read) are stored in per-microbatch slots.
* B: the split pass's dX equations plus the cluster that feeds the stage input's
  cotangent. It produces dX (sent upstream) and the residuals W needs (e.g. the
  incoming cotangent, intermediate cotangents): saved, not recomputed.
* W: the dW clusters of the parameters, from the saved residuals only.
Forward equations that only the backward reads (a `jax.checkpoint`'s
recomputation) run in the phase that first needs them, so rematerialisation
keeps its memory saving. Values of parameters and constants alone (a weight
slice, a cast, a transpose) are recomputed in each phase that reads them,
never stored per microbatch; so are values of the side input alone (a mask
built from it), which every phase is handed.

Scanned layers (`lax.scan`, flax `nn.scan`): the split pass rewrites the
transposed scan into a B-scan (the dX carry; it emits each layer's residuals
as ys) and one W-scan per stacked parameter (`passes.scan.split`). The B-scan
reaches the input cotangent and every W-scan, so it is a dX equation and runs
in B; the W-scans are dW clusters and run in W, reading the B-scan's stacked
residuals from the B->W slots. (On the first stage, which sends no dX, a
B-scan that feeds a single stacked parameter is part of that parameter's
cluster and runs in W, as the dX matmuls of unrolled layers there do.) The W-scans of a phase then run as ONE loop
over the layers (`passes.scan.merge`) instead of one loop per parameter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ooojax.passes import _compat, split as split_pass
from ooojax.passes.ir import Kind
from ooojax.passes.pipeline import recompute as recompute_pass
from ooojax.passes.scan import merge as scan_merge


@dataclasses.dataclass(frozen=True)
class Flavor:
  """One stage kind cut into F / B / W phases (all indices into `jaxpr.eqns`)."""

  first: bool
  last: bool
  jaxpr: Any  # flat Jaxpr: (ct, *consts, *leaves) -> (y, *grads)
  consts: tuple
  static: tuple  # invars given at every phase: consts, params, shared, data
  x: Any  # the received-activation invar (None on the first stage)
  f_eqns: tuple[int, ...]
  b_eqns: tuple[int, ...]
  w_eqns: tuple[int, ...]
  fres: tuple  # vars F saves for B and W
  bres: tuple  # vars B saves for W
  dx: Any  # outvar of the input cotangent (None on the first stage)
  grads: tuple  # outvars of the parameter (then shared) gradients
  n_shared: int  # how many of `grads` are shared-weight gradients
  aux: tuple = ()  # outvars of the loss's aux outputs (last stage; F computes them)
  index: bool = False  # the last static input is the virtual stage's index


def _vars_read(jaxpr, ids):
  out = set()
  for k in ids:
    out.update(v for v in jaxpr.eqns[k].invars if isinstance(v, _compat.Var))
  return out


def _param_only(jaxpr, roots) -> dict:
  """{var: defining eqn index} of the forward values computed from `roots` alone."""
  known, out = set(roots), {}
  for k, e in enumerate(jaxpr.eqns):
    ins = [v for v in e.invars if isinstance(v, _compat.Var)]
    if not e.effects and all(v in known for v in ins):
      for v in e.outvars:
        if not isinstance(v, _compat.DropVar):
          known.add(v)
          out[v] = k
  return out


def _definers(jaxpr, phase, pc_def) -> set:
  """The equations that recompute the parameter-only values `phase` reads."""
  todo = [v for v in _vars_read(jaxpr, phase) if v in pc_def]
  need = set()
  while todo:
    k = pc_def[todo.pop()]
    if k not in need and k not in phase:
      need.add(k)
      todo += [v for v in jaxpr.eqns[k].invars if isinstance(v, _compat.Var) and v in pc_def]
  return need


def make_flavor(
  first: bool,
  last: bool,
  stage_fn,
  loss_fn,
  input_fn,
  p_aval,
  sh_aval,
  x_aval,
  in_aval,
  tg_aval,
  sd_aval=None,
  has_aux: bool = False,
  index: bool = False,
  costs: recompute_pass.Costs | None = None,
) -> Flavor:
  """Traces one stage kind's forward + vjp and cuts it with the split pass. With
  `has_aux` the last stage's `loss_fn` returns `(loss, aux)`: its F computes the aux.
  With `index` the stage is `stage_fn(p, x[, side], vstage)`, `vstage` the virtual
  stage's index (an int32 scalar; per-layer data such as dropout key constants).
  With `costs` B and W recompute F's cheap values where that pays
  (`passes.pipeline.recompute`); None: F saves every value they read."""
  has_aux = has_aux and last
  has_sh = sh_aval is not None and (last or (first and input_fn is not None))
  p_leaves, p_tree = jax.tree.flatten(p_aval)
  sh_leaves, sh_tree = jax.tree.flatten(sh_aval if has_sh else ())
  in_leaves, in_tree = jax.tree.flatten(in_aval if first else ())
  tg_leaves, tg_tree = jax.tree.flatten(tg_aval if last else ())
  sd_leaves, sd_tree = jax.tree.flatten(sd_aval)
  n = [
    len(p_leaves),
    len(sh_leaves),
    0 if first else 1,
    len(in_leaves),
    len(tg_leaves),
    len(sd_leaves),
    int(index),
  ]
  side_arg = lambda sd: () if sd_aval is None else (sd,)  # noqa: E731
  extra = lambda sh: (sh,) if sh_aval is not None else ()  # noqa: E731

  def flat_fun(ct, *leaves):
    it = iter(leaves)
    take = lambda k: [next(it) for _ in range(k)]  # noqa: E731
    p = p_tree.unflatten(take(n[0]))
    sh = sh_tree.unflatten(take(n[1])) if has_sh else None
    x = take(n[2])
    inputs = in_tree.unflatten(take(n[3])) if first else None
    targets = tg_tree.unflatten(take(n[4])) if last else None
    side = sd_tree.unflatten(take(n[5]))
    vs = take(n[6])

    def fwd(p, sh, x):
      if first:
        h = input_fn(inputs, *extra(sh)) if input_fn is not None else inputs
      else:
        h = x[0]
      y = stage_fn(p, h, *side_arg(side), *vs)
      return loss_fn(y, targets, *extra(sh)) if last else y

    if has_aux:
      y, vjp, aux = jax.vjp(fwd, p, sh, x, has_aux=True)
    else:
      (y, vjp), aux = jax.vjp(fwd, p, sh, x), ()
    dp, dsh, dx = vjp(ct)
    return (y, *jax.tree.leaves(aux), *dx, *jax.tree.leaves(dp), *jax.tree.leaves(dsh))

  ct_aval = jax.ShapeDtypeStruct((), jnp.float32) if last else x_aval
  avals = [
    ct_aval,
    *p_leaves,
    *sh_leaves,
    *([x_aval] * n[2]),
    *in_leaves,
    *tg_leaves,
    *sd_leaves,
    *([jax.ShapeDtypeStruct((), jnp.int32)] * n[6]),
  ]
  avals = _compat.manual_avals(avals)
  n_grads = n[2] + n[0] + n[1]
  names = [
    *(["dx"] * n[2]),
    *(f"param{i}" for i in range(n[0])),
    *(f"shared{i}" for i in range(n[1])),
  ]
  sp = split_pass.split(flat_fun, avals, n_grads, names)
  jaxpr = sp.jaxpr.jaxpr
  invars = jaxpr.invars
  ct = invars[0]
  n_consts = len(sp.consts)
  leaves = invars[1 + n_consts :]
  x_var = leaves[n[0] + n[1]] if not first else None
  static = tuple(invars[1 : 1 + n_consts]) + tuple(v for v in leaves if v is not x_var)
  gs = sp.grad_out_start
  dx_var = jaxpr.outvars[gs] if not first else None
  grads = tuple(jaxpr.outvars[gs + n[2] :])
  # B: the critical dX equations (reach >= 2 gradients) and the dx-only cluster.
  b_set = {k for k, kind in enumerate(sp.kinds) if kind is Kind.DX}
  w_set = set()
  for c in sp.clusters:
    (b_set if (not first and c.grad_out == gs) else w_set).update(c.eqns)
  # F: the forward equations y needs; other forward equations (recomputation)
  # run in the first phase that reads them.
  aux = tuple(jaxpr.outvars[1:gs])
  need_y = {jaxpr.outvars[0], *(v for v in aux if isinstance(v, _compat.Var))}
  f_set = set()
  for k in range(len(jaxpr.eqns) - 1, -1, -1):
    e = jaxpr.eqns[k]
    if sp.kinds[k] is Kind.FORWARD and need_y.intersection(e.outvars):
      f_set.add(k)
      need_y.update(v for v in e.invars if isinstance(v, _compat.Var))
  need_b = {v for v in [dx_var] if isinstance(v, _compat.Var)}
  need_w = {v for v in grads if isinstance(v, _compat.Var)}
  for k in range(len(jaxpr.eqns) - 1, -1, -1):
    e = jaxpr.eqns[k]
    ins = [v for v in e.invars if isinstance(v, _compat.Var)]
    if k in b_set:
      need_b.update(ins)
    elif k in w_set:
      need_w.update(ins)
    elif sp.kinds[k] is Kind.FORWARD and k not in f_set:
      if need_b.intersection(e.outvars):
        b_set.add(k)
        need_b.update(ins)
      elif need_w.intersection(e.outvars):
        w_set.add(k)
        need_w.update(ins)
  # Values of parameters and constants alone (a weight slice `p[i]`, a cast,
  # a transpose) are recomputed in each phase that reads them, never stored
  # per microbatch: a stored copy would cost a stage's weights per slot.
  # Values of the side input alone (a mask) are cheap to rebuild: the same.
  side_vars = set(leaves[len(leaves) - n[5] - n[6] :]) if n[5] + n[6] else set()
  pc_def = _param_only(jaxpr, set(invars[1 : 1 + n_consts + n[0] + n[1]]) | side_vars)
  # Cheap values of F (a LayerNorm's statistics, GELU's factors) that B and W
  # would read from the records are recomputed there from what is saved instead,
  # where that moves fewer bytes (`passes.pipeline.recompute`).
  re_def: dict = {}
  if costs is not None:
    reads = _vars_read(jaxpr, b_set) | _vars_read(jaxpr, w_set) | need_b | need_w
    heavy = [k for k in b_set | w_set if not recompute_pass.cheap(jaxpr.eqns[k])]
    free = set(static) | set(pc_def)
    rc = recompute_pass.choose(jaxpr, f_set, free, reads, _vars_read(jaxpr, heavy), costs)
    re_def = {v: k for k in rc.recomputed for v in jaxpr.eqns[k].outvars}
    for phase in (b_set, w_set):
      phase.update(_definers(jaxpr, phase, re_def))
  for phase in (b_set, w_set):
    phase.update(_definers(jaxpr, phase, pc_def))
  f_def = {v for k in f_set for v in jaxpr.eqns[k].outvars} | ({x_var} if x_var else set())
  b_def = {v for k in b_set for v in jaxpr.eqns[k].outvars} | {ct}
  later = _vars_read(jaxpr, b_set) | _vars_read(jaxpr, w_set) | need_b | need_w
  order = {v: i for i, v in enumerate([*invars, *(v for e in jaxpr.eqns for v in e.outvars)])}
  fres = tuple(sorted((f_def & later) - set(pc_def) - set(re_def), key=order.get))
  w_reads = _vars_read(jaxpr, w_set) | need_w
  bres = tuple(sorted((b_def & w_reads) - set(pc_def) - set(re_def), key=order.get))
  fl = Flavor(
    first,
    last,
    jaxpr,
    tuple(sp.consts),
    static,
    x_var,
    tuple(sorted(f_set)),
    tuple(sorted(b_set)),
    tuple(sorted(w_set)),
    fres,
    bres,
    dx_var,
    grads,
    n[1],
    aux,
    index,
  )
  return merge_w_scans(fl)


def merge_w_scans(fl: Flavor) -> Flavor:
  """`fl` with each run of W-scans in its W phase merged into one scan.

  The phases' inputs and outputs (`fres`, `bres`, `grads`) are unchanged:
  the merged scan defines the same variables.
  """
  jaxpr, new = scan_merge.merge_runs(fl.jaxpr, fl.w_eqns)
  if jaxpr is fl.jaxpr:
    return fl
  remap = lambda ids: tuple(sorted({new[k] for k in ids}))  # noqa: E731
  return dataclasses.replace(
    fl, jaxpr=jaxpr, f_eqns=remap(fl.f_eqns), b_eqns=remap(fl.b_eqns), w_eqns=remap(fl.w_eqns)
  )
