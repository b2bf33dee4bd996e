"""Equinox glue: `filter_value_and_grad` / `filter_grad` as Equinox spells them.

`eqx.filter_value_and_grad(loss)(model, x, y)` becomes
`ooojax.equinox.filter_value_and_grad(loss)(model, x, y)`: the first
argument's inexact arrays are differentiated, everything else (int fields,
functions, Python floats such as a max-pool's `init=-inf` or `Dropout.p`) is
left static, and the gradient is the model's tree with None at the static
leaves, ready for `optax` via `eqx.filter` / `eqx.apply_updates`. The other
arguments' arrays are traced, not differentiated.

`ooo.grad` / `ooo.value_and_grad` / `ooo.explain` filter a differentiated
argument that is (or holds) an `eqx.Module` the same way, so
`ooo.value_and_grad(loss)(model, x, y)` works too; these functions also
filter plain pytrees with static leaves. Options are `ooo.grad`'s (mode,
streams, ...; see `ooojax.Options`).

This module needs no equinox import of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ooojax._api import _make_options, _Transformed

__all__ = ["filter_grad", "filter_value_and_grad"]


def filter_value_and_grad(fun: Callable | None = None, *, has_aux: bool = False, **options):
  """Like `eqx.filter_value_and_grad`, with the backward pass split and scheduled.

  >>> import equinox as eqx, jax, jax.numpy as jnp
  >>> from ooojax.equinox import filter_value_and_grad
  >>> model = eqx.nn.Sequential([eqx.nn.Linear(3, 2, key=jax.random.key(0)),
  ...                            eqx.nn.Lambda(jax.nn.relu)])
  >>> loss, g = filter_value_and_grad(lambda m, x: jnp.sum(m(x) ** 2))(model, jnp.ones(3))
  >>> g.layers[0].weight.shape, g.layers[1].fn   # the function field: None
  ((2, 3), None)
  """
  opts = _make_options(options)
  if fun is None:
    return lambda f: filter_value_and_grad(f, has_aux=has_aux, **options)
  if not callable(fun):
    raise TypeError(f"Expected a callable value, got {fun!r}")
  return _Transformed(fun, 0, has_aux, False, False, opts, filter=True)


def filter_grad(fun: Callable | None = None, *, has_aux: bool = False, **options):
  """Like `eqx.filter_grad`: `filter_value_and_grad` without the value.

  >>> import equinox as eqx, jax, jax.numpy as jnp
  >>> from ooojax.equinox import filter_grad
  >>> lin = eqx.nn.Linear(3, 2, key=jax.random.key(0))
  >>> filter_grad(lambda m, x: jnp.sum(m(x)))(lin, jnp.ones(3)).bias.tolist()
  [1.0, 1.0]
  """
  if fun is None:
    _make_options(options)
    return lambda f: filter_grad(f, has_aux=has_aux, **options)
  vg = filter_value_and_grad(fun, has_aux=has_aux, **options)

  @functools.wraps(fun)
  def grad_f(*args, **kwargs):
    out, g = vg(*args, **kwargs)
    return (g, out[1]) if has_aux else g

  grad_f._ooo = vg
  return grad_f
