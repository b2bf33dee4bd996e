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


@dataclasses.dataclass(frozen=True)
class Calibration:
  device: str
  jax: str
  call_seconds: float
  pair_gain: Mapping[str, float] = dataclasses.field(default_factory=dict)
  source: str = ""  # the file read
  pinned_call_seconds: float = 0.0
  note: str = ""  # the file's own "source": where its figures come from

  @classmethod
  def from_dict(cls, d: Mapping, source: str = "") -> Calibration:
    where = f" in {source}" if source else ""
    if d.get("format") != FORMAT:
      raise ValueError(f"calibration{where}: format must be {FORMAT}, got {d.get('format')!r}")
    missing = [k for k in ("device", "jax", "call_seconds") if k not in d]
    if missing:
      raise ValueError(f"calibration{where}: missing {missing} (see passes.calibration)")
    for k in ("call_seconds", "pinned_call_seconds"):
      t = d.get(k, 0.0)
      if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < 1:
        raise ValueError(f"calibration{where}: {k} must be seconds in [0, 1), got {t!r}")
    t = float(d["call_seconds"])
    pinned = float(d.get("pinned_call_seconds", t))
    gain = {str(k): float(v) for k, v in dict(d.get("pair_gain", {})).items()}
    return cls(str(d["device"]), str(d["jax"]), t, gain, source, pinned, str(d.get("source", "")))


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
  uncalibrated presets; the test suite plans with them)."""
  env = os.environ.get(ENV)
  if env == "none":
    return None
  dirs = [pathlib.Path(env)] if env else []
  for d in [*dirs, SHIPPED]:
    f = d / f"{name.lower()}.json"
    if f.is_file():
      return load(f)
  return None
