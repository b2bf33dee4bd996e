"""Bad input raises what jax.grad raises, with a clear message."""

import jax
import jax.numpy as jnp
import pytest

import ooojax as ooo


def _err(fn):
  with pytest.raises(Exception) as e:
    fn()
  return e.type, str(e.value)


def test_non_scalar_output_matches_jax():
  f = lambda w: w * 2
  jt, jm = _err(lambda: jax.grad(f)(jnp.ones(3)))
  with pytest.raises(jt, match="Gradient only defined for scalar-output functions"):
    ooo.grad(f)(jnp.ones(3))


def test_integer_input_matches_jax():
  f = lambda w: jnp.sum(w).astype(jnp.float32)
  jt, _ = _err(lambda: jax.grad(f)(jnp.arange(3)))
  with pytest.raises(jt, match="grad requires real- or complex-valued inputs"):
    ooo.grad(f)(jnp.arange(3))


def test_integer_output_matches_jax():
  f = lambda w: jnp.sum(w).astype(jnp.int32)
  with pytest.raises(TypeError, match="real-valued outputs"):
    ooo.grad(f)(jnp.ones(3))


def test_unknown_mode_names_allowed_values():
  with pytest.raises(ValueError, match=r"unknown mode 'fast'.*single_gpu"):
    ooo.grad(lambda w: w, mode="fast")
  with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['stream'\]"):
    ooo.grad(lambda w: w, stream=2)  # the type jax.grad(f, stream=2) raises
  with pytest.raises(TypeError):
    jax.grad(lambda w: w, stream=2)
  with pytest.raises(ValueError, match="streams must be 1 or 2"):
    ooo.grad(lambda w: w, streams=3)
  with pytest.raises(ValueError, match="unknown device spec"):
    ooo.grad(lambda w: jnp.sum(w), device="TPUv9")(jnp.ones(2))


def test_argnums_out_of_range_and_bad_type():
  f = lambda a, b: jnp.sum(a * b)
  with pytest.raises(TypeError, match="requires at least 3 positional arguments"):
    ooo.grad(f, argnums=2)(jnp.ones(2), jnp.ones(2))
  with pytest.raises(TypeError, match="argnums"):
    ooo.grad(f, argnums="0")
  with pytest.raises(TypeError, match="callable"):
    ooo.grad(3)


def test_has_aux_requires_pair():
  f = lambda w: jnp.sum(w)
  jt, _ = _err(lambda: jax.grad(f, has_aux=True)(jnp.ones(2)))
  with pytest.raises(jt):
    ooo.grad(f, has_aux=True)(jnp.ones(2))
