"""hlo.schedule: read a scheduled, optimized HLO module (`compiled.as_text()`).

Contract: `parse(text) -> HloSchedule`, pure text, no JAX needed; works on
XLA:GPU and XLA:CPU output alike.

In a module printed with `is_scheduled=true` each computation's instruction
order IS its schedule. This pass turns that text into plain frozen data:

* `Instr`: one instruction with a kernel `kind` ("conv", "gemm", "collective",
  "fusion", "custom-call", "copy", "call", "start", "done", "trivial",
  "control", "other") and `is_heavy` (a conv or GEMM kernel);
* `AsyncPair`: one `*-start` / `*-done` pair (stream-annotated `call-start`,
  `all-reduce-start`, `collective-permute-start`, `all-gather-start`,
  `reduce-scatter-start`, generic `async-start`, `copy-start`, `send`/`recv`),
  with what its callee computes and what the schedule runs between start and
  done, in every computation (entry, while bodies, called computations). A
  collective XLA made synchronous (nothing was scheduled inside its pair:
  one `all-reduce(` with `scheduling_name="all-reduce-start"`) is a pair
  whose start is its done (`sync`).

>>> s = parse('''
... ENTRY %main (p: f32[8,8]) -> f32[8,8] {
...   %p = f32[8,8]{1,0} parameter(0)
...   %s = ((f32[8,8]{1,0}), f32[8,8]{1,0}) call-start(%p), to_apply=%w, frontend_attributes={_xla_stream_annotation="1"}
...   %g = f32[8,8]{1,0} custom-call(%p, %p), custom_call_target="__cublas$gemm"
...   ROOT %d = f32[8,8]{1,0} call-done(%s)
... }''')
>>> [(p.kind, p.start.stream, [i.name for i in p.overlapped_heavy]) for p in s.pairs]
[('call', '1', ['g'])]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ooojax.passes.hlo.kinds import (
  COLLECTIVE_OPS,
  CONTROL_OPS,
  EXTRA_PAIRS,
  TRIVIAL_OPS,
  Classifier,
  pair_kind,
)
from ooojax.passes.hlo.text import read, shape_bytes

# re-exported: callers read the op sets and `shape_bytes` from here
__all__ = [
  "COLLECTIVE_OPS",
  "CONTROL_OPS",
  "TRIVIAL_OPS",
  "AsyncPair",
  "HloSchedule",
  "Instr",
  "parse",
  "shape_bytes",
]


@dataclasses.dataclass(frozen=True)
class Instr:
  """One HLO instruction, in scheduled order within its computation."""

  name: str
  op: str  # HLO opcode: "fusion", "custom-call", "call-start", ...
  kind: str  # see the module docstring
  target: str = ""  # custom_call_target, or ""
  is_heavy: bool = False  # a conv or GEMM kernel (kind in {"conv", "gemm"})
  stream: str | None = None  # `_xla_stream_annotation`, when present
  op_name: str = ""  # metadata={op_name="..."}: the JAX name stack
  operands: tuple[str, ...] = ()  # operand instruction names
  calls: tuple[str, ...] = ()  # called computations (calls=, to_apply=, body=...)
  shape: str = ""  # the printed result type
  sync_of: str = ""  # "all-reduce" for a collective XLA made synchronous

  @property
  def label(self) -> str:
    """`name [target]` for custom calls, else `name`."""
    return f"{self.name} [{self.target}]" if self.target else self.name


@dataclasses.dataclass(frozen=True)
class AsyncPair:
  """A `*-start` / `*-done` pair and what the schedule put between them.

  `kind` is "call" for (stream-annotated) async calls, the collective's name
  ("all-reduce", "collective-permute", ...), or for generic `async-start` the
  wrapped op. `between` holds the non-trivial instructions scheduled strictly
  between start and done in `computation`; `overlapped_heavy` the conv/GEMM
  kernels among them (work that can run while the pair is in flight).
  """

  kind: str
  start: Instr
  done: Instr
  computation: str
  callee: tuple[Instr, ...] = ()
  between: tuple[Instr, ...] = ()
  heavy_callee: bool = False
  overlapped_heavy: tuple[Instr, ...] = ()

  @property
  def sync(self) -> bool:
    """XLA made it one synchronous op (start is done): nothing could overlap it."""
    return self.start is self.done

  @property
  def stream(self) -> str | None:
    return self.start.stream

  @property
  def overlapped(self) -> bool:
    """True when some kernel (not only bookkeeping) runs between start and done."""
    return any(i.kind not in ("start", "done") for i in self.between)

  def summary(self) -> str:
    work = [i.label for i in self.between if i.kind not in ("start", "done")]
    body = [i.label for i in self.callee if i.kind != "trivial"]
    stream = f" stream={self.stream}" if self.stream is not None else ""
    heavy = f" heavy={len(self.overlapped_heavy)}" if self.heavy_callee else ""
    return (
      f"{self.start.name:<22} {self.kind}{stream} body={_short(body, 4)} | "
      f"{len(work)} between{heavy}: {_short(work, 6)}"
    )


@dataclasses.dataclass(frozen=True)
class HloSchedule:
  """A parsed scheduled HLO module: computations in order, their async pairs."""

  entry_name: str
  computations: Mapping[str, tuple[Instr, ...]] = dataclasses.field(compare=False)
  pairs: tuple[AsyncPair, ...] = ()
  is_scheduled: bool = False

  @property
  def entry(self) -> tuple[Instr, ...]:
    return self.computations.get(self.entry_name, ())

  def pairs_of(self, kind: str, computation: str | None = None) -> tuple[AsyncPair, ...]:
    """Pairs of one kind ("call", "all-reduce", ...), optionally in one computation."""
    return tuple(
      p
      for p in self.pairs
      if p.kind == kind and (computation is None or p.computation == computation)
    )

  def stream_calls(self) -> tuple[AsyncPair, ...]:
    """Async calls carrying a stream annotation (ooojax's side-stream work)."""
    return tuple(p for p in self.pairs if p.kind == "call" and p.stream is not None)

  def heavy_overlap(self) -> tuple[int, int]:
    """(k, n): n stream-annotated calls whose callee holds a conv/GEMM, k of them
    with a conv/GEMM kernel scheduled between start and done."""
    heavy = [p for p in self.stream_calls() if p.heavy_callee]
    return sum(bool(p.overlapped_heavy) for p in heavy), len(heavy)

  def find(self, name: str, computation: str | None = None) -> Instr:
    comps = [computation] if computation else [self.entry_name, *self.computations]
    for c in comps:
      for i in self.computations.get(c, ()):
        if i.name == name:
          return i
    raise KeyError(f"no instruction named {name!r}")

  def reachable(self, roots) -> tuple[str, ...]:
    """`roots` and every computation they call, transitively, in first-seen order."""
    seen: dict[str, None] = {}
    todo = list(roots)
    while todo:
      c = todo.pop(0)
      if c in seen or c not in self.computations:
        continue
      seen[c] = None
      todo += [x for i in self.computations[c] for x in i.calls]
    return tuple(seen)

  def loop_bodies(self) -> tuple[str, ...]:
    """Computations that run once per iteration of a while loop (bodies, what they call)."""
    bodies = [
      i.calls[-1] for c in self.computations.values() for i in c if i.op == "while" and i.calls
    ]
    return self.reachable(bodies)

  def copies(self, computations=None) -> tuple[Instr, ...]:
    """The `copy` / `copy-start` instructions of `computations` (default: all)."""
    names = self.computations if computations is None else computations
    return tuple(
      i for c in names for i in self.computations.get(c, ()) if i.op in ("copy", "copy-start")
    )

  def summary(self) -> str:
    """One line per async pair: callee kernels and what runs between start and done."""
    kinds: dict[str, int] = {}
    for i in self.entry:
      kinds[i.kind] = kinds.get(i.kind, 0) + 1
    head = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()) if k != "trivial")
    lines = [
      f"entry {self.entry_name}: {len(self.entry)} instrs ({head}); {len(self.pairs)} async pairs"
    ]
    for p in self.pairs:
      where = "" if p.computation == self.entry_name else f" (in {p.computation})"
      lines.append(f"  {p.summary()}{where}")
    k, n = self.heavy_overlap()
    if n:
      lines.append(f"heavy dW calls overlapped: {k} / {n}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.summary()


def _short(items: list[str], n: int) -> str:
  return "[" + ", ".join(items[:n]) + (f", ... +{len(items) - n}" if len(items) > n else "") + "]"


def parse(text: str) -> HloSchedule:
  """Parses `compiled.as_text()` into an `HloSchedule`.

  Args:
    text: optimized HLO text; with `is_scheduled=true` the printed order of
      each computation is its schedule.

  Returns:
    The computations as tuples of `Instr` and every async pair.

  >>> s = parse("ENTRY %e (a: f32[2]) -> f32[2] {\\n  ROOT %a = f32[2]{0} parameter(0)\\n}")
  >>> s.entry_name, [i.kind for i in s.entry]
  ('e', ['trivial'])
  """
  raw, entry, scheduled = read(text)
  cls = Classifier(raw)
  comps: dict[str, tuple[Instr, ...]] = {}
  for cname, rs in raw.items():
    out = []
    for r in rs:
      k = cls.kind(r)
      out.append(
        Instr(
          r.name,
          r.op,
          k,
          r.target,
          k in ("conv", "gemm"),
          r.stream,
          r.op_name,
          r.operands,
          r.calls,
          r.shape,
          r.sync_of,
        )
      )
    comps[cname] = tuple(out)

  def holds_heavy(names) -> bool:
    return any(cls.body_kind(c) for c in names)

  pairs = []
  for cname, seq in comps.items():
    index = {i.name: k for k, i in enumerate(seq)}
    for k, done in enumerate(seq):
      if done.sync_of:  # a pair XLA made synchronous: start and done in one op
        pairs.append(((cname != entry, k), AsyncPair(done.sync_of, done, done, cname)))
        continue
      if done.kind != "done" or done.op == "async-update" or not done.operands:
        continue
      j = index.get(done.operands[0])
      if j is None or j >= k or seq[j].kind != "start":
        continue
      start = seq[j]
      if start.op in EXTRA_PAIRS and done.op != EXTRA_PAIRS[start.op]:
        continue
      between = tuple(i for i in seq[j + 1 : k] if i.kind != "trivial")
      kind = pair_kind(raw[cname][j], raw)
      # A collective's to_apply is its reducer, not work it runs.
      callee = (
        tuple(x for c in start.calls for x in comps.get(c, ()))
        if kind == "call" or start.op == "async-start"
        else ()
      )
      heavy = holds_heavy(start.calls) if kind == "call" else False
      pairs.append(
        (
          (cname != entry, j),
          AsyncPair(
            kind,
            start,
            done,
            cname,
            callee,
            between,
            heavy,
            tuple(i for i in between if i.is_heavy),
          ),
        )
      )
  # Entry pairs first (the step's own schedule), each computation's by start.
  pairs.sort(key=lambda kp: kp[0])
  return HloSchedule(entry, comps, tuple(p for _, p in pairs), scheduled)
