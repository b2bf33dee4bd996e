"""pipeline.actions: the pipeline action IR, shared by every pipeline pass.

An `Action` is `(stage, kind, microbatch, chunk)`, hashable, with a text form
that round-trips (`2B5`, `0F3.1`); kinds are compute (F, B, W, the fused BW)
or transfers (SF/RF: send/receive an activation, SB/RB: an input gradient).
`deps` is the one rule of what a compute action waits for.
"""
from __future__ import annotations

import dataclasses
import re

COMPUTE = ("F", "B", "W", "BW")
COMMS = ("SF", "RF", "SB", "RB")
_ACTION_RE = re.compile(r"^(\d+)(BW|SF|RF|SB|RB|F|B|W)(\d+)(?:\.(\d+))?$")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
  """One action of one stage: `kind` of `microbatch` for virtual-stage `chunk`."""
  stage: int
  kind: str
  microbatch: int
  chunk: int = 0

  def __str__(self) -> str:
    c = f".{self.chunk}" if self.chunk else ""
    return f"{self.stage}{self.kind}{self.microbatch}{c}"

  @classmethod
  def parse(cls, text: str) -> Action:
    m = _ACTION_RE.match(text.strip())
    if m is None:
      raise ValueError(f"cannot parse pipeline action {text!r}; expected e.g. '2B5' "
                       "(stage 2, B of microbatch 5) or '0F3.1' (chunk 1)")
    return cls(int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4) or 0))


def vstage_of(S: int, stage: int, chunk: int, placement: str = "modulo") -> int:
  """Virtual stage of (device stage, chunk): modulo `chunk * S + stage`, or the
  V shape of ZB-V (chunk 0 goes down the devices, chunk 1 comes back up)."""
  if placement == "v":
    return stage if chunk == 0 else 2 * S - 1 - stage
  return chunk * S + stage


def place_of(S: int, vs: int, placement: str = "modulo") -> tuple[int, int]:
  """(device stage, chunk) of a virtual stage; inverse of `vstage_of`."""
  if placement == "v":
    return (vs, 0) if vs < S else (2 * S - 1 - vs, 1)
  return vs % S, vs // S


class ScheduleError(ValueError):
  """An invalid pipeline table; the message shows the grid with the bad action marked."""


def deps(a: Action, vstage: int, last: int) -> list[tuple[str, int, int]]:
  """(kind, vstage, microbatch) the compute action `a` (on virtual stage `vstage`
  of `last + 1`) waits for; kind "B" means B or BW."""
  if a.kind == "F":
    return [("F", vstage - 1, a.microbatch)] if vstage > 0 else []
  if a.kind in ("B", "BW"):
    d = [("F", vstage, a.microbatch)]
    return d + ([("B", vstage + 1, a.microbatch)] if vstage < last else [])
  return [("B", vstage, a.microbatch)]  # W
