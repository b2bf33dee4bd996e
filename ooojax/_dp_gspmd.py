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
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ooojax.passes import _compat


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


@dataclasses.dataclass(frozen=True)
class Layout:
  """How each traced input enters the shard_map (see `layout`)."""

  mesh: Any
  axis: str
  n: int
  specs: tuple  # per dynamic leaf: its in_spec
  gather: tuple  # per dynamic leaf: the dimension sharded over `axis` (FSDP) or None
  split_consts: tuple  # closed-over values whose leading dimension is split


def _spec_axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _dim_on(spec, axis) -> int | None:
  for d, e in enumerate(spec):
    if axis in _spec_axes(e):
      return d
  return None


def _no_axis_error(mesh, what: str) -> ValueError:
  axes = tuple(mesh.axis_names) if mesh is not None else ()
  return ValueError(
    f"mode='data_parallel' inside jax.jit: {what}. Pass axis_name= naming the mesh axis "
    f"the batch is split over (the mesh's axes: {axes}), e.g. ooo.grad(loss, "
    "mode='data_parallel', axis_name='data'), and make the batch's sharding visible: "
    "jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P('data'))) inside the "
    "jitted function (as nanodo does), explicit axes (jax.make_mesh(..., "
    "axis_types=(AxisType.Explicit,))), or `with jax.set_mesh(mesh):` around the call"
  )


def _is_key(x) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None) or jnp.float32, jax.dtypes.prng_key)


def layout(opts, leaves, diff, positional, consts, boxed=None) -> Layout:
  """Chooses the mesh, the data axis and each input's spec.

  Args:
    opts: the `ooojax.Options` (`axis_name` may be None: found).
    leaves: the dynamic leaves of the call (arrays, tracers).
    diff: per leaf, whether it is differentiated (a parameter).
    positional: per leaf, whether it is in a positional argument.
    consts: values the loss closes over (from a forward trace).
    boxed: id(leaf) -> the `PartitionSpec` of the box holding it (flax's
      `nn.Partitioned`), used when nothing else shows the leaf's sharding.
  """
  seen = [(x, _compat.declared_sharding(x)) for x in leaves]
  cseen = [(c, _compat.declared_sharding(c)) for c in consts]
  meshes = [s.mesh for _, s in seen + cseen if s is not None]
  mesh = meshes[0] if meshes else _compat.context_mesh()
  if mesh is None:
    raise _no_axis_error(None, "no mesh is known (no input shows a sharding, and no mesh is set)")

  def from_box(spec):
    try:
      return jax.sharding.NamedSharding(mesh, spec)
    except (ValueError, TypeError):  # names that are not this mesh's axes (logical names)
      return None

  boxed = boxed or {}
  seen = [
    (x, s if s is not None or id(x) not in boxed else from_box(boxed[id(x)])) for x, s in seen
  ]
  names = tuple(mesh.axis_names)
  axis = opts.axis_name
  if axis is not None and axis not in names:
    raise ValueError(
      f"axis_name={axis!r} is not an axis of the mesh (its axes: {names}); "
      "pass axis_name= naming the mesh axis the batch is split over"
    )
  # the batch: non-differentiated values sharded on their leading dimension
  batch_axes = {
    a
    for (x, s), d in zip(seen, diff)
    if s is not None and not d and x.ndim
    for a in _spec_axes(s.spec[0] if len(s.spec) else None)
  }
  batch_axes |= {
    a
    for c, s in cseen
    if s is not None and getattr(c, "ndim", 0)
    for a in _spec_axes(s.spec[0] if len(s.spec) else None)
  }
  batch_axes = {a for a in batch_axes if mesh.shape[a] > 1}
  if axis is None:
    if len(batch_axes) != 1:
      raise _no_axis_error(
        mesh,
        "no input shows which mesh axis the batch is split over"
        if not batch_axes
        else f"the batch is split over several mesh axes {sorted(batch_axes)}",
      )
    axis = next(iter(batch_axes))
  n = mesh.shape[axis]
  evidence = axis in batch_axes
  specs, gather = [], []
  for (x, s), d, pos in zip(seen, diff, positional):
    dim = _dim_on(s.spec, axis) if s is not None else None
    if d and dim is not None:  # FSDP / ZeRO-3: a parameter sharded over the data axis
      specs.append(P(*([None] * dim), axis))
      gather.append(dim)
    elif not d and dim == 0:
      specs.append(P(axis))
      gather.append(None)
    elif (
      not d
      and s is None
      and not evidence
      and pos
      and getattr(x, "ndim", 0)
      and not _is_key(x)
      and x.shape[0] % n == 0
    ):
      # nothing shows a sharding: the non-differentiated arguments are the batch
      specs.append(P(axis))
      gather.append(None)
    else:
      specs.append(P())
      gather.append(None)
  if not any(sp == P(axis) for sp in specs) and not any(
    s is not None and c.ndim and _dim_on(s.spec, axis) == 0 for c, s in cseen
  ):
    raise _no_axis_error(mesh, f"no input is split over {axis!r} on its leading dimension")
  split = tuple(
    c for c, s in cseen if s is not None and getattr(c, "ndim", 0) and _dim_on(s.spec, axis) == 0
  )
  return Layout(mesh, axis, n, tuple(specs), tuple(gather), split)


_PASS_THROUGH = ("convert_element_type", "copy", "copy_p", "reshape", "squeeze")


def sum_outputs(jaxpr, start: int, n: int) -> tuple[bool, ...]:
  """Whether each of `jaxpr`'s outputs start..start+n is computed last by a sum
  (`reduce_sum`, looking through casts and reshapes): a count or total."""
  made = {v: e for e in jaxpr.eqns for v in e.outvars}
  out = []
  for v in jaxpr.outvars[start : start + n]:
    e = made.get(v) if isinstance(v, _compat.Var) else None
    while e is not None and e.primitive.name in _PASS_THROUGH:
      v = e.invars[0]
      e = made.get(v) if isinstance(v, _compat.Var) else None
    out.append(e is not None and e.primitive.name == "reduce_sum")
  return tuple(out)


def combine_aux(x, axis, batch_rows: frozenset, is_sum: bool = False, per_shard: bool = True):
  """One shard's aux leaf combined over the data axis (the same on every device).

  A leaf whose leading dimension is the shard's batch size (per-example
  values) is gathered back to the full batch; a leaf computed last by a sum
  (a token count, a total) and integer leaves are summed; other floating
  leaves are averaged (like the loss); a bool leaf is true where any shard's is.
  A leaf computed from the replicated inputs alone (`per_shard` False: nnx's
  RNG keys and counts carried through) is the same on every device: device 0's.
  """
  if not hasattr(x, "dtype") or not _compat.is_tracer(x):
    return x
  if not per_shard:  # the same on every device: device 0's, made invariant
    return _first_device(x, axis)
  if jnp.issubdtype(x.dtype, jnp.bool_):
    return jax.lax.psum(x.astype(jnp.int32), axis) > 0
  if not jnp.issubdtype(x.dtype, jnp.number):
    raise TypeError(
      f"mode='data_parallel' inside jax.jit cannot combine an aux leaf of "
      f"dtype {x.dtype} over the data axis {axis!r}: return it outside the "
      "differentiated function"
    )
  if x.ndim and x.shape[0] in batch_rows:  # per-example rows: this shard's, in place
    n = jax.lax.axis_size(axis)
    full = jnp.zeros((n * x.shape[0], *x.shape[1:]), x.dtype)
    full = jax.lax.dynamic_update_slice_in_dim(full, x, jax.lax.axis_index(axis) * x.shape[0], 0)
    return jax.lax.psum(full, axis)
  if jnp.issubdtype(x.dtype, jnp.inexact) and not is_sum:
    return jax.lax.pmean(x, axis)
  return jax.lax.psum(x, axis)


def _first_device(x, axis):
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = _first_device(jax.random.key_data(x), axis)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  mine = jax.lax.axis_index(axis) == 0
  if jnp.issubdtype(x.dtype, jnp.bool_):
    return jax.lax.psum(jnp.where(mine, x, False).astype(jnp.int32), axis) > 0
  return jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis)


def _per_shard(closed, split: list, consts: set) -> list:
  """Per output of `closed` (the forward, a ClosedJaxpr), whether it may differ
  between shards: all but those computed from the replicated inputs alone
  (an nnx RNG key or count carried through). An output computed from no input
  may still read the batch's shape (a row count): per shard."""

  def reach(seed) -> set:
    dep = set(seed)
    for e in closed.jaxpr.eqns:
      if any(isinstance(v, _compat.Var) and v in dep for v in e.invars):
        dep.update(e.outvars)
    return dep

  const_vars = list(zip(closed.jaxpr.constvars, closed.consts))
  on_batch = reach(
    [v for v, d in zip(closed.jaxpr.invars, split) if d]
    + [v for v, c in const_vars if id(c) in consts]
  )
  on_replicated = reach([v for v, d in zip(closed.jaxpr.invars, split) if not d])
  return [
    not isinstance(v, _compat.Var) or v in on_batch or v not in on_replicated
    for v in closed.jaxpr.outvars
  ]


def with_closure(fun, swap: dict, hits: set, depth: int = 4):
  """`fun` with each value in `swap` (id -> (old, new)) it closes over replaced by the new one.

  Follows closure cells, `functools.partial` arguments, bound methods'
  functions and pytrees held there, `depth` functions deep; `hits` collects
  the ids replaced. Anything else reaching an old value is left as it is
  (the caller checks `hits`).
  """

  def leaf(v):
    hit = swap.get(id(v))
    if hit is not None and hit[0] is v:
      hits.add(id(v))
      return hit[1]
    return v

  def value(v, d):
    if callable(v) and not isinstance(v, jax.Array) and not _compat.is_tracer(v):
      return with_closure(v, swap, hits, d - 1) if d > 0 else v
    try:
      return jax.tree_util.tree_map(leaf, v)
    except Exception:  # noqa: BLE001 - not a pytree of leaves we can rebuild
      return v

  if isinstance(fun, functools.partial):
    return functools.partial(
      value(fun.func, depth),
      *(value(a, depth) for a in fun.args),
      **{k: value(v, depth) for k, v in fun.keywords.items()},
    )
  if isinstance(fun, types.MethodType):
    return types.MethodType(value(fun.__func__, depth), value(fun.__self__, depth))
  if not isinstance(fun, types.FunctionType) or not fun.__closure__:
    return fun
  cells, changed = [], False
  for c in fun.__closure__:
    try:
      old = c.cell_contents
    except ValueError:  # an empty cell
      cells.append(c)
      continue
    new = value(old, depth)
    changed |= new is not old
    cells.append(types.CellType(new) if new is not old else c)
  if not changed:
    return fun
  g = types.FunctionType(
    fun.__code__, fun.__globals__, fun.__name__, fun.__defaults__, tuple(cells)
  )
  g.__kwdefaults__, g.__dict__ = fun.__kwdefaults__, dict(fun.__dict__)
  functools.update_wrapper(g, fun, updated=())
  return g


def _drop_axis(spec, axis):
  def entry(e):
    kept = tuple(a for a in _spec_axes(e) if a != axis)
    return None if not kept else kept[0] if len(kept) == 1 else kept

  return P(*(entry(e) for e in spec))


def _in_shard(fun, axis, had_mesh: bool, rows: frozenset = frozenset()):
  """`fun` with sharding constraints on `axis` dropped while it is traced.

  Inside the shard_map the data axis is manual, and each device holds its
  shard: a constraint the model applies for the global view holds there by
  construction, but naming a manual axis in it is an error. Constraints on
  the other axes are kept; so are `reshard`, `out_sharding=` and `auto_axes`
  requests, less the data axis (`_compat.manual_axis_dropped`). Random draws
  over the shard's `rows` (dropout) take this shard's rows of the full
  batch's draw (`_compat.per_example_draws`). Without a context mesh outside (`had_mesh`),
  constraints given as a bare `PartitionSpec` are dropped: the shard_map
  sets a mesh the user's program did not have, and code that constrains
  only when a mesh is set (flax's `nn.with_partitioning` boxes) would
  otherwise apply constraints the user's program never applies.
  """

  @functools.wraps(fun)
  def f(*a, **k):
    orig = jax.lax.with_sharding_constraint

    def constrain(x, shardings):
      if not had_mesh and all(
        isinstance(s, P)
        for s in jax.tree.leaves(
          shardings, is_leaf=lambda s: isinstance(s, (P, jax.sharding.Sharding))
        )
      ):
        return x

      def one(s):
        if isinstance(s, jax.sharding.NamedSharding):
          return jax.sharding.NamedSharding(s.mesh, _drop_axis(s.spec, axis))
        return _drop_axis(s, axis) if isinstance(s, P) else s

      return orig(
        x, jax.tree.map(one, shardings, is_leaf=lambda s: isinstance(s, (P, jax.sharding.Sharding)))
      )

    jax.lax.with_sharding_constraint = constrain
    try:
      with _compat.manual_axis_dropped(axis), _compat.per_example_draws(axis, rows):
        return fun(*a, **k)
    finally:
      jax.lax.with_sharding_constraint = orig

  return f


def _boxed_specs(args, idx) -> dict:
  """id(array) -> its box's `PartitionSpec`, for the differentiated arguments' leaves held
  in partitioning boxes (flax `nn.Partitioned`: anything with `get_partition_spec()`)."""
  is_box = lambda x: callable(getattr(x, "get_partition_spec", None)) and hasattr(x, "value")
  out = {}
  for i in idx:
    for box in jax.tree_util.tree_leaves(args[i], is_leaf=is_box):
      if is_box(box):
        try:
          spec = box.get_partition_spec()
        except Exception:  # noqa: BLE001 - logical names without rules: no evidence
          continue
        for leaf in jax.tree_util.tree_leaves(box.value):
          out[id(leaf)] = spec
  return out


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


def _call_local(vg, fun, args, kwargs, scatter, gather=None):
  """`(vg(*args, **kwargs), which aux leaves are sums)`, differentiating `fun` (the
  function with its closed-over batch replaced by the shard's) and reduce-scattering
  the gradient leaves in `scatter` (position -> dimension). `gather`: id(gathered
  leaf) -> (that leaf, its shard, dimension): each is gathered where it is used
  instead (`passes.collectives.regather.regathered`)."""
  saved, vg.fun, vg._scatter, vg._aux_sums = vg.fun, fun, dict(scatter), []
  vg._gather = dict(gather or {})
  try:
    return vg(*args, **kwargs), tuple(vg._aux_sums)
  finally:
    vg.fun, vg._scatter, vg._aux_sums, vg._gather = saved, {}, None, {}


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
  zero3 = vg.options.fsdp == "regather"

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
    (out, g), sums = _call_local(inner, _in_shard(fun, ax, had_mesh, rows), a, k, scatter, gathered)
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
