"""The data axis and each input's spec for mode="data_parallel" inside a sharded `jax.jit`.

What shows a value's sharding inside a trace: explicit axes in its type, the
`with_sharding_constraint` / `reshard` that made it, a concrete array's own
sharding (`passes._compat.declared_sharding`), or the flax partitioning box
holding it (`boxed_specs`). `ooojax._dp_gspmd.call` uses the `Layout`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ooojax.passes import _compat


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
