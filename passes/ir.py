"""Plain data passed between the passes: split -> cost -> schedule -> emit.

Everything here is a frozen dataclass or an enum. A `Schedule` is a tuple of
small hashable `Action`s per stream with a text form (`X3@0`, `W12@1`) that
round-trips, so schedules can be printed, diffed, saved and loaded.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any


class Kind(enum.Enum):
  """What an equation of the combined forward+backward jaxpr computes."""

  FORWARD = "F"  # does not depend on the loss cotangent
  DX = "X"  # backward, reaches >= 2 parameter gradients: the critical path
  DW = "W"  # backward, reaches exactly one parameter gradient: may run out of order
  DEAD = "D"  # backward, reaches no gradient (e.g. the input's cotangent): dropped


@dataclasses.dataclass(frozen=True)
class Cluster:
  """The dW equations of one parameter leaf."""

  index: int
  param: str  # the leaf's path, e.g. "['params']['Dense_0']['kernel']"
  grad_out: int  # position of its gradient among the jaxpr outputs
  eqns: tuple[int, ...]  # equation indices, in original order


@dataclasses.dataclass(frozen=True)
class Split:
  """Result of `passes.split`: one flat jaxpr with every equation classified.

  `jaxpr.jaxpr.invars` are `(ct, *const_inputs, *dynamic_leaves)`; outputs are
  `(value, *aux_leaves, *grad_leaves)`, the grads starting at `grad_out_start`.
  """

  jaxpr: Any  # ClosedJaxpr (consts are always empty)
  consts: tuple[Any, ...]  # values for the const inputs (may be tracers)
  kinds: tuple[Kind, ...]  # per equation
  cluster_of: tuple[int, ...]  # per equation: cluster index, or -1
  clusters: tuple[Cluster, ...]
  grad_out_start: int
  inlined: int  # call-like equations inlined
  opaque: tuple[str, ...]  # primitives kept whole (e.g. scan, while)
  loops_split: int = 0  # backward scans split into B-scan + W-scans

  def count(self, kind: Kind) -> int:
    return sum(k is kind for k in self.kinds)


class UnitKind(enum.Enum):
  FORWARD = "F"
  DX = "X"
  DW = "W"
  SEND = "S"  # a transfer on a network link (collectives, pipeline sends)


@dataclasses.dataclass(frozen=True)
class Unit:
  """A schedulable group of equations: the forward, a dX segment, or a dW cluster."""

  kind: UnitKind
  index: int
  eqns: tuple[int, ...]
  deps: tuple[str, ...]  # names of units that must finish first
  cost: float = dataclasses.field(default=0.0, compare=False)  # seconds, estimated
  util: float = dataclasses.field(default=1.0, compare=False)  # device share alone
  label: str = dataclasses.field(default="", compare=False)

  @property
  def name(self) -> str:
    return f"{self.kind.value}{self.index}"


_ACTION_RE = re.compile(r"^([FXWS])(\d+)@(\d+)$")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
  """Run unit `kind``index` on `stream`. Text form: `W3@1`."""

  kind: str
  index: int
  stream: int

  @property
  def unit(self) -> str:
    return f"{self.kind}{self.index}"

  def __str__(self) -> str:
    return f"{self.unit}@{self.stream}"

  @classmethod
  def parse(cls, text: str) -> Action:
    m = _ACTION_RE.match(text.strip())
    if m is None:
      raise ValueError(f"cannot parse action {text!r}; expected e.g. 'W3@1'")
    return cls(m.group(1), int(m.group(2)), int(m.group(3)))


@dataclasses.dataclass(frozen=True)
class Call:
  """One asynchronous call on a side stream and the window XLA must leave it.

  The window is set by data: the call's inputs are pinned before main-stream
  unit `after` hands its result on (the start goes early), and its outputs are
  tied to the output of main-stream equation `anchor` (the done goes late), so
  the main-stream work in between runs beside the call. `anchor` is an
  equation index of the split jaxpr, or -1 for no anchor. `wait` names the
  units of an earlier call whose done this call's start follows (its inputs
  are tied to that call's outputs): XLA:GPU's latency-hiding scheduler keeps
  at most two such calls in flight (jax >= 0.12), so the plan never asks for
  more (`passes.slots`). Side units issued after the same main unit share one
  call, so one cross-stream sync covers them all.
  """

  units: tuple[str, ...]  # side-stream units, in order
  stream: int
  after: str  # the main-stream unit the call is issued after
  anchor: int = -1  # main-stream equation the done waits for
  wait: tuple[str, ...] = ()  # units of the call whose done the start waits for

  def __str__(self) -> str:
    wait = f" once {'+'.join(self.wait)} is done" if self.wait else ""
    return (
      f"call({' '.join(self.units)})@{self.stream} after {self.after}{wait} until e{self.anchor}"
    )


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Ordered work per stream plus the cross-stream waits.

  `syncs` holds `(before, after)` unit-name pairs whose units sit on different
  streams: `after` may not start until `before` has finished. `calls` groups
  the side-stream units into asynchronous calls with their windows (see
  `Call`). Makespans are cost-model estimates in seconds, never measurements.
  """

  streams: tuple[tuple[Action, ...], ...]
  syncs: tuple[tuple[str, str], ...]
  units: tuple[Unit, ...] = dataclasses.field(compare=False)
  makespan: float = dataclasses.field(default=0.0, compare=False)
  in_order_makespan: float = dataclasses.field(default=0.0, compare=False)
  device: str = dataclasses.field(default="", compare=False)
  calls: tuple[Call, ...] = dataclasses.field(default=(), compare=False)
  # (dW unit, why it stays on stream 0) for clusters the GPU rules keep there
  kept: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False)

  @property
  def predicted_speedup(self) -> float:
    return self.in_order_makespan / self.makespan if self.makespan else 1.0

  def unit(self, name: str) -> Unit:
    return _unit_index(self.units)[name]

  def to_text(self) -> str:
    return "\n".join(" ".join(str(a) for a in s) for s in self.streams)

  @staticmethod
  def parse_streams(text: str) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(Action.parse(t) for t in line.split()) for line in text.strip().splitlines())


def _unit_index(units) -> dict[str, Unit]:
  return {u.name: u for u in units}
