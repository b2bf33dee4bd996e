"""hlo.windows: what XLA scheduled inside each collective's start..done window.

Contract: `windows(hlo, kind) -> tuple[Window, ...]`, pure data over a parsed
`HloSchedule`, no JAX needed.

A collective overlaps compute only when the schedule puts kernels between its
start and its done. A kernel may sit there directly (a GEMM) or inside a
called computation: a pipeline tick's action switch is one `conditional`
whose branches hold that tick's GEMMs, so the window counts it as compute
(`compute`) although `AsyncPair.overlapped_heavy` sees no GEMM at its level.

>>> from ooojax.passes.hlo.schedule import parse
>>> s = parse('''
... ENTRY %main (p: f32[8,8]) -> f32[8,8] {
...   %p = f32[8,8]{1,0} parameter(0)
...   %s = f32[8,8]{1,0} all-reduce-start(%p), to_apply=%add
...   %g = f32[8,8]{1,0} custom-call(%p, %p), custom_call_target="__cublas$gemm"
...   ROOT %d = f32[8,8]{1,0} all-reduce-done(%s)
... }''')
>>> [(w.name, w.compute, w.kernels) for w in windows(s, "all-reduce")]
[('s', ('g',), 1)]
"""

from __future__ import annotations

import dataclasses

from ooojax.passes.hlo.schedule import HloSchedule, shape_bytes


@dataclasses.dataclass(frozen=True)
class Window:
  """One collective and the work scheduled while it is in flight."""

  name: str  # the start instruction (the done for a synchronous one)
  kind: str  # "all-reduce", "collective-permute", ...
  computation: str  # where it is scheduled
  in_loop: bool  # inside a while body (a pipeline tick), not the entry
  nbytes: int  # bytes of the done's result (what arrives)
  kernels: int  # non-trivial instructions between start and done
  compute: tuple[str, ...]  # those that are or call a conv/GEMM kernel
  sync: bool = False  # XLA made it one synchronous op: nothing can overlap

  @property
  def overlapped(self) -> bool:
    """True when conv/GEMM work runs while the collective is in flight."""
    return bool(self.compute)

  def summary(self) -> str:
    where = " (tick loop)" if self.in_loop else ""
    if self.sync:
      return f"{self.name:<28} {self.kind}{where}: synchronous, nothing inside"
    shown = ", ".join(self.compute[:4]) + (" ..." if len(self.compute) > 4 else "")
    return (
      f"{self.name:<28} {self.kind}{where} {self.nbytes} B: {self.kernels} ops inside, "
      f"{len(self.compute)} with conv/GEMM work" + (f" [{shown}]" if shown else "")
    )


def _holds_heavy(hlo: HloSchedule, comps) -> bool:
  return any(i.is_heavy for c in hlo.reachable(comps) for i in hlo.computations[c])


def windows(hlo: HloSchedule, kind: str) -> tuple[Window, ...]:
  """The `kind` async pairs of `hlo` ("all-reduce", "collective-permute", ...), each
  with the work inside its window; entry pairs first, as `hlo.pairs` orders them."""
  loop = set(hlo.loop_bodies())
  out = []
  for p in hlo.pairs_of(kind):
    compute = tuple(
      i.name for i in p.between if i.is_heavy or (i.calls and _holds_heavy(hlo, i.calls))
    )
    out.append(
      Window(
        p.start.name,
        p.kind,
        p.computation,
        p.computation in loop,
        shape_bytes(p.done.shape),
        sum(i.kind not in ("start", "done") for i in p.between),
        compute,
        p.sync,
      )
    )
  return tuple(out)
