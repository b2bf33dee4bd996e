"""pipeline.weight_slices: how a tick reads the layers it slices out of a stacked weight.

Contract: `root_slices(fl, n_roots) -> {eqn index: (start, sizes)}` (the
`dynamic` reading, `read(x, window, zero)`), `invariant(fl, n_roots) ->
tuple[int, ...]` (the `hoist` reading), both over `fl`'s phases, read by
`passes.pipeline.ticks`; which one a mesh gets is
`tick_options.weight_slices(mesh)`.

A stage that slices its layers out of a stacked parameter (`p["w1"][j]`)
recomputes the slice in every phase that reads it (`flavor`: a weight value is
never stored per microbatch). XLA:GPU makes each static slice a copy kernel
before a Triton GEMM: 31 a microbatch in one stage's F, B and W against the
accumulated scan's 16, where F and B share them (benchmarks/RESULTS.md,
issue 48). Two ways out:

* `dynamic`: each slice of a weight is read as a `dynamic_slice` at an offset
  XLA cannot fold (`zero`: a tick-row value known to be 0, plus the start),
  which XLA:GPU fuses into the GEMM that reads it: no copy and no memory. It
  works wherever the slice does (tiled tables, FSDP's gathered weights).
* `hoist`: the phases' weight-only data movement (slices, squeezes, reshapes,
  transposes, narrowing casts) runs once before the ticks, where the weights
  are loop constants (one step, no FSDP). The hoisted values stay live through
  the loop: a copy of the weights in temporary memory.
"""

from __future__ import annotations

import math

import numpy as np
from jax import lax

from ooojax.passes import _compat

__all__ = ["invariant", "read", "root_slices"]

# Data movement: each result is at most its operand's size.
_MOVES = frozenset(
  {"slice", "squeeze", "reshape", "transpose", "copy", "copy_p", "convert_element_type"}
)
# Results XLA keeps as views (no buffer of their own).
_VIEWS = frozenset({"squeeze", "reshape"})


def _bytes(v) -> int:
  return math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize


def _phases(fl) -> list[int]:
  return sorted(set(fl.f_eqns) | set(fl.b_eqns) | set(fl.w_eqns))


def root_slices(fl, n_roots: int) -> dict:
  """`{eqn index: (start, sizes)}`: the unit-stride `slice`s of `fl`'s phases
  whose operand is one of its first `n_roots` static inputs (constants, the
  chunk's weights, shared weights)."""
  roots = set(fl.static[:n_roots])
  out = {}
  for k in _phases(fl):
    e = fl.jaxpr.eqns[k]
    win = _compat.slice_window(e)
    if win is not None and e.invars[0] in roots:
      out[k] = win
  return out


def read(x, window, zero):
  """`x[start : start + sizes]` as a `dynamic_slice` at `zero + start`, with
  `zero` a traced 0 XLA cannot fold: a slice XLA:GPU fuses into its GEMM."""
  start, sizes = window
  return lax.dynamic_slice(x, [zero + s for s in start], sizes)


def invariant(fl, n_roots: int) -> tuple[int, ...]:
  """The equations of `fl`'s phases that read only its first `n_roots` static
  inputs through data movement: loop-invariant when the weights are. Empty if
  their results would take more than those inputs (e.g. a weight both sliced
  and transposed)."""
  roots = fl.static[:n_roots]
  known = set(roots)
  out, size = [], 0
  for k in _phases(fl):
    e = fl.jaxpr.eqns[k]
    ins = [v for v in e.invars if isinstance(v, _compat.Var)]
    if e.effects or e.primitive.name not in _MOVES or not ins or any(v not in known for v in ins):
      continue
    if e.primitive.name == "convert_element_type" and _bytes(e.outvars[0]) > _bytes(ins[0]):
      continue  # a widening cast: more memory than the weights it reads
    out.append(k)
    known.update(v for v in e.outvars if not isinstance(v, _compat.DropVar))
    if e.primitive.name not in _VIEWS:
      size += sum(_bytes(v) for v in e.outvars)
  if size > sum(_bytes(v) for v in roots if isinstance(v, _compat.Var)):
    return ()
  return tuple(out)
