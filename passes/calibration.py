"""calibration: per-device figures measured on a GPU, read by the cost model.

Contract: `load(path) -> Calibration`; `for_device(name) -> Calibration | None`
finds the file for a device spec name; `passes.cost.get_spec` applies it.

A calibration file is JSON, one per device, written by the GPU experiment
(`benchmarks/gpu.sh`, issue 50) and shipped in `ooojax/calibration/` once a GPU
has run it (`$OOOJAX_CALIBRATION`, a folder, is searched first):

    {"format": 1, "device": "H100", "jax": "0.11.2",
     "call_seconds": 4e-05, "pinned_call_seconds": 1e-4,
     "pair_gain": {"resnet50_stage4_3x3/b32": 1.0}, "source": "..."}

* `call_seconds`: what one stream call left to XLA's scheduler costs on that GPU
  beyond its kernels (event record, wait, a split command buffer), measured from
  chained small dots with and without `compute_on`; the spec's `sync`.
* `pinned_call_seconds` (default: `call_seconds`): the same for a call whose
  window is pinned, as `single_gpu` pins them; `DeviceSpec.pinned_call`. With it,
  admission (`passes.schedule`, `passes.stream_cost`) keeps a call only where its
  predicted concurrency gain exceeds this.
* `pair_gain`: G = (t_dX + t_dW) / t_both for measured dX/dW pairs (evidence for
  the concurrency model's fills, shown in the docs; not read by the planner).
* `source`: where the figures come from (a run, a date, a commit).
* `kernel_scale` (issue 53): measured kernel seconds over the roofline's work
  (`max(flops / peak, bytes / bandwidth)`, launch left out) per kernel class,
  `"gemm"` (GEMMs, convs) and `"other"`; `launch_seconds`: the compute stream's
  seconds per kernel beyond its work (the gaps between kernels). The replay of
  compiled programs (`passes.hlo.replay`, `calibration=`) prices kernels with
  them; `benchmarks.dp_calibrate --fit` writes them from a GPU run.

`call_seconds` may be left out where the GPU run did not measure it (the
spec's own per-call cost stays); a file gives it or a `kernel_scale`.

>>> c = Calibration.from_dict({"format": 1, "device": "H100", "jax": "0.11.2", "call_seconds": 4e-5})
>>> c.call_seconds, c.pinned_call_seconds, c.pair_gain
(4e-05, 4e-05, {})
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Mapping

ENV = "OOOJAX_CALIBRATION"
SHIPPED = pathlib.Path(__file__).parent.parent / "calibration"  # ooojax/calibration
FORMAT = 1
KERNEL_CLASSES = ("gemm", "other")


def _positive(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


@dataclasses.dataclass(frozen=True)
class Calibration:
  device: str
  jax: str
  call_seconds: float | None
  pair_gain: Mapping[str, float] = dataclasses.field(default_factory=dict)
  source: str = ""  # the file read
  pinned_call_seconds: float | None = None
  note: str = ""  # the file's own "source": where its figures come from
  kernel_scale: Mapping[str, float] = dataclasses.field(default_factory=dict)
  launch_seconds: float | None = None

  @classmethod
  def from_dict(cls, d: Mapping, source: str = "") -> Calibration:
    where = f" in {source}" if source else ""
    if d.get("format") != FORMAT:
      raise ValueError(f"calibration{where}: format must be {FORMAT}, got {d.get('format')!r}")
    missing = [k for k in ("device", "jax") if k not in d]
    if "call_seconds" not in d and "kernel_scale" not in d:
      missing.append("call_seconds")
    if missing:
      raise ValueError(f"calibration{where}: missing {missing} (see passes.calibration)")

    def seconds(key):
      t = d.get(key)
      if t is not None and (
        not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < 1
      ):
        raise ValueError(f"calibration{where}: {key} must be seconds in [0, 1), got {t!r}")
      return None if t is None else float(t)

    scale = dict(d.get("kernel_scale", {}))
    bad = {k: v for k, v in scale.items() if k not in KERNEL_CLASSES or not _positive(v)}
    if bad:
      raise ValueError(
        f"calibration{where}: kernel_scale takes positive factors for {KERNEL_CLASSES}, got {bad!r}"
      )
    call = seconds("call_seconds")
    pinned = seconds("pinned_call_seconds")
    gain = {str(k): float(v) for k, v in dict(d.get("pair_gain", {})).items()}
    return cls(
      device=str(d["device"]),
      jax=str(d["jax"]),
      call_seconds=call,
      pair_gain=gain,
      source=source,
      pinned_call_seconds=call if pinned is None else pinned,
      note=str(d.get("source", d.get("fitted_by", ""))),
      kernel_scale={k: float(v) for k, v in scale.items()},
      launch_seconds=seconds("launch_seconds"),
    )


def load(path: str | os.PathLike) -> Calibration:
  """Reads and checks one calibration file."""
  p = pathlib.Path(path)
  return _load(str(p), p.stat().st_mtime)


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime: float) -> Calibration:
  del mtime  # part of the cache key: a rewritten file is read again
  with open(path) as f:
    return Calibration.from_dict(json.load(f), path)


def for_device(name: str) -> Calibration | None:
  """The calibration of device spec `name` ("H100"): `$OOOJAX_CALIBRATION/h100.json`,
  else the shipped one, else None. `OOOJAX_CALIBRATION=none`: none at all (the
  uncalibrated presets; the test suite plans with them); a value that is neither
  `none` nor a folder is a `ValueError`."""
  env = os.environ.get(ENV)
  if env == "none":
    return None
  if env and not pathlib.Path(env).is_dir():
    # a device name here ("h200") would otherwise be ignored without a word
    raise ValueError(
      f"{ENV}={env!r} is not a folder: set it to a folder holding <device>.json "
      f"calibration files, to 'none' for the uncalibrated presets, or unset it for the "
      f"shipped files ({', '.join(sorted(f.name for f in SHIPPED.glob('*.json')))}); "
      "the device is chosen with device=, e.g. device='H200'"
    )
  dirs = [pathlib.Path(env)] if env else []
  for d in [*dirs, SHIPPED]:
    f = d / f"{name.lower()}.json"
    if f.is_file():
      return load(f)
  return None
