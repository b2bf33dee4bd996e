"""Property test: ooo.grad / ooo.value_and_grad agree with jax.grad on random inputs.

Random small pytrees of parameters (Python floats, float32/bfloat16/int32 arrays),
argnums (negative, repeated, out of range), has_aux values (arrays, Python
scalars, strings, None, nests) and options; either the results agree exactly
(tree, types, dtype, weak type, value) or both raise the same exception type.
"""

import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, given, settings, strategies as st

import ooojax as ooo
from tests._same import assert_same, outcome

_LEAVES = {
  "pyfloat": lambda v: float(v),
  "f32": lambda v: jnp.full((2,), v, jnp.float32),
  "f32_scalar": lambda v: jnp.float32(v),
  "bf16": lambda v: jnp.full((2,), v, jnp.bfloat16),
  "i32": lambda v: jnp.full((2,), int(v), jnp.int32),
}

leaf = st.builds(
  lambda kind, v: _LEAVES[kind](v),
  st.sampled_from(sorted(_LEAVES)),
  st.floats(-2, 2, allow_nan=False, width=32),
)
tree = st.recursive(
  leaf,
  lambda c: st.one_of(
    st.lists(c, min_size=1, max_size=2),
    st.dictionaries(st.sampled_from("ab"), c, min_size=1, max_size=2),
  ),
  max_leaves=3,
)
aux_value = st.sampled_from(["arr", 3, 2.5, "s", None, ("n", 1), "nest"])
argnums = st.one_of(
  st.integers(-3, 2), st.lists(st.integers(-3, 2), min_size=1, max_size=2).map(tuple)
)


def _loss(*args):
  total = 0.0
  for i, x in enumerate(jax.tree_util.tree_leaves(args)):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
      total = total + jnp.sum(jnp.sin(x * (i + 1)).astype(jnp.float32))
    else:
      total = total + jnp.sum(x).astype(jnp.float32) * 0
  return total


def _with_aux(kind):
  def f(*args):
    loss = _loss(*args)
    aux = {"arr": loss * 2, "nest": {"x": [loss, "t"], "y": 1.5}}.get(kind, kind)
    return loss, aux

  return f


@settings(
  max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
  args=st.lists(tree, min_size=1, max_size=2),
  argnums=argnums,
  aux=st.one_of(st.none(), aux_value),
  allow_int=st.booleans(),
  value=st.booleans(),
  mode=st.sampled_from(["in_order", "single_gpu"]),
)
def test_matches_jax_grad(args, argnums, aux, allow_int, value, mode):
  has_aux = aux is not None
  f = _with_aux(aux) if has_aux else _loss
  kw = dict(argnums=argnums, has_aux=has_aux, allow_int=allow_int)
  jax_t = jax.value_and_grad if value else jax.grad
  ooo_t = ooo.value_and_grad if value else ooo.grad
  want = outcome(lambda: jax_t(f, **kw)(*args))
  got = outcome(lambda: ooo_t(f, mode=mode, device="H100", **kw)(*args))
  if want[0] == "err":
    assert got == want, (got, want)
  else:
    assert got[0] == "ok", got
    assert_same(got[1], want[1], rtol=2e-2 if _has_bf16(args) else 1e-5)


def _has_bf16(args):
  return any(getattr(x, "dtype", None) == jnp.bfloat16 for x in jax.tree_util.tree_leaves(args))
