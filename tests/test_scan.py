"""Control flow: loop costs, the B/W scan split, the skewed scan."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from passes import cost


def _scanned(w, x):
  return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]


def _unrolled(w, x):
  for i in range(w.shape[0]):
    x = jnp.tanh(x @ w[i])
  return x


def _jaxpr(f, *args):
  return jax.make_jaxpr(f)(*args).jaxpr


def test_scan_costs_body_times_length():
  w, x = jnp.ones((6, 256, 256)), jnp.ones((128, 256))
  cm = cost.CostModel("H100")
  scanned, unrolled = _jaxpr(_scanned, w, x), _jaxpr(_unrolled, w, x)
  one = _jaxpr(lambda w, x: jnp.tanh(x @ w), w[0], x)
  f_scan = sum(cost.estimate(e).flops for e in scanned.eqns)
  f_one = sum(cost.estimate(e).flops for e in one.eqns)
  assert f_scan == pytest.approx(6 * f_one, rel=1e-6)
  t_scan = cm.unit_cost(scanned.eqns).seconds
  t_unrolled = cm.unit_cost(unrolled.eqns).seconds
  assert t_scan == pytest.approx(6 * cm.unit_cost(one.eqns).seconds, rel=0.02)
  assert t_scan == pytest.approx(t_unrolled, rel=0.05)
  assert cm.unit_cost(scanned.eqns).kernels == 6


def test_nested_scan_cost_multiplies():
  w, x = jnp.ones((3, 4, 64, 64)), jnp.ones((8, 64))
  nested = _jaxpr(lambda w, x: jax.lax.scan(lambda h, w: (_scanned(w, h), None), x, w)[0], w, x)
  flat = _jaxpr(_scanned, w.reshape(12, 64, 64), x)
  f = lambda j: sum(cost.estimate(e).flops for e in j.eqns)
  assert f(nested) == pytest.approx(f(flat), rel=1e-6)


def test_while_with_trip_count_and_cond():
  x = jnp.ones((64, 64))
  one = sum(cost.estimate(e).flops for e in _jaxpr(lambda x: jnp.tanh(x @ x), x).eqns)
  loop = _jaxpr(lambda x: jax.lax.while_loop(
      lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.tanh(c[1] @ c[1])), (0, x))[1], x)
  eqn = [e for e in loop.eqns if e.primitive.name == "while"][0]
  assert cost.while_trips(eqn) == 5
  assert cost.estimate(eqn).flops == pytest.approx(5 * one, rel=0.01)
  # An unknown bound: one trip, never a crash.
  unknown = _jaxpr(lambda x, n: jax.lax.while_loop(
      lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ c[1]), (0, x))[1], x, 3)
  eqn = [e for e in unknown.eqns if e.primitive.name == "while"][0]
  assert cost.while_trips(eqn) is None
  branchy = _jaxpr(lambda x, p: jax.lax.cond(p > 0, lambda x: x @ x @ x, lambda x: x + 1, x), x, 1)
  eqn = [e for e in branchy.eqns if e.primitive.name == "cond"][0]
  assert cost.estimate(eqn).flops == pytest.approx(2 * 2 * 64 ** 3)
