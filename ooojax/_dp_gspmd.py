"""mode="data_parallel" inside a `jax.jit` over a mesh (GSPMD), data axis found from the mesh.

Modern JAX training code is data parallel through a sharded `jax.jit`: the
batch is sharded over a mesh axis and the parameters replicated (or, with
FSDP / ZeRO-3, sharded over the same axis), and no axis is bound by `pmap`
or `shard_map`. There, `ooo.grad(loss, mode="data_parallel")`:

1. finds the data axis: `axis_name=` naming a mesh axis, or the one mesh
   axis the batch's leading dimension is sharded over. What shows a value's
   sharding inside a trace: explicit axes in its type, the
   `with_sharding_constraint` / `reshard` that made it, a concrete array's
   own sharding (`passes._compat.declared_sharding`);
2. runs the per-shard gradient inside `jax.shard_map` over that axis only
   (other mesh axes are left to the partitioner), with the early bucketed
   all-reduces of `ooojax._dp` (the axis is bound there);
3. splits the batch there: arguments sharded over the axis on their leading
   dimension, and values the loss closes over that are (nanodo closes over
   its batch: `jax.value_and_grad(get_loss_fn(in_BxL, ...))`;
   `with_closure` rebuilds the function with the shard in its place);
4. FSDP / ZeRO-3: a differentiated leaf sharded over the data axis on a
   dimension stays sharded: it is traced at its full shape, then
   all-gathered where the forward reads it and again where the backward
   does (`fsdp="regather"`, `passes.collectives.regather`; `fsdp="keep"`
   gathers it once at the start of the shard's program). Its gradient is
   reduce-scattered (`psum_scatter`) back to that sharding, bucket by
   bucket, as early as the dX chain allows.

The value is the mean of the shards' losses, the gradient the mean of their
gradients: `jax.value_and_grad` of the full-batch mean loss for equal shards.
`has_aux`: each shard's aux leaves are combined as documented in
`combine_aux`.

The pieces: `ooojax._dp_layout` (the data axis and the specs), `ooojax._dp_shard`
(the loss traced as one shard), `ooojax._dp_aux` (aux leaves combined).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import PartitionSpec as P

from ooojax._dp_aux import _per_shard, combine_aux, sum_outputs
from ooojax._dp_layout import Layout, _boxed_specs, _dim_on, layout
from ooojax._dp_shard import _in_shard, with_closure
from ooojax.passes import _compat

__all__ = [
  "Layout",
  "call",
  "combine_aux",
  "layout",
  "sum_outputs",
  "unbound",
  "with_closure",
  "_boxed_specs",
]


def unbound(opts) -> bool:
  """mode="data_parallel" with no `pmap` / `shard_map` axis of that name bound."""
  if opts.mode != "data_parallel":
    return False
  if opts.axis_name is None:
    return True
  try:
    jax.lax.axis_size(opts.axis_name)
  except NameError:
    return True
  return False


def _bound_to(vg, axis):
  """`vg` (an `ooo.value_and_grad`) with `axis_name=axis`, kept on `vg` so that its
  plan cache is reused across steps."""
  t = vg._bound.get(axis)
  if t is None:
    opts = dataclasses.replace(vg.options, axis_name=axis)
    t = vg._bound[axis] = type(vg)(
      vg.fun, vg.argnums, vg.has_aux, vg.holomorphic, vg.allow_int, opts, vg.filter
    )
  return t


def _call_local(vg, fun, args, kwargs, scatter, gather=None, early=None):
  """`(vg(*args, **kwargs), which aux leaves are sums)`, differentiating `fun` (the
  function with its closed-over batch replaced by the shard's) and reduce-scattering
  the gradient leaves in `scatter` (position -> dimension). `gather`: id(gathered
  leaf) -> (that leaf, its shard, dimension): each is gathered where it is used
  instead (`passes.collectives.regather.regathered`). `early`: combines the value
  and aux leaves ahead of the first bucket (`BucketEmitter`)."""
  saved, vg.fun, vg._scatter, vg._aux_sums = vg.fun, fun, dict(scatter), []
  vg._gather, vg._early = dict(gather or {}), early
  try:
    return vg(*args, **kwargs), tuple(vg._aux_sums)
  finally:
    vg.fun, vg._scatter, vg._aux_sums, vg._gather, vg._early = saved, {}, None, {}, None


def _fsdp_mode(opts, leaves, lay):
  """`fsdp="auto"`: keep the gathered weights or gather them again in the backward
  (`passes.collectives.fsdp_mode`), from the FSDP leaves' bytes and the device."""
  from ooojax.passes.collectives import fsdp_mode
  from ooojax.passes.collectives.plan import get_link
  from ooojax.passes.cost import get_spec

  fsdp = [x for x, g in zip(leaves, lay.gather) if g is not None]
  if opts.fsdp != "auto" or not fsdp:
    return fsdp_mode.FsdpChoice(opts.fsdp, opts.fsdp, "as asked", 0, 0.0, 0.0)
  return fsdp_mode.choose(
    opts.fsdp,
    sum(math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize for x in fsdp),
    lay.n,
    get_link(opts.link),
    get_spec(opts.device).name,
    len(fsdp),
  )


def call(vg, args, kwargs):
  """`vg(*args, **kwargs)` for an unbound data axis: the per-shard gradient in a shard_map."""
  from ooojax import _filter
  from ooojax._args import _is_dynamic, _resolve_argnums

  idx = _resolve_argnums(vg.argnums, len(args))
  flat, tree = jax.tree_util.tree_flatten((args, kwargs))
  arg_sizes = [len(jax.tree_util.tree_leaves(a)) for a in args]
  where = [(i, True) for i, k in enumerate(arg_sizes) for _ in range(k)]
  where += [(None, False)] * (len(flat) - len(where))
  # an Equinox module (or ooojax.equinox): only its inexact arrays are differentiated
  filtered = {i for i in idx if vg.filter or _filter.holds_module(args[i])}

  def differentiated(j) -> bool:
    i = where[j][0]
    return i in idx and (i not in filtered or _filter.is_inexact_array(flat[j]))

  dyn_pos = [j for j, x in enumerate(flat) if _is_dynamic(x) or differentiated(j)]
  leaves = [flat[j] for j in dyn_pos]
  diff = [differentiated(j) for j in dyn_pos]
  positional = [where[j][1] for j in dyn_pos]

  def rebuild(vals):
    out = list(flat)
    for j, v in zip(dyn_pos, vals):
      out[j] = v
    return jax.tree_util.tree_unflatten(tree, out)

  def forward(*vals):
    a, k = rebuild(vals)
    return vg.fun(*a, **k)

  closed = jax.make_jaxpr(forward)(*leaves)
  consts = [c for c in closed.consts if _compat.is_tracer(c) or isinstance(c, jax.Array)]
  lay = layout(vg.options, leaves, diff, positional, consts, _boxed_specs(args, idx))
  # which outputs (the loss, then the aux leaves) depend on the split batch
  split = [_dim_on(sp, lay.axis) is not None and g is None for sp, g in zip(lay.specs, lay.gather)]
  per_shard = _per_shard(closed, split, {id(c) for c in lay.split_consts})[1:]
  had_mesh = _compat.context_mesh() is not None
  inner = _bound_to(vg, lay.axis)
  ax = lay.axis
  n_dyn = len(leaves)
  rows = frozenset(x.shape[0] // lay.n for x, sp in zip(leaves, lay.specs) if sp == P(ax))
  rows |= frozenset(c.shape[0] // lay.n for c in lay.split_consts)
  # gradient leaf position -> the dimension its reduce-scatter splits
  grad_dims = [g for g, d in zip(lay.gather, diff) if d]
  scatter = {i: g for i, g in enumerate(grad_dims) if g is not None}
  zero3 = _fsdp_mode(vg.options, leaves, lay).mode == "regather"

  def body(*local):
    shards = list(local[:n_dyn])
    # traced at their full shape; `regather.regathered` puts the shards back in, each gathered
    # where it is used (these up-front gathers are then dead)
    vals = [
      x if g is None else jax.lax.all_gather(x, ax, axis=g, tiled=True)
      for x, g in zip(shards, lay.gather)
    ]
    gathered = {
      id(v): (v, x, g) for v, x, g in zip(vals, shards, lay.gather) if g is not None and zero3
    }
    a, k = rebuild(vals)
    swap = {id(o): (o, l) for o, l in zip(lay.split_consts, local[n_dyn:])}
    hits: set = set()
    fun = with_closure(vg.fun, swap, hits)
    if len(hits) != len(swap):
      raise ValueError(
        f"mode='data_parallel' inside jax.jit: {vg.__name__} closes over a value split "
        f"over {ax!r} that ooojax cannot replace by its shard (it is not held in the "
        "function's closure, a functools.partial or a pytree there); pass it as an "
        "argument of the differentiated function instead"
      )
    done = []

    def early(aux_parts, heads):
      """The value and each traced aux leaf (`heads`) combined over the axis."""
      done.append(True)
      sums = iter(inner._aux_sums or ())  # one per traced aux leaf, in order
      out = [jax.lax.pmean(heads[0], ax)]
      it = iter(heads[1:])
      for part, p in zip(aux_parts, per_shard):
        if part is None:
          out.append(combine_aux(next(it), ax, rows, next(sums, False), p))
      return out

    fun = _in_shard(fun, ax, had_mesh, rows)
    (out, g), sums = _call_local(inner, fun, a, k, scatter, gathered, early)
    if done:  # the emitter combined them ahead of its first bucket
      val, aux = out if vg.has_aux else (out, None)
      return val, aux, g
    if vg.has_aux:
      val, aux = out
      leaves, aux_tree = jax.tree.flatten(aux)
      it = iter(sums)  # one per traced aux leaf, in order
      aux = jax.tree.unflatten(
        aux_tree,
        [
          combine_aux(x, ax, rows, next(it, False) if _compat.is_tracer(x) else False, p)
          for x, p in zip(leaves, per_shard)
        ],
      )
    else:
      val, aux = out, None
    return jax.lax.pmean(val, ax), aux, g

  grad_specs = [sp for sp, d in zip(lay.specs, diff) if d]
  # the gradient's tree: a filtered argument's with None at its static leaves
  diff_args = [
    jax.tree.map(lambda x: x if _filter.is_inexact_array(x) else None, args[i])
    if i in filtered
    else args[i]
    for i in idx
  ]
  diff_tree = diff_args[0] if isinstance(vg.argnums, int) else tuple(diff_args)
  g_specs = (
    jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(diff_tree), grad_specs)
    if grad_specs
    else None
  )
  in_specs = (*lay.specs, *(P(ax) for _ in lay.split_consts))
  out = jax.shard_map(
    body,
    mesh=lay.mesh,
    in_specs=in_specs,
    out_specs=(P(), P(), g_specs),
    axis_names={ax},
    check_vma=True,
  )(*leaves, *lay.split_consts)
  val, aux, g = out
  return ((val, aux) if vg.has_aux else val), g
