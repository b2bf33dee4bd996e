"""Which leaves of a differentiated argument are differentiated.

`jax.grad`'s contract: every leaf is, and a leaf that is not a float array (a
function, an int field) is a TypeError. Equinox's `filter_value_and_grad`
differentiates the inexact arrays only and leaves the rest static (Python
floats such as a max-pool's `init=-inf` or `Dropout.p` included), its
gradient holding None there. `ooo.grad` keeps jax's contract for plain trees
and follows Equinox's for a tree holding an `eqx.Module` (or for any tree
under `ooojax.equinox.filter_*`); it never imports equinox itself.
"""

from __future__ import annotations

import functools
import sys

import jax
import numpy as np

from ooojax._args import _is_dynamic
from ooojax.passes import _compat


def holds_module(tree) -> bool:
  """Whether `tree` is or holds an `equinox.Module` (only if equinox is imported)."""
  eqx = sys.modules.get("equinox")
  if eqx is None:
    return False
  found = []

  def leaf(x):
    if isinstance(x, eqx.Module):
      found.append(True)
      return True
    return False

  jax.tree_util.tree_flatten(tree, is_leaf=leaf)
  return bool(found)


def is_inexact_array(x) -> bool:
  """`eqx.is_inexact_array`, shape structs and tracers included; Python floats not."""
  if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)) or (
    _compat.is_tracer(x)
  ):
    return bool(jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))
  return False


def leaves_of(a, tree, keep) -> list:
  """The differentiated leaves of a filtered argument, in order."""
  return [x for x, k in zip(tree.flatten_up_to(a), keep) if k]


def unfiltered(leaves, tree, keep):
  """A filtered argument's tree from its differentiated leaves, None elsewhere."""
  it = iter(leaves)
  return jax.tree_util.tree_unflatten(tree, [next(it) if k else None for k in keep])


def merged(leaves, a, tree, keep):
  """`a` with its differentiated leaves replaced by `leaves`."""
  it = iter(leaves)
  rest = tree.flatten_up_to(a)
  return jax.tree_util.tree_unflatten(tree, [next(it) if k else x for x, k in zip(rest, keep)])


def check_leaves(a, argnum: int, n_diff: int, holomorphic: bool, allow_int: bool) -> None:
  """jax.grad's TypeErrors for a leaf it cannot differentiate, naming the leaf's path."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
    if not _is_dynamic(leaf) and not isinstance(leaf, (bool, int, float, complex)):
      raise not_array_error(path, leaf, argnum, n_diff)
    try:
      _compat.check_input_dtype_grad(holomorphic, allow_int, leaf)
    except TypeError as e:
      if not holomorphic:  # an nnx module's RNG key / count, say what to do
        from ooojax._explain_inputs import int_leaves_note

        int_leaves_note(e)
      raise path_note(e, path, argnum, n_diff)  # noqa: B904 - the same error, notes added


class Filtered:
  """A module split as Equinox splits it: `diff` (the inexact arrays, None at the
  static leaves), `combine(diff)` the module again, `loss(fn)` fn over `diff`.
  The train steps' form (the pipeline's, data parallel's); `ooo.grad` filters
  inside its own trace."""

  def __init__(self, params):
    leaves, self.tree = jax.tree.flatten(params)
    self.keep = tuple(is_inexact_array(x) for x in leaves)
    self.rest = tuple(None if k else x for x, k in zip(leaves, self.keep))
    self.diff = self.tree.unflatten([x if k else None for x, k in zip(leaves, self.keep)])

  def combine(self, diff):
    it = iter(jax.tree.leaves(diff))
    return self.tree.unflatten([next(it) if k else r for r, k in zip(self.rest, self.keep)])

  def loss(self, loss_fn):
    @functools.wraps(loss_fn)
    def loss_of_diff(diff, *batch, **kwargs):
      return loss_fn(self.combine(diff), *batch, **kwargs)

    return loss_of_diff


_HOW = (
  "ooo.grad, like jax.grad, differentiates every leaf of a plain pytree. For a "
  "tree with static fields, differentiate only its float arrays as Equinox does: "
  "ooojax.equinox.filter_value_and_grad(loss)(model, ...) (any pytree; an "
  "eqx.Module passed to ooo.grad is filtered so already), or split it first "
  "(params, static = eqx.partition(model, eqx.is_inexact_array)) and "
  "differentiate params."
)


def not_array_error(path, leaf, argnum: int, n_diff: int) -> TypeError:
  """jax.grad's TypeError for a leaf that is not an array, naming its path."""
  where = f"argument {argnum}" if n_diff > 1 else "the differentiated argument"
  return TypeError(
    f"{where} has a leaf at {jax.tree_util.keystr(path) or '(root)'} of type "
    f"{type(leaf).__name__} ({_short(leaf)}), which is not a JAX type and cannot be "
    f"differentiated. {_HOW}"
  )


def path_note(err: TypeError, path, argnum: int, n_diff: int) -> TypeError:
  where = f"argument {argnum}" if n_diff > 1 else "the differentiated argument"
  err.add_note(f"ooo.grad: the leaf is {where}'s {jax.tree_util.keystr(path) or '(root)'}. {_HOW}")
  return err


def _short(x) -> str:
  r = repr(x)
  return r if len(r) <= 60 else r[:57] + "..."
