"""hlo.kinds: what kind of kernel an HLO instruction is, and what an async pair runs.

Contract: `Classifier(computations).kind(raw)` -> "conv", "gemm", "collective",
"fusion", "custom-call", "copy", "call", "start", "done", "trivial", "control"
or "other" (fusions and custom fusions by what their body computes);
`pair_kind(start, computations)` names the work of a `*-start` op. Pure text.
"""

from __future__ import annotations

from ooojax.passes.hlo.text import Raw

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
EXTRA_PAIRS = {"send": "send-done", "recv": "recv-done"}


def _target_kind(target: str) -> str:
  t = target.lower()
  if t.startswith("__cudnn$conv") or "convolution" in t:
    return "conv"
  if t.startswith("__cublas$") or "gemm" in t or "matmul" in t:
    return "gemm"
  return "custom-call"


class Classifier:
  """Kinds per instruction; fusions and custom fusions by what their body computes."""

  def __init__(self, comps: dict[str, list[Raw]]):
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

  def kind(self, r: Raw, _seen=()) -> str:
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
    if op.endswith("-start") or op in EXTRA_PAIRS:
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


def pair_kind(start: Raw, comps: dict[str, list[Raw]]) -> str:
  if start.op in EXTRA_PAIRS:
    return start.op
  base = start.op[: -len("-start")]
  if base != "async":
    return base
  for c in start.calls:  # generic async: the wrapped op (the body's last real op)
    body = [r for r in comps.get(c, ()) if r.op not in TRIVIAL_OPS]
    if body:
      return body[-1].op
  return "async"
