"""Exact comparison of ooo.grad results against jax.grad: tree, types, dtype, weak type, value."""

import jax
import numpy as np


def _is_array(x):
  return isinstance(x, jax.Array)


def assert_same(got, want, rtol=1e-5, atol=1e-6):
  lg, tg = jax.tree_util.tree_flatten(got)
  lw, tw = jax.tree_util.tree_flatten(want)
  assert tg == tw, f"tree mismatch: {tg} vs {tw}"
  for g, w in zip(lg, lw):
    if _is_array(w):
      assert _is_array(g), (type(g), w)
      assert g.dtype == w.dtype, (g.dtype, w.dtype)
      assert g.shape == w.shape, (g.shape, w.shape)
      assert g.aval.weak_type == w.aval.weak_type, ("weak_type", g, w)
      if w.dtype == jax.dtypes.float0:
        continue
      np.testing.assert_allclose(
        np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=atol, equal_nan=True
      )
    else:
      assert type(g) is type(w), (type(g), type(w))
      if isinstance(w, np.ndarray):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
      elif isinstance(w, float) and np.isnan(w):
        assert np.isnan(g)
      else:
        assert g == w, (g, w)


def outcome(fn):
  """`("ok", result)` or `("err", exception type)`."""
  try:
    return "ok", fn()
  except Exception as e:  # noqa: BLE001 - the type is what is compared
    return "err", type(e)
