"""hlo.text: the printed HLO module read into raw per-instruction records.

Contract: `read(text) -> (computations, entry name, is_scheduled)`, each
computation a list of `Raw` in printed (for a scheduled module: scheduled)
order; pure text, no JAX. `shape_bytes` sizes a printed type. The kinds and
async pairs on top of these records are `hlo.kinds` and `hlo.schedule`.
"""

from __future__ import annotations

import dataclasses
import re

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
class Raw:
  """One instruction as printed, before it is classified."""

  name: str
  op: str
  target: str
  stream: str | None
  op_name: str
  operands: tuple[str, ...]
  calls: tuple[str, ...]
  shape: str
  sync_of: str = ""


def read(text: str) -> tuple[dict[str, list[Raw]], str, bool]:
  comps: dict[str, list[Raw]] = {}
  cur: list[Raw] | None = None
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
      Raw(
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
