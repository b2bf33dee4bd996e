"""pipeline.sliced: GEMM operands that are rows of a stacked stage parameter.

Contract: `sliced(flavor) -> int`, the `dot_general`s of a stage kind's F, B
and W phases (`passes.pipeline.flavor.Flavor`) that read a row of one of its parameters
(`p["w"][j]`: a slice, dynamic slice or gather of the parameter, then reshapes,
squeezes or casts). Read by `ooo.pipeline.explain`, which tells the explicit
form to hold each layer's weights as an array of its own: XLA:CPU, and XLA:GPU
before a Triton GEMM, copy such a row out of its stack before every GEMM that
reads it, in F and again in B, where the accumulated `jax.grad` copies it once
(`benchmarks/executor_cost.py`). Automatic cutting lays a Python loop's layers
out that way itself (`passes.pipeline.state.columns`).
"""

from __future__ import annotations

from ooojax.passes import _compat

__all__ = ["sliced"]

_ROWS = frozenset({"slice", "dynamic_slice", "gather"})
_VIEWS = frozenset({"squeeze", "reshape", "convert_element_type", "transpose", "copy"})


def _count(eqns, params: set, rows: set) -> int:
  n = 0
  for e in eqns:
    name = e.primitive.name
    ins = [v if isinstance(v, _compat.Var) else None for v in e.invars]  # literals: None
    first = ins[0] if ins else None
    if name in _ROWS and first in params or name in _VIEWS and first in rows:
      rows.update(e.outvars)
    elif name == "dot_general":
      n += sum(v in rows for v in ins[:2])
    else:
      body = _compat.call_body(e)
      if body is None:
        continue
      inner = getattr(body.jaxpr, "jaxpr", body.jaxpr)
      own = inner.invars[len(inner.invars) - len(ins) :]  # after the body's consts
      n += _count(
        inner.eqns,
        {b for a, b in zip(ins, own) if a in params},
        {b for a, b in zip(ins, own) if a in rows},
      )
  return n


def sliced(flavor) -> int:
  """How many GEMM operands of `flavor`'s phases are parameter rows."""
  start = len(flavor.consts)
  n_params = len(flavor.grads) - flavor.n_shared
  params = set(flavor.static[start : start + n_params])
  eqns = [flavor.jaxpr.eqns[k] for k in sorted((*flavor.f_eqns, *flavor.b_eqns, *flavor.w_eqns))]
  return _count(eqns, params, set())
