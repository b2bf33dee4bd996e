"""CPU-time measurement that does not depend on where on the stack it runs.

CPython without the gh-142183 fix (March 2026: main, backported to 3.13;
3.11 and 3.12 keep the bug, and this host runs 3.11) keeps Python frames on a
per-thread data stack made of 16 KiB chunks and frees a chunk as
soon as its first frame returns. A hot call that lands exactly on a chunk
boundary therefore mmaps and munmaps 16 KiB on every call. Tracing a model
makes tens of thousands of calls at a few depths, so whether one of them sits
on a boundary depends on how deep the caller already is: lowering the same
48-layer GPT cost 0 to 1.1 s of extra *system* time (up to 170k page
faults) depending only on the caller's stack offset, for `jax.value_and_grad`
as much as for `ooo.value_and_grad` (RESULTS.md, 2026-11-24). One fixed
offset thus favours whichever side happens to miss the boundary.

The remedy is the one for any layout bias: measure each side over a uniform
grid of offsets covering one chunk (`offset_grid`, `at_stack_offset`) and
report user and system time apart (`cpu_times`).
"""

from __future__ import annotations

import functools
import resource
from typing import Any, Callable, NamedTuple

# one data-stack chunk (16 KiB) in pointer-sized slots
CHUNK_SLOTS = 16 * 1024 // 8


class CpuTimes(NamedTuple):
  user: float
  sys: float
  faults: int  # minor page faults

  @property
  def total(self) -> float:
    return self.user + self.sys


def cpu_times(fn: Callable[[], Any]) -> tuple[Any, CpuTimes]:
  """(fn(), this process's user and system CPU seconds and page faults in it)."""
  a = resource.getrusage(resource.RUSAGE_SELF)
  out = fn()
  b = resource.getrusage(resource.RUSAGE_SELF)
  return out, CpuTimes(b.ru_utime - a.ru_utime, b.ru_stime - a.ru_stime, b.ru_minflt - a.ru_minflt)


@functools.cache
def _padding_frame(slots: int) -> Callable:
  # A frame's size on the data stack is its number of local variables (plus a
  # fixed header and its evaluation stack): a function with `slots` locals
  # moves everything it calls `slots` pointers deeper. Generated because the
  # count is data.
  names = [f"_{i}" for i in range(slots)]
  assign = (" = ".join(names) + " = None\n  ") if slots else ""
  ns: dict = {}
  exec(f"def padded(fn):\n  {assign}return fn()\n", ns)  # noqa: S102 - fixed template
  return ns["padded"]


def at_stack_offset(slots: int, fn: Callable[[], Any]) -> Any:
  """fn() called from a frame `slots` pointer-sized slots deeper on the data stack."""
  if slots < 0:
    raise ValueError(f"slots must be >= 0, got {slots}")
  return _padding_frame(slots)(fn)


def offset_grid(n: int) -> list[int]:
  """n stack offsets (slots) spread evenly over one chunk."""
  if n < 1:
    raise ValueError(f"need at least one offset, got {n}")
  return [(i * CHUNK_SLOTS) // n for i in range(n)]
