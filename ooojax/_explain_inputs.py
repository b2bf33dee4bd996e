"""`ooo.explain` takes what users hold: nnx modules, `(graphdef, state)` pairs,
and losses that name a mesh axis.

Two adaptations, both for explaining only (`ooo.grad` keeps `jax.grad`'s
contract and its errors):

* `float_only`: the differentiated arguments' non-float leaves (an nnx
  module's RNG key and counter, integer step counts, boolean masks) are moved
  into one extra argument that is not differentiated. The float leaves keep
  their key paths, so the report names parameters as the model does
  (`.blocks[0].attn.kernel.value`, `[1]['blocks'][0]['attn']['kernel'].value`).
* `run_bound`: a loss that names a mesh axis (synchronised BatchNorm's
  `pmean`, `lax.axis_index`) is traced inside a `shard_map` over an abstract
  mesh with those axes, so the axis is bound as it is in the user's
  `pmap` / `shard_map`; nothing runs and no device is needed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np


def _is_float(x) -> bool:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return isinstance(x, (float, complex))
  return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))


def _is_hole(x) -> bool:
  return x is None


@dataclasses.dataclass(frozen=True)
class FloatOnly:
  """`fun` and `args` rewritten so only float leaves are differentiated."""

  fun: Callable
  args: tuple
  moved: tuple[str, ...]  # key paths of the leaves that are not differentiated


def float_only(fun, args: tuple, idx: tuple[int, ...], allow_int: bool = False) -> FloatOnly | None:
  """Moves the non-float leaves of `args[i]` (i in `idx`) into an extra last argument.

  Returns None when every differentiated leaf is float (nothing to move).
  The rewritten `fun(*args, rest, **kwargs)` puts the moved leaves back
  before calling the user's `fun`, so the loss sees the module or state it
  was written for.
  """
  if allow_int:
    return None
  holed, rests, defs, moved = list(args), [], [], []
  mark = object()  # stands for a moved leaf while the slots are laid out
  for i in idx:
    leaves, tree = jax.tree_util.tree_flatten_with_path(args[i])
    keep = [_is_float(x) for _, x in leaves]
    if all(keep):
      rests.append(())
      defs.append(None)
      continue
    marked = jax.tree_util.tree_unflatten(
      tree, [x if k else mark for (_, x), k in zip(leaves, keep)]
    )
    # slots: leaves, holes and the tree's own None subtrees, in one order
    slots, slot_def = jax.tree_util.tree_flatten(marked, is_leaf=_is_hole)
    holed[i] = jax.tree_util.tree_unflatten(slot_def, [None if x is mark else x for x in slots])
    rests.append(tuple(x for (_, x), k in zip(leaves, keep) if not k))
    defs.append((slot_def, tuple(x is mark for x in slots)))
    moved += [
      f"{i}{jax.tree_util.keystr(p)}" if len(idx) > 1 else jax.tree_util.keystr(p)
      for (p, _), k in zip(leaves, keep)
      if not k
    ]
  if not moved:
    return None

  def fun_float(*a, **kw):
    *a, rest = a
    full = list(a)
    for i, d, r in zip(idx, defs, rest):
      if d is None:
        continue
      slot_def, holes = d
      it = iter(r)
      slots = slot_def.flatten_up_to(a[i])
      full[i] = jax.tree_util.tree_unflatten(
        slot_def, [next(it) if h else x for x, h in zip(slots, holes)]
      )
    return fun(*full, **kw)

  fun_float.__name__ = getattr(fun, "__name__", "fun")
  fun_float.__qualname__ = getattr(fun, "__qualname__", fun_float.__name__)
  return FloatOnly(fun_float, (*holed, tuple(rests)), tuple(moved))


def _unbound(names) -> list[str]:
  out = []
  for n in names:
    try:
      jax.lax.axis_size(n)
    except NameError:
      out.append(n)
  return out


def mesh_axes(mesh) -> dict[str, int]:
  """Axis name -> size of a `Mesh`, `AbstractMesh` or `{name: size}` mapping."""
  if isinstance(mesh, Mapping):
    return {str(k): int(v) for k, v in mesh.items()}
  shape = getattr(mesh, "shape", None)
  if isinstance(shape, Mapping):
    return {str(k): int(v) for k, v in shape.items()}
  raise TypeError(
    f"mesh= takes a jax.sharding.Mesh, an AbstractMesh or a dict of axis "
    f"sizes such as {{'batch': 8}}, got {type(mesh).__name__}"
  )


def run_bound(fn: Callable[[], Any], axes: Mapping[str, int]) -> Any:
  """`fn()` traced with every axis in `axes` bound (those not bound already).

  Runs `fn` inside `jax.shard_map` over an `AbstractMesh` of the unbound
  axes, under `jax.eval_shape`: shapes only, no device. `fn`'s result must
  not depend on the trace (it is returned through a closure).
  """
  names = _unbound(list(axes))
  if not names:
    return fn()
  from jax.sharding import AbstractMesh, PartitionSpec

  am = AbstractMesh(tuple(int(axes[n]) for n in names), tuple(names))
  box = {}

  def body():
    box["out"] = fn()
    return np.zeros((), np.float32)

  jax.eval_shape(
    jax.shard_map(body, mesh=am, in_specs=(), out_specs=PartitionSpec(), check_vma=False)
  )
  return box["out"]


def unbound_name(err: NameError) -> str | None:
  """The axis of JAX's "unbound axis name" error, else None."""
  text = str(err)
  if "axis name" not in text:
    return None
  return text.split("axis name:")[-1].split(".")[0].strip() or None


def run_binding(fn: Callable[[], Any], axes: Mapping[str, int]) -> tuple[Any, dict[str, int]]:
  """`run_bound(fn, axes)`, binding each axis the trace finds unbound as a
  size-1 axis too (a loss that names a mesh axis, explained outside `pmap`).

  Returns `(fn's result, the axes bound that way)`.
  """
  guessed: dict[str, int] = {}
  while True:
    try:
      both = {**axes, **guessed}
      return (run_bound(fn, both) if both else fn()), guessed
    except NameError as e:
      name = unbound_name(e)
      if name is None or name in guessed or name in axes or len(guessed) >= 8:
        raise
      guessed[name] = 1


def binds_unbound_axes(explain_fn: Callable) -> Callable:
  """Wraps `ooo.pipeline.explain` so a loss naming an unbound axis is explained
  with it bound (`run_binding`) and the report (its `notes`) says how."""

  @functools.wraps(explain_fn)
  def explain(*args, **kwargs):
    out, guessed = run_binding(lambda: explain_fn(*args, **kwargs), {})
    if guessed:
      out = dataclasses.replace(out, notes=(*out.notes, bound_note(guessed, pipeline=True)))
    return out

  return explain


def bound_note(guessed: Mapping[str, int], pipeline: bool = False) -> str:
  """What a report says about the axes `run_binding` bound."""
  names = ", ".join(repr(n) for n in guessed)
  a = next(iter(guessed))
  real = (
    f"the pipeline step binds it from a mesh axis: ooo.pipeline.value_and_grad(loss, "
    f"mesh=jax.make_mesh((N, S), ({a!r}, 'stage')), axis_name='stage', data_axis={a!r})"
    if pipeline
    else f"pass mesh=jax.make_mesh((N,), ({a!r},)) (or mesh={{{a!r}: N}}) and axis_name={a!r}"
  )
  return (
    f"the loss names mesh axis {names}, unbound here: explained with it bound as a "
    f"size-1 axis (shapes only; a collective over it is the identity). For its real "
    f"size, {real}."
  )


def unbound_axis_note(err: NameError, mode: str) -> NameError:
  """Adds to JAX's unbound-axis error which `explain` argument binds it."""
  name = str(err).split("axis name:")[-1].split(".")[0].strip() or "batch"
  if mode == "data_parallel":
    hint = (
      f"pass axis_name={name!r} and axis_size=N (the devices the batch is split over), "
      f"or mesh=jax.make_mesh((N,), ({name!r},)), to ooo.explain"
    )
  else:
    hint = (
      f"pass mesh=jax.make_mesh((N,), ({name!r},)) (or mesh={{{name!r}: N}}) and "
      f"axis_name={name!r} to ooo.explain, which then traces the loss with the axis "
      "bound; or call explain inside the jax.shard_map / jax.pmap that binds it"
    )
  err.add_note(
    f"ooo.explain: the loss names mesh axis {name!r} (e.g. synchronised "
    f"BatchNorm(axis_name={name!r}) or lax.pmean(..., {name!r})): {hint}."
  )
  return err


def int_leaves_note(err: TypeError) -> TypeError:
  err.add_note(
    "ooo.explain differentiates only the float leaves of what it is given: pass the nnx "
    "module (or its (graphdef, state) pair) as it is. ooo.grad, like jax.grad, needs "
    "float inputs: split the module first, e.g. graphdef, params, rest = "
    "nnx.split(model, nnx.Param, ...), and differentiate params."
  )
  return err


def _leading_axes(x) -> tuple:
  """The mesh axes `x`'s own sharding splits its leading dimension over."""
  s = getattr(x, "sharding", None)
  spec = getattr(s, "spec", None)
  if not isinstance(s, jax.sharding.NamedSharding) or not spec or not getattr(x, "ndim", 0):
    return ()
  e = spec[0]
  return () if e is None else tuple(e) if isinstance(e, tuple) else (e,)


def data_axis(args: tuple, idx: tuple[int, ...], axes: Mapping[str, int], axis_name) -> str:
  """The data axis of `explain(mode="data_parallel", mesh=...)`: `axis_name`, or
  the one mesh axis the non-differentiated arguments' arrays (the batch) are
  sharded over on their leading dimension, as a GSPMD user holds them."""
  if axis_name is not None:
    if axis_name not in axes:
      raise ValueError(
        f"explain(mode='data_parallel'): axis_name={axis_name!r} is not an axis of "
        f"mesh= (its axes: {list(axes)})"
      )
    return axis_name
  seen = {
    a
    for i, a_ in enumerate(args)
    if i not in idx
    for x in jax.tree_util.tree_leaves(a_)
    for a in _leading_axes(x)
    if a in axes
  }
  if len(seen) == 1:
    return seen.pop()
  why = (
    "no argument's sharding splits its leading dimension over a mesh axis"
    if not seen
    else f"the batch is split over several mesh axes {sorted(seen)}"
  )
  raise ValueError(
    f"explain(mode='data_parallel', mesh=...): {why}. Pass axis_name= naming the mesh "
    f"axis the batch is split over (the mesh's axes: {list(axes)}), e.g. "
    f"ooo.explain(loss, params, batch, mode='data_parallel', mesh=mesh, "
    f"axis_name={next(iter(axes), 'data')!r}), or pass the batch placed on the mesh: "
    "jax.device_put(batch, NamedSharding(mesh, P('data')))"
  )


def local_args(args: tuple, idx: tuple[int, ...], axis: str, n: int) -> tuple:
  """`args` as one device's shard: a non-differentiated array whose own sharding
  splits its leading dimension over `axis` (the global batch of a sharded jit)
  becomes a struct of its per-device shape. Other leaves are kept (data-parallel
  explain takes them as one device's already)."""

  def local(x):
    if axis not in _leading_axes(x):
      return x
    return jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype)

  return tuple(a if i in idx else jax.tree.map(local, a) for i, a in enumerate(args))
