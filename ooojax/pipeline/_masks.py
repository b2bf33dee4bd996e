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
(the transforms keep them there), and in the static hyperparameters of
`optax.inject_hyperparams(..., static_args="mask")(mask=...)` (which builds
its inner optimizer on every call, from a dict it keeps); the optimizer is
rebuilt with the laid-out masks, everything else shared. A mask *function*
kept anywhere else under a mask's name (`mask`, `param_labels`, ...: a custom
transform's, or one `inject_hyperparams` took for a schedule) would see the
stacked layout: it raises a `ValueError` instead.
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


# names under which a transform keeps a mask or labels of the parameters' tree
_MASK_NAMES = frozenset({"mask", "masks", "mask_fn", "param_labels", "labels"})


@functools.cache
def _inject_codes() -> frozenset:
  """The code objects of `inject_hyperparams`' transform, whose `other_hps` cell
  keeps the static hyperparameters (a mask among them)."""
  return _codes(lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))


def _unlaid(where: str, value) -> ValueError:
  value = getattr(value, "schedule_fn", value)  # inject_hyperparams' WrappedSchedule
  what = getattr(value, "__qualname__", type(value).__name__)
  inject = where.startswith("inject_hyperparams")
  return ValueError(
    f"the optimizer keeps a mask function ({where}: {what}) that make_train_step "
    "cannot lay out: it would be called with StageParams (the stack's leaves "
    "stacked by stage) instead of your parameters, and mask the wrong leaves. "
    + (
      "inject_hyperparams treats a callable as a schedule: pass "
      "static_args='mask' (then its mask is laid out)"
      if inject
      else "Use optax.masked / partition / adamw(mask=...) (their masks are laid out), "
      "pass the mask as a tree of your parameters' structure evaluated beforehand, or "
      "take the gradients in your tree from ooo.pipeline.value_and_grad and apply "
      "your optimizer to them (docs/guides/pipeline-real-losses.md)"
    )
  )


def in_layout(optimizer, params, to_layout: Callable):
  """`optimizer` with its user-tree masks and labels laid out by `to_layout(leaves)`
  (`leaves`: one flag or label per leaf of `params`, the user's tree)."""
  codes, inject, memo = _mask_codes(), _inject_codes(), {}
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype), params)

  def convert(tree):
    if callable(tree):
      tree = tree(shapes)  # masks are static: of the shapes and paths
    full = jax.tree.map(lambda m, p: jax.tree.map(lambda _: m, p), tree, params)
    return to_layout(jax.tree.leaves(full))

  def hyperparams(hps):  # inject_hyperparams' static ones: its masks laid out
    out = {
      k: convert(v)
      if k in _MASK_NAMES and v is not None and not isinstance(v, bool)
      else rebuild(v)
      for k, v in hps.items()
    }
    return hps if all(out[k] is hps[k] for k in hps) else out

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
        if var == name:
          nv = convert(v)
        elif obj.__code__ in inject and var == "other_hps":
          nv = hyperparams(v)
        elif var in _MASK_NAMES and callable(v):
          raise _unlaid(f"{obj.__qualname__}'s {var!r}", v)
        elif obj.__code__ in inject and var == "sched_hps" and _MASK_NAMES & set(v):
          k = next(iter(_MASK_NAMES & set(v)))
          raise _unlaid(f"inject_hyperparams(...)({k}=...)", v[k])
        else:
          nv = rebuild(v)
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
      bad = [k for k, v in obj.items() if k in _MASK_NAMES and callable(v)]
      if bad:
        raise _unlaid(f"a dict's {bad[0]!r}", obj[bad[0]])
      new = {k: rebuild(v) for k, v in obj.items()}
      if any(new[k] is not obj[k] for k in obj):
        out = type(obj)(new)
    memo[id(obj)] = out
    return out

  return rebuild(optimizer)
