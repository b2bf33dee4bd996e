"""cost: an analytic per-equation cost model (roofline + kernel launch overhead).

Contract: `estimate(eqn, spec) -> EqnCost`, and `CostModel(spec, measured)` to
price whole units; `measured` maps a unit label (e.g. a parameter path) to
seconds and replaces the estimate (the calibration hook).

Model: a "kernel" primitive (matmul, conv, reduction, gather/scatter...) costs
`launch + max(flops / peak, bytes / bandwidth)`. Elementwise and layout
primitives are assumed fused into a neighbouring kernel (as XLA does), so they
add their memory traffic but no launch. `util` is the share of the device a
unit keeps busy when it runs alone: launch-bound and small kernels leave SMs
idle, which is exactly the room a second stream can fill.

Loops (`LOOP_RULES`): a `scan` is priced as its body x `length`, a `while`
with a known trip count (the `fori_loop` pattern: a counter from a literal
compared with a literal bound) likewise, and a `cond` by its dearest branch;
nested loops recurse. A `while` whose trip count is unknown is priced as one
trip. A trip costs at least one launch (the loop's counter and condition).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from ooojax.passes import _compat


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  name: str
  matmul_flops: float  # dense fp32 matmul peak as XLA runs it (TF32 where default)
  matmul_flops_16: float  # bf16/fp16 tensor-core peak
  vector_flops: float  # fp32 non-matmul peak
  bandwidth: float  # bytes/s, device memory
  launch: float  # seconds per kernel launch (no CUDA graph)
  parallel_elems: int  # output elements that fill the device (SMs x resident threads)
  sync: float = 2e-6  # cross-stream event record + wait (a stream call left to XLA)
  # what a pinned stream call costs the step beyond its kernels, measured on this
  # GPU (`passes.calibration`); None: uncalibrated, calls priced at `sync` only
  pinned_call: float | None = None


# Vendor datasheet peaks (dense), rounded. Launch overhead from common
# measurements of XLA kernels without command buffers.
DEVICE_SPECS: dict[str, DeviceSpec] = {
  "V100": DeviceSpec("V100", 15.7e12, 125e12, 15.7e12, 900e9, 5e-6, 80 * 2048),
  "A100": DeviceSpec("A100", 156e12, 312e12, 19.5e12, 1555e9, 4e-6, 108 * 2048),
  "H100": DeviceSpec("H100", 495e12, 989e12, 67e12, 3350e9, 3e-6, 132 * 2048),
  # H100's SMs and clocks with HBM3e (4.8 TB/s): where the lent GPU measured (issue 53)
  "H200": DeviceSpec("H200", 495e12, 989e12, 67e12, 4800e9, 3e-6, 132 * 2048),
  "CPU": DeviceSpec("CPU", 100e9, 100e9, 50e9, 20e9, 1e-6, 64, sync=1e-6),
}


def get_spec(name_or_spec: str | DeviceSpec | None) -> DeviceSpec:
  """Looks a spec up by name ("H100"), passes a `DeviceSpec` through, or guesses."""
  if isinstance(name_or_spec, DeviceSpec):
    return name_or_spec
  if name_or_spec is None:
    name_or_spec = _guess_device()
  key = str(name_or_spec).upper()
  for name, spec in DEVICE_SPECS.items():
    if name in key:
      return calibrated(spec)
  raise ValueError(
    f"unknown device spec {name_or_spec!r}; use one of "
    f"{sorted(DEVICE_SPECS)} or pass an ooojax.passes.cost.DeviceSpec"
  )


def calibrated(spec: DeviceSpec) -> DeviceSpec:
  """`spec` with its device's measured per-call cost (`passes.calibration`), if any."""
  from ooojax.passes import calibration

  cal = calibration.for_device(spec.name)
  if cal is None or cal.call_seconds is None:
    return spec
  return dataclasses.replace(spec, sync=cal.call_seconds, pinned_call=cal.pinned_call_seconds)


def _guess_device() -> str:
  import jax

  try:
    kind = jax.devices()[0].device_kind
  except RuntimeError:  # pragma: no cover
    return "CPU"
  for name in DEVICE_SPECS:
    if name in kind.upper():
      return name
  return "H100" if jax.default_backend() == "gpu" else "CPU"


class EqnCost(NamedTuple):  # a tuple, not a dataclass: built once per equation priced
  flops: float
  bytes: float
  kernel: bool  # launches a kernel of its own
  out_elems: int


def _size(aval) -> int:
  return int(math.prod(getattr(aval, "shape", ()) or ()))


_ITEMSIZE: dict = {}  # dtype -> bytes: np.dtype() per equation was a third of `estimate`


def _itemsize(dtype) -> int:
  n = _ITEMSIZE.get(dtype)
  if n is None:
    try:
      n = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys, float0): count as 4 bytes
      n = 4
    _ITEMSIZE[dtype] = n
  return n


def _nbytes(aval) -> int:
  return _size(aval) * _itemsize(getattr(aval, "dtype", None))


def _dot_flops(eqn) -> float:
  lc, _ = _compat.dot_contracting(eqn)
  lhs = eqn.invars[0].aval
  k = math.prod(lhs.shape[d] for d in lc) if lc else 1
  return 2.0 * _size(eqn.outvars[0].aval) * k


def _conv_flops(eqn) -> float:
  rhs = eqn.invars[1].aval
  per_out = math.prod(rhs.shape) / max(rhs.shape[_compat.conv_out_feature_dim(eqn)], 1)
  per_out /= _compat.conv_group_count(eqn)
  return 2.0 * _size(eqn.outvars[0].aval) * per_out


FlopsRule = Callable[[object], float]
FLOP_RULES: dict[str, FlopsRule] = {
  "dot_general": _dot_flops,
  "conv_general_dilated": _conv_flops,
}
MATMUL_PRIMS = frozenset(FLOP_RULES)
# Primitives that XLA emits as kernels of their own rather than fusing away.
KERNEL_PRIMS = frozenset(
  {
    "dot_general",
    "conv_general_dilated",
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "cummax",
    "cumlogsumexp",
    "gather",
    "scatter",
    "scatter-add",
    "scatter_add",
    "scatter_mul",
    "sort",
    "reduce_window_sum",
    "reduce_window_max",
    "reduce_window",
    "select_and_scatter_add",
    "select_and_gather_add",
    "dynamic_slice",
    "dynamic_update_slice",
    "fft",
    "reduce_precision",
    "scan",
    "while",
    "cond",
    "custom_call",
    "ffi_call",
    "all_reduce",
    "psum",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
  }
)


@dataclasses.dataclass(frozen=True)
class Loop:
  """How a control-flow equation runs its bodies.

  `regions` are `(body equations, trips)`; with `alternatives` only the
  dearest region runs (a `cond`'s branches), else all of them run.
  """

  regions: tuple[tuple[tuple, float], ...]
  alternatives: bool = False


def _body(j):
  return tuple(getattr(j, "jaxpr", j).eqns)


def _scan_loop(eqn) -> Loop:
  info = _compat.scan_info(eqn)
  return Loop(((_body(info.body), float(info.length)),))


def _lit(v):
  val = getattr(v, "val", None)
  try:
    return int(val) if val is not None and getattr(val, "shape", ()) == () else None
  except (TypeError, ValueError):
    return None


def while_trips(eqn) -> int | None:
  """Trip count of a `while` in the `fori_loop` pattern, or None when unknown.

  The pattern: the condition is `lt(carry[i], bound)` where carry[i] starts
  at a literal and the body adds the literal 1 to it; `bound` is a literal or
  a carry passed through unchanged that starts at a literal.
  """
  w = _compat.while_info(eqn)
  cond, body = getattr(w.cond, "jaxpr", w.cond), getattr(w.body, "jaxpr", w.body)
  nc, nb = w.cond_nconsts, w.body_nconsts
  init = eqn.invars[nc + nb :]
  if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
    return None
  carries = cond.invars[nc:]
  a, b = cond.eqns[0].invars
  if a not in carries:
    return None
  i = carries.index(a)
  lo = _lit(init[i])
  hi = _lit(b) if b not in carries else _lit(init[carries.index(b)])
  if b in carries and body.outvars[carries.index(b)] is not body.invars[nb + carries.index(b)]:
    return None
  step = [e for e in body.eqns if body.outvars[i] in e.outvars]
  if (
    lo is None
    or hi is None
    or len(step) != 1
    or step[0].primitive.name != "add"
    or body.invars[nb + i] not in step[0].invars
    or 1 not in [_lit(v) for v in step[0].invars]
  ):
    return None
  return max(hi - lo, 0)


def _while_loop(eqn) -> Loop:
  trips = while_trips(eqn)
  w = _compat.while_info(eqn)
  t = float(trips if trips is not None else 1)
  return Loop(((_body(w.body), t), (_body(w.cond), t + 1)))


def _cond_loop(eqn) -> Loop:
  return Loop(tuple((_body(b), 1.0) for b in _compat.cond_branches(eqn)), True)


LoopRule = Callable[[object], Loop]
LOOP_RULES: dict[str, LoopRule] = {
  "scan": _scan_loop,
  "while": _while_loop,
  "cond": _cond_loop,
}


def estimate(eqn) -> EqnCost:
  """FLOPs, bytes and kernel-ness of one equation (device independent)."""
  name = eqn.primitive.name
  loop = LOOP_RULES.get(name)
  if loop is not None:
    return _loop_estimate(eqn, loop(eqn))
  call = _compat.call_body(eqn)
  if call is not None:  # a forward call kept whole by split: price its insides
    cs = [estimate(e) for e in _body(call.jaxpr)]
    return EqnCost(
      sum(c.flops for c in cs),
      sum(c.bytes for c in cs),
      any(c.kernel for c in cs),
      sum(c.out_elems for c in cs),
    )
  out_bytes = out_elems = 0
  for v in eqn.outvars:
    aval = v.aval
    n = _size(aval)
    out_elems += n
    out_bytes += n * _itemsize(getattr(aval, "dtype", None))
  if name not in KERNEL_PRIMS:  # fused into a neighbour: its output traffic, no launch
    return EqnCost(float(out_elems), float(out_bytes), False, out_elems)
  rule = FLOP_RULES.get(name)
  if rule is not None:
    flops = rule(eqn)
  else:
    flops = float(sum(_size(getattr(v, "aval", None)) for v in eqn.invars))
  in_bytes = sum(_nbytes(getattr(v, "aval", None)) for v in eqn.invars)
  return EqnCost(flops, float(in_bytes + out_bytes), True, out_elems)


def _loop_estimate(eqn, loop: Loop) -> EqnCost:
  per = []
  for eqns, trips in loop.regions:
    cs = [estimate(e) for e in eqns]
    per.append((trips * sum(c.flops for c in cs), trips * sum(c.bytes for c in cs)))
  if loop.alternatives:
    per = [max(per, key=lambda fb: fb[0])] if per else []
  out_elems = sum(_size(v.aval) for v in eqn.outvars)
  return EqnCost(sum(f for f, _ in per), sum(b for _, b in per), True, out_elems)


def _roofline(spec: DeviceSpec, c: EqnCost, matmul: bool, dtype=None) -> tuple[float, float]:
  """(seconds, share of the SMs it fills) of one equation on `spec`.

  A matmul runs at the tensor-core peak of its dtype and fills the SMs by its
  tiles (~128 MACs per thread); anything else at the vector peak, by its
  output elements.
  """
  if matmul:
    peak = spec.matmul_flops_16 if _itemsize(dtype) <= 2 else spec.matmul_flops
    work = c.flops / 256
  else:
    peak = spec.vector_flops
    work = c.out_elems
  return (
    max(c.flops / peak, c.bytes / spec.bandwidth),
    min(1.0, max(work / spec.parallel_elems, 0.05)),
  )


@dataclasses.dataclass(frozen=True)
class UnitCost:
  seconds: float
  util: float  # 0..1: share of the device this work keeps busy alone
  kernels: int


class CostModel:
  """Prices groups of equations on a `DeviceSpec`; measured timings win.

  >>> from ooojax.passes.cost import CostModel
  >>> cm = CostModel("H100", measured={"w": 1e-3})
  >>> cm.unit_cost([], label="w").seconds
  0.001
  """

  def __init__(
    self, spec: str | DeviceSpec | None = None, measured: Mapping[str, float] | None = None
  ):
    self.spec = get_spec(spec)
    self.measured = dict(measured or {})

  def eqn_seconds(self, c: EqnCost, matmul: bool, dtype=None) -> float:
    return _roofline(self.spec, c, matmul, dtype)[0]

  def occupancy(self, c: EqnCost, matmul: bool) -> float:
    """Share of the SMs a kernel fills: a matmul tile is ~128 MACs per thread."""
    return _roofline(self.spec, c, matmul)[1]

  def unit_cost(self, eqns, label: str = "") -> UnitCost:
    """Cost of running `eqns` (jaxpr equations) back to back on one stream."""
    work, busy, kernels = self._price(eqns)
    kernels = max(int(round(kernels)), 1 if eqns else 0)
    seconds = work + kernels * self.spec.launch
    if label in self.measured:
      return UnitCost(self.measured[label], 1.0, kernels)
    util = busy / seconds if seconds > 0 else 0.0
    return UnitCost(seconds, min(max(util, 0.01), 1.0), kernels)

  def _price(self, eqns) -> tuple[float, float, float]:
    """(work seconds, busy seconds, kernels) of `eqns`; loops priced from their bodies."""
    spec = self.spec
    kernels = 0.0
    work = 0.0
    busy = 0.0
    for eqn in eqns:
      name = eqn.primitive.name
      rule = LOOP_RULES.get(name)
      if rule is not None:
        w, b, k = self._price_loop(rule(eqn))
        work, busy, kernels = work + w, busy + b, kernels + k
        continue
      c = estimate(eqn)
      matmul = name in MATMUL_PRIMS
      dtype = getattr(eqn.outvars[0].aval, "dtype", None) if matmul and eqn.outvars else None
      t, occ = _roofline(spec, c, matmul, dtype)
      work += t
      if c.kernel:
        kernels += 1
        busy += t * occ
      else:
        busy += t
    return work, busy, kernels

  def _price_loop(self, loop: Loop) -> tuple[float, float, float]:
    priced = []
    for eqns, trips in loop.regions:
      w, b, k = self._price(eqns)
      priced.append((trips * w, trips * b, trips * k))
    if loop.alternatives:
      seconds = lambda p: p[0] + p[2] * self.spec.launch
      return max(priced, key=seconds) if priced else (0.0, 0.0, 0.0)
    # A trip is at least one kernel: the loop counter and condition.
    trips = max((t for _, t in loop.regions), default=0.0)
    w, b, k = (sum(p[i] for p in priced) for i in range(3))
    return w, b, max(k, trips)

  def loop_trips(self, eqn) -> float:
    """How many times a loop equation runs its body (1 for non-loops)."""
    rule = LOOP_RULES.get(eqn.primitive.name)
    if rule is None:
      return 1.0
    loop = rule(eqn)
    return 1.0 if loop.alternatives else max((t for _, t in loop.regions), default=1.0)
