"""pipeline.layer_keys: per-layer keys indexed by a per-layer constant.

`keys = jax.random.split(key, n_layers)`, block i drawing from `keys[i]`, is
how Equinox (`for block, k in zip(self.blocks, keys)`) and much hand-written
JAX give each block its own dropout key. In the traced loss each block reads
a different output of one `unstack` (or a `slice` at index i), so no two
blocks compare equal and no stack is found. This pass rewrites each such
read of a key array as a `dynamic_slice` at a constant index held in a fresh
variable, recorded among the program's per-layer constants (`Program.lits`,
as `stack._per_layer_data` does for flax's folded constants): the blocks then
compare equal, and each stage hands its layers their own indices (`Cut.per_layer`).
The values are unchanged: `dynamic_slice(keys, i)` is `keys[i]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ooojax.passes import _compat
from ooojax.passes.pipeline import side as side_pass


def expand(eqns: list, consts: dict, lits: set) -> list:
  """`eqns` with every unstack / unit slice of a key array read through a per-layer
  index; the index variables' values go into `consts` and the variables into `lits`."""
  out = []
  for e in eqns:
    new = _rewrite(e, consts, lits)
    out.extend([e] if new is None else new)
  return out


def _rewrite(e, consts: dict, lits: set) -> list | None:
  if not e.invars or not isinstance(e.invars[0], _compat.Var):
    return None
  y = e.invars[0]
  if not side_pass.is_key(y.aval):
    return None
  picks = _compat.key_picks(e)  # [(axis, index, squeezed, outvar)] or None
  if not picks:
    return None
  eqns = []
  for axis, i, squeezed, v in picks:
    if isinstance(v, _compat.DropVar):
      continue
    iv = _compat.new_var(jax.core.ShapedArray((), jnp.int32))
    consts[iv] = np.int32(i)
    lits.add(iv)

    def pick(ys, k, axis=axis, squeezed=squeezed):
      z = jax.lax.dynamic_slice_in_dim(ys, k, 1, axis)
      return jax.lax.squeeze(z, (axis,)) if squeezed else z

    closed = jax.make_jaxpr(pick)(
      jax.ShapeDtypeStruct(y.aval.shape, y.aval.dtype), jax.ShapeDtypeStruct((), jnp.int32)
    )
    j = closed.jaxpr
    sub = {j.invars[0]: y, j.invars[1]: iv, j.outvars[0]: v}
    sub.update(zip(j.constvars, j.constvars))
    consts.update(zip(j.constvars, closed.consts))
    for q in j.eqns:
      eqns.append(
        q.replace(
          invars=[sub.get(u, u) if isinstance(u, _compat.Var) else u for u in q.invars],
          outvars=[sub.get(u, u) for u in q.outvars],
        )
      )
  return eqns
