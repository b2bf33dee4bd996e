"""pipeline.actions: the pipeline action IR, shared by every pipeline pass.

An `Action` is `(stage, kind, microbatch, chunk, step)`, hashable, with a text
form that round-trips (`2B5`, `0F3.1`, `1W7@2`: step 2 of a multi-step table);
kinds are compute (F, B, W, the fused BW), the optimizer update U of one
(stage, chunk) after its step's last W (`0U@1`, `0U.1`: no microbatch), or
transfers (SF/RF: send/receive an activation, SB/RB: an input gradient).
`deps` is the one rule of what a compute or update action waits for.
"""

from __future__ import annotations

import dataclasses
import re

COMPUTE = ("F", "B", "W", "BW")
UPDATE = "U"
COMMS = ("SF", "RF", "SB", "RB")
_ACTION_RE = re.compile(r"^(\d+)(BW|SF|RF|SB|RB|F|B|W|U)(\d*)(?:\.(\d+))?(?:@(\d+))?$")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
  """One action of one stage: `kind` of `microbatch` for virtual-stage `chunk`,
  in training step `step` (0 but in a table tiled over several steps)."""

  stage: int
  kind: str
  microbatch: int
  chunk: int = 0
  step: int = 0

  def __str__(self) -> str:
    m = "" if self.kind == UPDATE else str(self.microbatch)
    c = f".{self.chunk}" if self.chunk else ""
    t = f"@{self.step}" if self.step else ""
    return f"{self.stage}{self.kind}{m}{c}{t}"

  @classmethod
  def parse(cls, text: str) -> Action:
    m = _ACTION_RE.match(text.strip())
    if m is None or (m.group(3) == "") != (m.group(2) == UPDATE):
      raise ValueError(
        f"cannot parse pipeline action {text!r}; expected e.g. '2B5' "
        "(stage 2, B of microbatch 5), '0F3.1' (chunk 1), '1W7@2' (step 2) "
        "or '0U@1' (stage 0's optimizer update after step 1)"
      )
    return cls(
      int(m.group(1)), m.group(2), int(m.group(3) or 0), int(m.group(4) or 0), int(m.group(5) or 0)
    )


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


def deps(
  a: Action, vstage: int, last: int, microbatches: int = 0
) -> list[tuple[str, int, int, int]]:
  """(kind, vstage, microbatch, step) the action `a` (on virtual stage `vstage`
  of `last + 1`) waits for; kind "B" means B or BW, "W" means W or BW.

  Across steps: F of step t > 0 waits for its virtual stage's update U of step
  t - 1 (the weights it reads), and U waits for every W of its virtual stage
  in its step (`microbatches` of them) -- per stage, never a global barrier.
  """
  t = a.step
  if a.kind == "F":
    d = [("F", vstage - 1, a.microbatch, t)] if vstage > 0 else []
    return d + ([(UPDATE, vstage, 0, t - 1)] if t > 0 else [])
  if a.kind in ("B", "BW"):
    d = [("F", vstage, a.microbatch, t)]
    return d + ([("B", vstage + 1, a.microbatch, t)] if vstage < last else [])
  if a.kind == UPDATE:
    return [("W", vstage, m, t) for m in range(microbatches)]
  return [("B", vstage, a.microbatch, t)]  # W


def done(a: Action, vstage: int) -> list[tuple[str, int, int, int]]:
  """The keys of `deps` that `a` (on virtual stage `vstage`) satisfies when it
  ends: a fused BW is both B and W; an update is its stage's step."""
  if a.kind == UPDATE:
    return [(UPDATE, vstage, 0, a.step)]
  if a.kind == "BW":
    return [("B", vstage, a.microbatch, a.step), ("W", vstage, a.microbatch, a.step)]
  return [(a.kind, vstage, a.microbatch, a.step)]
