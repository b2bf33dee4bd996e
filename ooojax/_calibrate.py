"""`ooo.calibrate`: measure each schedule unit on the current device.

Each unit (the forward, every dX segment, every dW cluster) is cut out of the
split jaxpr as a function of the values it reads, run on synthetic inputs of
the right shapes chained 1 and 1 + 4 times in one jitted function, and timed
(warm-up, then the median of `reps` synchronized runs); the difference per
pass is the unit's time without the call's dispatch cost. The result maps unit labels to seconds and plugs
into any `ooo.grad(..., measured=...)` so the scheduler and the simulator use
measured rather than estimated costs. Units run alone here, so their sum is
the in-order step time the simulator predicts; overlap is not measured.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from ooojax.passes import _compat
from ooojax.passes.ir import Kind


def _unit_io(jaxpr, eqn_ids, skip):
  eqns = [jaxpr.eqns[k] for k in eqn_ids if not skip[k]]
  defined, ins, seen = set(), [], set()
  for e in eqns:
    for v in e.invars:
      if isinstance(v, _compat.Var) and v not in defined and v not in seen:
        seen.add(v)
        ins.append(v)
    defined.update(e.outvars)
  used_later = set(jaxpr.outvars)
  for e in jaxpr.eqns:
    used_later.update(v for v in e.invars if isinstance(v, _compat.Var))
  outs = [
    v for e in eqns for v in e.outvars if v in used_later and not isinstance(v, _compat.DropVar)
  ]
  return eqns, ins, outs


def _run(eqns, ins, outs, args):
  env = dict(zip(ins, args))
  for e in eqns:
    vals = _compat.bind_eqn(
      e, [v.val if isinstance(v, _compat.Literal) else env[v] for v in e.invars]
    )
    env.update(zip(e.outvars, vals))
  return [env[v] for v in outs]


def _looped(eqns, ins, outs, k: int):
  """Runs the unit k times in one jitted function, each pass feeding the next.

  A data dependence (a zero-weighted sum of the outputs added to one input)
  keeps XLA from hoisting the unit out of the loop; timing k=1 against k=n
  cancels the per-call dispatch cost that dominates small units.
  """
  floats = [i for i, v in enumerate(ins) if jnp.issubdtype(v.aval.dtype, jnp.floating)]

  def f(*args):
    a = list(args)
    res = []
    for _ in range(k):  # unrolled: an XLA loop body misses layout assignment on CPU
      res = _run(eqns, ins, outs, a)
      if floats:
        s = sum(
          jnp.sum(r).astype(jnp.float32) for r in res if jnp.issubdtype(r.dtype, jnp.floating)
        )
        a[floats[0]] = a[floats[0]] + (s * 0.0).astype(a[floats[0]].dtype)
    return res

  return jax.jit(f)


def _example(aval, rng):
  dt = aval.dtype
  if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
    return (
      jax.random.split(jax.random.key(0), int(np.prod(aval.shape)) or 1).reshape(aval.shape)
      if aval.shape
      else jax.random.key(0)
    )
  if jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.complexfloating):
    return jnp.asarray(rng.standard_normal(aval.shape), dt)
  if dt == jnp.bool_:
    return jnp.zeros(aval.shape, dt)
  return jnp.zeros(aval.shape, dt)  # indices stay in range


def time_fn(fn, args, reps: int = 10) -> float:
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def calibrate(
  fun, *args, argnums=0, has_aux=False, reps: int = 10, kwargs=None, **options
) -> dict[str, float]:
  """Measured seconds per schedule unit label ("forward", "X3", a param path).

  >>> import jax.numpy as jnp, ooojax as ooo
  >>> t = ooo.calibrate(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((8, 8)), jnp.ones((4, 8)), reps=2)
  >>> "forward" in t and all(v > 0 for v in t.values())
  True
  """
  from ooojax._api import value_and_grad

  vg = value_and_grad(fun, argnums, has_aux, **options)
  plan, dyn = vg.plan(args, kwargs or {})
  split = plan.split
  jaxpr = split.jaxpr.jaxpr
  skip = [k is Kind.DEAD for k in split.kinds]
  rng = np.random.default_rng(0)
  out = {}
  for u in plan.schedule.units:
    if not u.eqns:
      continue
    eqns, ins, outs = _unit_io(jaxpr, u.eqns, skip)
    example = [_example(v.aval, rng) for v in ins]
    t1 = time_fn(_looped(eqns, ins, outs, 1), example, reps)
    tn = time_fn(_looped(eqns, ins, outs, 1 + _EXTRA), example, reps)
    out[u.label] = max((tn - t1) / _EXTRA, 1e-8)
  return out


_EXTRA = 4  # extra loop passes timed per unit
