"""Equinox modules as the pipeline's parameters.

A module passed where the automatic form takes its parameters is split as
`eqx.filter_value_and_grad` splits it: its inexact arrays are the parameters
(cut, staged, differentiated), the rest (int fields, functions, Python floats
such as a max-pool's `init=-inf` or `Dropout.p`) is closed into the loss as
it was given. Gradients are the module's tree with None at the static leaves.
"""

from __future__ import annotations

import functools

import jax

from ooojax import _filter
from ooojax._filter import Filtered


def filtered(params) -> Filtered | None:
  """The split of an Equinox module, or None for a plain tree (whose leaves must
  all be arrays: jax's TypeError, naming the first that is not, otherwise)."""
  if _filter.holds_module(params):
    return Filtered(params)
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")) and not isinstance(
      x, (bool, int, float, complex)
    ):
      raise _filter.not_array_error(path, x, 0, 1)
  return None


def automatic(make, loss_fn):
  """`make(loss_fn)` (the automatic form's `step(params, *batch)`), taking a module
  as its parameters: `make` is called again with the module's loss per call."""
  plain = make(loss_fn)

  def step(params, *batch, **kwargs):
    f = filtered(params)
    if f is None:
      return plain(params, *batch, **kwargs)
    return make(f.loss(loss_fn))(f.diff, *batch, **kwargs)

  def balance(params, *batch):
    f = filtered(params)
    if f is None:
      return plain.balance(params, *batch)
    return make(f.loss(loss_fn)).balance(f.diff, *batch)

  functools.update_wrapper(step, plain, assigned=(), updated=("__dict__",))
  step.balance = balance
  return step
