"""Masks and labels of the user's tree for an optimizer run on `StageParams`.

`make_train_step`'s optimizer sees the parameters in the cut's layout
(`StageParams`: the stack's leaves stacked by stage). A mask or label tree in
the user's structure (`optax.masked`, `add_decayed_weights(mask=...)`,
`adamw(mask=...)`, `optax.partition` / `multi_transform` labels) would not
match it, and a mask *function* would see stacked shapes (a `x.ndim > 1` mask
would decay every stacked bias). `in_layout(optimizer, params, to_layout)`
gives the same optimizer with each such mask evaluated on the user's tree and
laid out as `StageParams` (`to_layout`): a stacked leaf takes its layers'
common flag or label, and layers that disagree raise a `ValueError`.

The masks are found in the closures of optax's `masked` and `partition`
(the transforms keep them there); the optimizer is rebuilt with the laid-out
masks, everything else shared.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import jax
import optax

__all__ = ["in_layout"]


def _codes(build) -> frozenset:
  t = build()
  return frozenset(f.__code__ for f in (t.init, t.update))


@functools.cache
def _mask_codes() -> dict:
  """The code objects of the functions keeping a user tree: {code: cell name}."""
  codes = {c: "mask" for c in _codes(lambda: optax.masked(optax.identity(), {}))}
  codes.update(
    {c: "param_labels" for c in _codes(lambda: optax.partition({"a": optax.identity()}, {}))}
  )
  return codes


def in_layout(optimizer, params, to_layout: Callable):
  """`optimizer` with its user-tree masks and labels laid out by `to_layout(leaves)`
  (`leaves`: one flag or label per leaf of `params`, the user's tree)."""
  codes, memo = _mask_codes(), {}
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype), params)

  def convert(tree):
    if callable(tree):
      tree = tree(shapes)  # masks are static: of the shapes and paths
    full = jax.tree.map(lambda m, p: jax.tree.map(lambda _: m, p), tree, params)
    return to_layout(jax.tree.leaves(full))

  def rebuild(obj):
    if id(obj) in memo:
      return memo[id(obj)]
    memo[id(obj)] = obj  # cycles: the object itself
    out = obj
    if isinstance(obj, types.FunctionType) and obj.__closure__:
      name = codes.get(obj.__code__)
      cells, changed = [], False
      for var, cell in zip(obj.__code__.co_freevars, obj.__closure__):
        try:
          v = cell.cell_contents
        except ValueError:  # an empty cell
          cells.append(cell)
          continue
        nv = convert(v) if var == name else rebuild(v)
        changed |= nv is not v
        cells.append(types.CellType(nv) if nv is not v else cell)
      if changed:
        out = types.FunctionType(
          obj.__code__, obj.__globals__, obj.__name__, obj.__defaults__, tuple(cells)
        )
        out.__kwdefaults__ = obj.__kwdefaults__
    elif isinstance(obj, functools.partial):
      f, args = rebuild(obj.func), tuple(rebuild(a) for a in obj.args)
      kw = {k: rebuild(v) for k, v in obj.keywords.items()}
      if (
        f is not obj.func
        or any(a is not b for a, b in zip(args, obj.args))
        or any(kw[k] is not obj.keywords[k] for k in kw)
      ):
        out = functools.partial(f, *args, **kw)
    elif isinstance(obj, (tuple, list)):
      new = [rebuild(v) for v in obj]
      if any(a is not b for a, b in zip(new, obj)):
        out = type(obj)(*new) if hasattr(obj, "_fields") else type(obj)(new)
    elif isinstance(obj, dict) and not hasattr(obj, "tree_flatten"):
      new = {k: rebuild(v) for k, v in obj.items()}
      if any(new[k] is not obj[k] for k in obj):
        out = type(obj)(new)
    memo[id(obj)] = out
    return out

  return rebuild(optimizer)
