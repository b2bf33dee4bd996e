"""`Options`: the keyword options shared by `grad`, `value_and_grad` and `explain`,
and how `mode="auto"` resolves (split out of `ooojax._api`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from ooojax.passes.collectives import plan as _collectives, wire as _wire
from ooojax.passes.cost import DeviceSpec
from ooojax.passes.emit import ORDERINGS

MODES = ("auto", "single_gpu", "in_order", "data_parallel")
# What mode="auto" runs on each backend. CPUs have no streams, and on XLA:CPU an
# annotated call keeps its convs out of layout assignment (~9x slower steps):
# in_order. On a GPU the cost model decides (issue 50): two streams only where
# the plan, its stream calls priced as this GPU measured them
# (`passes.calibration`, `passes.stream_cost`), is predicted at least
# `AUTO_MIN_SPEEDUP` faster than in order; otherwise the in-order schedule.
AUTO_MODE = {"cpu": "in_order", "gpu": "single_gpu"}
AUTO_MIN_SPEEDUP = 1.03


FSDP = ("auto", "regather", "keep")


@dataclasses.dataclass(frozen=True)
class Options:
  """Keyword options shared by `grad`, `value_and_grad` and `explain`.

  mode: "auto" (`AUTO_MODE`: in order on a CPU; on a GPU two streams where the
    calibrated cost model predicts at least 1.03x, else in order),
    "single_gpu" (dW clusters on a second stream), or "in_order" (split and
    re-emit on one stream, no annotations: the control to compare against).
  streams: 1 or 2 compute streams.
  device: device spec name for the cost model ("V100", "A100", "H100",
    "CPU") or a `ooojax.passes.cost.DeviceSpec`; None guesses from `jax.devices()`.
  ordering: how the schedule is pinned in XLA: "auto" (barriers, plus
    control edges when lowering for CPU), "barriers", "control_deps",
    "scheduling_group" or "none" (see `passes.emit`).
  measured: unit label -> seconds, replacing cost-model estimates; labels are
    "forward", "X<i>" (dX segment i) and parameter paths (dW clusters), as
    returned by `ooo.calibrate`.
  axis_name, reduce, bucket_bytes, first_k, link: mode="data_parallel" only
    (see `ooojax.data_parallel`): the mapped axis the batch is split over
    (inside a sharded `jax.jit`: a mesh axis, or None to find it from the
    batch's sharding; see `ooojax._dp_gspmd`);
    "mean" or "sum" of the per-device gradients; bytes per all-reduce bucket
    and layers to reverse (None: chosen by the cost and network model); the
    network preset ("nvlink", "100GbE", "25GbE", "10GbE") or a
    `ooojax.passes.simulate.Link`.
  fsdp: mode="data_parallel" inside a sharded `jax.jit`, parameters sharded
    over the data axis (FSDP / ZeRO-3): "regather" (each weight all-gathered
    just before the forward reads it and again before the backward does, so a
    device holds 1/N of the parameters plus a few gathered layers), "keep"
    (gathered once at the step's start and kept: the whole model per device)
    or "auto" (keep, unless the device's memory demands regather:
    `passes.collectives.fsdp_mode`).
  reduce_dtype: mode="data_parallel" only, opt-in: the dtype the gradients'
    all-reduces / reduce-scatters run in (`jnp.bfloat16`, `jnp.float16`; as
    PyTorch DDP's `bf16_compress_hook` or FSDP's `MixedPrecision(reduce_dtype=)`).
    A float leaf wider than it is scaled by 1/n (mean; `reduce="sum"` scales
    nothing, so float16 may overflow there), cast, summed in that dtype and cast back: the gradient keeps its dtype, with the low dtype's rounding
    (no longer equal to `jax.grad` to float32 precision), and half the bytes on
    the link for bfloat16 from float32. None (default): each leaf in its own dtype,
    exact. See `passes.collectives.wire`.
  """

  mode: str = "auto"
  streams: int = 2
  device: str | DeviceSpec | None = None
  ordering: str = "auto"
  measured: Mapping[str, float] | None = None
  axis_name: Any = None
  reduce: str = "mean"
  bucket_bytes: int | None = None
  first_k: int | None = None
  link: Any = None
  fsdp: str = "auto"
  reduce_dtype: Any = None

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"unknown mode {self.mode!r}; allowed: {MODES}")
    if self.streams not in (1, 2):
      raise ValueError(f"streams must be 1 or 2, got {self.streams!r}")
    if self.ordering not in ORDERINGS:
      raise ValueError(f"unknown ordering {self.ordering!r}; allowed: {ORDERINGS}")
    _collectives.validate_options(
      self.mode, self.axis_name, self.reduce, self.bucket_bytes, self.first_k, self.link
    )
    if self.fsdp not in FSDP:
      raise ValueError(f"fsdp must be one of {FSDP}, got {self.fsdp!r}")
    _wire.validate(self.mode, self.reduce_dtype)

  def resolved_mode(self) -> str:
    if self.mode != "auto":
      return self.mode
    return AUTO_MODE.get(jax.default_backend(), "in_order")

  def min_speedup(self) -> float:
    """The predicted speedup a two-stream plan must reach to be used."""
    return AUTO_MIN_SPEEDUP if self.mode == "auto" else 1.0

  def resolved_ordering(self) -> str:
    # Resolved per lowering platform inside the emitted program (see
    # passes.emit), never by the default backend: AOT compiles for a GPU run
    # on CPU hosts.
    return self.ordering

  def key(self):
    m = tuple(sorted(self.measured.items())) if self.measured else None
    return (
      self.mode,
      self.streams,
      self.device,
      self.ordering,
      m,
      self.axis_name,
      self.reduce,
      self.bucket_bytes,
      self.first_k,
      self.link,
      self.fsdp,
      None if self.reduce_dtype is None else _wire.normalize(self.reduce_dtype).name,
    )


_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options))


def _make_options(kwargs: dict) -> Options:
  bad = sorted(set(kwargs) - set(_OPTION_NAMES))
  if bad:
    # an unexpected keyword is a TypeError, as jax.grad(f, stream=2) raises
    raise TypeError(
      f"got an unexpected keyword argument(s) {bad}: unknown option(s); "
      f"allowed: {list(_OPTION_NAMES)}"
    )
  return Options(**kwargs)
