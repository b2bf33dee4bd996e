"""Argument checks shared by `grad`, its data-parallel paths and `explain`.

Below `_api` so that `_dp_gspmd` and the explain modules read them without
importing the façade that imports them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from ooojax.passes import _compat


def _is_dynamic(x) -> bool:
  # Arrays are traced; everything else (Python scalars, strings, modules) is
  # closed over as jax.grad closes over non-differentiated arguments.
  # ShapeDtypeStructs too: `explain` and AOT lowering need shapes only.
  return isinstance(
    x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
  ) or _compat.is_tracer(x)


def _resolve_argnums(argnums, n_args: int) -> tuple[int, ...]:
  """jax.grad's argnums checks, plus a TypeError for an argument named twice."""
  idx = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  out = []
  for a in idx:
    if a < -n_args:
      raise ValueError(
        "Positional argument indices, e.g. for `static_argnums`, must have value "
        f"greater than or equal to -len(args) and less than len(args), but got "
        f"value {a} for len(args) == {n_args}."
      )
    if a >= n_args:
      raise TypeError(
        f"differentiating with respect to argnums={argnums} requires "
        f"at least {a + 1} positional arguments to be passed "
        f"by the caller, but got only {n_args} positional arguments."
      )
    out.append(a % n_args)
  if len(set(out)) != len(out):
    raise TypeError(
      f"argnums={argnums} names the same positional argument more than "
      f"once (resolved to {tuple(out)} for {n_args} arguments); jax.grad "
      "fails on repeated argnums too: list each argument once."
    )
  return tuple(out)


def _check_argnums(argnums):
  if isinstance(argnums, (int, np.integer)) and not isinstance(argnums, bool):
    return int(argnums)
  if isinstance(argnums, Sequence) and all(
    isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in argnums
  ):
    out = tuple(int(a) for a in argnums)
    if not out:
      raise ValueError(
        "argnums=() selects no argument to differentiate; pass an int or a non-empty tuple of ints"
      )
    if len(set(out)) != len(out):
      raise TypeError(
        f"argnums={out} names the same argument more than once "
        "(jax.grad fails on repeated argnums too): list each argument once"
      )
    return out
  raise TypeError(f"argnums must be an int or a tuple of ints, got {argnums!r}")
