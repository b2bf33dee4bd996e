"""hlo.kernels: the kernels a compiled XLA:GPU step launches, and the bytes they write.

Contract: `kernels(hlo) -> Kernels`, pure data from a parsed `HloSchedule`.

One instruction of an executed computation (the entry, and what it runs
through `call`, `call-start`, `async-start`, `while` and `conditional`, never
a fusion's body) is one kernel unless it is bookkeeping (parameters, tuples,
bitcasts, barriers, async starts and dones). The conv/GEMM kernels (cuDNN,
cuBLAS) are kept by their result type; the rest are counted with the bytes
they write (their result's size). A loop body counts once, not per iteration.

`compare(a, b)` sets two programs side by side (issue 50's kernel parity: a
two-stream step against `jax.grad`).

>>> from ooojax.passes.hlo.schedule import parse
>>> k = kernels(parse('''
... ENTRY %e (p: f32[8,8]) -> f32[8,8] {
...   %p = f32[8,8]{1,0} parameter(0)
...   %s = ((f32[8,8]{1,0}), f32[8,8]{1,0}) call-start(%p), to_apply=%w
...   %g = (f32[8,8]{1,0}, s8[64]{0}) custom-call(%p, %p), custom_call_target="__cublas$gemm"
...   %d = f32[8,8]{1,0} call-done(%s)
...   ROOT %f = f32[8,8]{1,0} fusion(%d, %g), kind=kLoop, calls=%add
... }
... %w (a: f32[8,8]) -> f32[8,8] {
...   %a = f32[8,8]{1,0} parameter(0)
...   ROOT %c = f32[8,8]{1,0} copy(%a)
... }'''))
>>> k.n, k.n_heavy, [i.op for i in k.other], k.other_bytes
(3, 1, ['fusion', 'copy'], 512)
"""

from __future__ import annotations

import collections
import dataclasses
import re

from ooojax.passes.hlo.schedule import HloSchedule, Instr, shape_bytes

# Ops through which a computation's instructions run as kernels of their own.
_RUNS = frozenset({"call", "call-start", "async-start", "while", "conditional"})
_NOT_KERNELS = frozenset({"trivial", "start", "done", "call", "control"})
_WORKSPACE = re.compile(r",?\s*u8\[\d+\]\{0\}")


def _heavy_key(i: Instr) -> str:
  # a conv's result is (output, u8 workspace): the workspace size is a heuristic's
  return f"{i.kind} {_WORKSPACE.sub('', i.shape)}"


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The kernels of one compiled program.

  heavy: conv/GEMM kernels by `kind result-type`, with counts.
  other: every other kernel (fusions, copies, transposes, custom calls), in
    schedule order.
  """

  heavy: collections.Counter
  other: tuple[Instr, ...]

  @property
  def n_heavy(self) -> int:
    return sum(self.heavy.values())

  @property
  def n(self) -> int:
    """All kernels."""
    return self.n_heavy + len(self.other)

  @property
  def other_bytes(self) -> int:
    """Bytes the non-conv/GEMM kernels write."""
    return sum(shape_bytes(i.shape) for i in self.other)

  def by_op(self) -> dict[str, int]:
    """Other kernels per opcode (`fusion`, `copy`, `transpose`, ...)."""
    return dict(collections.Counter(i.op for i in self.other))


def kernels(hlo: HloSchedule) -> Kernels:
  """Kernels of every computation the entry runs (see the module docstring)."""
  heavy: collections.Counter = collections.Counter()
  other: list[Instr] = []
  seen: set[str] = set()
  todo = [hlo.entry_name]
  while todo:
    c = todo.pop(0)
    if c in seen:
      continue
    seen.add(c)
    for i in hlo.computations.get(c, ()):
      if i.op in _RUNS:
        todo += list(i.calls)
      if i.kind in _NOT_KERNELS:
        continue
      if i.is_heavy:
        heavy[_heavy_key(i)] += 1
      else:
        other.append(i)
  return Kernels(heavy, tuple(other))


@dataclasses.dataclass(frozen=True)
class Parity:
  """Program `got` against `want` (e.g. a two-stream step against jax.grad)."""

  got: Kernels
  want: Kernels

  @property
  def same_heavy(self) -> bool:
    return self.got.heavy == self.want.heavy

  @property
  def extra_kernels(self) -> int:
    return self.got.n - self.want.n

  @property
  def kernel_ratio(self) -> float:
    return self.got.n / max(self.want.n, 1)

  @property
  def bytes_ratio(self) -> float:
    return self.got.other_bytes / max(self.want.other_bytes, 1)

  def summary(self) -> str:
    ops = collections.Counter(self.got.by_op())
    ops.subtract(self.want.by_op())
    extra = ", ".join(f"{k} {v:+d}" for k, v in sorted(ops.items()) if v)
    heavy = "same conv/GEMM kernels" if self.same_heavy else "DIFFERENT conv/GEMM kernels"
    return (
      f"{heavy} ({self.got.n_heavy} vs {self.want.n_heavy}); kernels {self.got.n} vs "
      f"{self.want.n} ({self.kernel_ratio - 1:+.1%}: {extra or 'none'}); other kernels write "
      f"{self.got.other_bytes / 1e6:.1f} MB vs {self.want.other_bytes / 1e6:.1f} MB "
      f"({self.bytes_ratio - 1:+.1%})"
    )


def compare(got: HloSchedule, want: HloSchedule) -> Parity:
  return Parity(kernels(got), kernels(want))
