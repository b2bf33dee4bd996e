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
import re
from collections.abc import Mapping

# Ops that become no kernel (or only bookkeeping): never counted as work.
TRIVIAL_OPS = frozenset(
  {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "opt-barrier",
    "after-all",
    "add-dependency",
    "partition-id",
    "replica-id",
    "iota",
  }
)
COLLECTIVE_OPS = frozenset(
  {
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "collective-broadcast",
    "ragged-all-to-all",
  }
)
CONTROL_OPS = frozenset({"while", "conditional"})
# start op -> done op for the async forms not spelled `<x>-start` / `<x>-done`.
_EXTRA_PAIRS = {"send": "send-done", "recv": "recv-done"}

_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(
  r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s"
  r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$"
)
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CALLS = re.compile(
  r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
  r"=\s*(\{[^}]*\}|%?[\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_STREAM = re.compile(r'_xla_stream_annotation="([^"]*)"')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
# XLA (jax >= 0.11) turns an async collective with nothing between start and
# done into one synchronous op that keeps its pair's name here.
_SCHED_NAME = re.compile(r'scheduling_name="([a-z][a-z-]*?)-start(?:\.\d+)?"')
_NAME = re.compile(r"%?([\w.\-]+)")


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


_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}


def shape_bytes(shape: str) -> int:
  """Bytes of a printed HLO type (`f32[2,3]{1,0}`, or a tuple of them).

  >>> shape_bytes("(f32[2,3]{1,0}, bf16[4]{0}, s32[])")
  36
  """
  total = 0
  for dt, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES.get(dt, 4)
  return total


def _short(items: list[str], n: int) -> str:
  return "[" + ", ".join(items[:n]) + (f", ... +{len(items) - n}" if len(items) > n else "") + "]"


def _split_operands(rest: str) -> tuple[str, str]:
  """`rest` starts right after the op's '(': returns (operand text, attributes text)."""
  depth = 1
  for k, ch in enumerate(rest):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth == 0:
        return rest[:k], rest[k + 1 :]
  return rest, ""


def _operand_names(text: str) -> tuple[str, ...]:
  # Operands print as `%a, %b` (or `f32[2]{0} %a` in newer XLA): take the names.
  names = re.findall(r"%([\w.\-]+)", text)
  if names:
    return tuple(names)
  return tuple(t.strip() for t in text.split(",") if t.strip() and "[" not in t)


def _called(attrs: str) -> tuple[str, ...]:
  out: list[str] = []
  for m in _CALLS.finditer(attrs):
    out.extend(_NAME.findall(m.group(1).strip("{}")))
  for m in _BRANCHES.finditer(attrs):
    out.extend(_NAME.findall(m.group(1)))
  return tuple(out)


@dataclasses.dataclass
class _Raw:
  name: str
  op: str
  target: str
  stream: str | None
  op_name: str
  operands: tuple[str, ...]
  calls: tuple[str, ...]
  shape: str
  sync_of: str = ""


def _read(text: str) -> tuple[dict[str, list[_Raw]], str, bool]:
  comps: dict[str, list[_Raw]] = {}
  cur: list[_Raw] | None = None
  entry = ""
  for line in text.splitlines():
    if cur is None:
      m = _HEADER.match(line)
      if m:
        cur = comps.setdefault(m.group("name"), [])
        if m.group(1):
          entry = m.group("name")
      continue
    if line.startswith("}"):  # XLA >= 0.12 may add `, execution_thread="parallel"`
      cur = None
      continue
    mi = _INSTR.match(line)
    if mi is None:
      continue
    operands, attrs = _split_operands(mi.group("rest"))
    target = _TARGET.search(attrs)
    stream = _STREAM.search(attrs)
    op_name = _OP_NAME.search(attrs)
    sched = _SCHED_NAME.search(attrs)
    sync_of = sched.group(1) if sched and sched.group(1) == mi.group("op") else ""
    cur.append(
      _Raw(
        mi.group("name"),
        mi.group("op"),
        target.group(1) if target else "",
        stream.group(1) if stream else None,
        op_name.group(1) if op_name else "",
        _operand_names(operands),
        _called(attrs),
        mi.group("type").strip(),
        sync_of,
      )
    )
  if not entry and comps:
    entry = list(comps)[-1]  # XLA prints the entry last
  scheduled = bool(re.search(r"^HloModule\b.*\bis_scheduled=true", text, re.M))
  return comps, entry, scheduled


def _target_kind(target: str) -> str:
  t = target.lower()
  if t.startswith("__cudnn$conv") or "convolution" in t:
    return "conv"
  if t.startswith("__cublas$") or "gemm" in t or "matmul" in t:
    return "gemm"
  return "custom-call"


class _Classifier:
  """Kinds per instruction; fusions and custom fusions by what their body computes."""

  def __init__(self, comps: dict[str, list[_Raw]]):
    self.comps = comps
    self._heavy: dict[str, str] = {}

  def body_kind(self, comp: str, _seen=()) -> str:
    """ "conv" / "gemm" if the computation (recursively) holds one, else ""."""
    if comp in self._heavy:
      return self._heavy[comp]
    if comp in _seen:
      return ""
    found = ""
    for r in self.comps.get(comp, ()):
      k = self.kind(r, (*_seen, comp))
      if k in ("conv", "gemm"):
        found = k
        if k == "conv":
          break
      elif r.op in ("fusion", "call") and not found:
        found = next(filter(None, (self.body_kind(c, (*_seen, comp)) for c in r.calls)), "")
    self._heavy[comp] = found
    return found

  def kind(self, r: _Raw, _seen=()) -> str:
    op = r.op
    if op in TRIVIAL_OPS:
      return "trivial"
    if op == "convolution":
      return "conv"
    if op in ("dot", "ragged-dot", "scaled-dot"):
      return "gemm"
    if op == "custom-call":
      k = _target_kind(r.target)
      if k == "custom-call" and r.calls:
        return next(filter(None, (self.body_kind(c, _seen) for c in r.calls)), k)
      return k
    if op == "fusion":
      return next(filter(None, (self.body_kind(c, _seen) for c in r.calls)), "fusion")
    if op in COLLECTIVE_OPS:
      return "collective"
    if op.endswith("-start") or op in _EXTRA_PAIRS:
      return "start"
    if op.endswith("-done") or op == "async-update":
      return "done"
    if op in ("copy", "transpose"):
      return "copy"
    if op == "call":
      return "call"
    if op in CONTROL_OPS:
      return "control"
    return "other"


def _pair_kind(start: _Raw, comps: dict[str, list[_Raw]]) -> str:
  if start.op in _EXTRA_PAIRS:
    return start.op
  base = start.op[: -len("-start")]
  if base != "async":
    return base
  for c in start.calls:  # generic async: the wrapped op (the body's last real op)
    body = [r for r in comps.get(c, ()) if r.op not in TRIVIAL_OPS]
    if body:
      return body[-1].op
  return "async"


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
  raw, entry, scheduled = _read(text)
  cls = _Classifier(raw)
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
      if start.op in _EXTRA_PAIRS and done.op != _EXTRA_PAIRS[start.op]:
        continue
      between = tuple(i for i in seq[j + 1 : k] if i.kind != "trivial")
      kind = _pair_kind(raw[cname][j], raw)
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
