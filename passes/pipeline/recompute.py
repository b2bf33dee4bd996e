"""pipeline.recompute: which of F's residuals B and W recompute instead of reading.

Contract: `choose(jaxpr, f_eqns, free, sinks, kernel_reads, costs) -> Recompute`, read by
`passes.pipeline.flavor`.

F saves every forward value that B or W reads in a per-microbatch record: on
the benchmark model (issue 48) a LayerNorm's centred input twice, its
variance, its rsqrt and its output, and GELU's tanh and its factors, where the
accumulated scan keeps the layer input and lets XLA recompute the rest inside
B's fusions. Each saved value is a record write in F (a fusion output of its
own, often a kernel of its own) and a read in B.

The choice is a minimum cut (as in PyTorch's min-cut rematerialisation
partitioner): each value of F is saved (it costs its bytes, written and read,
and a little per value) or recomputed in the phase that reads it (it costs its
equation's flops over `Costs.balance`, the flops worth one byte moved, and a
kernel launch where a GEMM reads it: it cannot fuse there); matmuls,
loops, random numbers and anything else not cheap are never recomputed. The
flops weights are rough: a transcendental (tanh, exp, rsqrt) counts 20 flops
an element, other arithmetic 1, a reshape or broadcast nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
import numpy as np

from ooojax.passes import _compat

# flops an element, by primitive; only these are ever recomputed
_SHAPE = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims")
_ARITH = (
  "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "square",
  "integer_pow", "select_n", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
  "convert_element_type", "clamp", "floor", "ceil", "round", "one_minus_square", "copy",
)  # fmt: skip
_TRANSCENDENTAL = (
  "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "rsqrt",
  "sqrt", "cbrt", "pow", "erf", "erfc", "erf_inv",
)  # fmt: skip
_REDUCE = ("reduce_sum", "reduce_max", "reduce_min")
FLOPS = {
  **dict.fromkeys(_SHAPE, 0),
  **dict.fromkeys(_ARITH, 1),
  **dict.fromkeys(_TRANSCENDENTAL, 20),
  **dict.fromkeys(_REDUCE, 1),
}
# bytes-equivalent of saving one more value: its own record slice and, in F, often
# an output (a kernel) of its own; a tie-breaker towards fewer, larger values
PER_VALUE = 4096


@dataclasses.dataclass(frozen=True)
class Costs:
  """`balance`: flops worth one byte moved; `launch`: bytes-equivalent of a kernel
  of its own, what a value recomputed for a GEMM (or any equation that is not
  cheap) costs, where one read by cheap equations fuses into their kernel;
  `min_reduce`: a reduction of fewer input elements is never recomputed (it
  would not fuse)."""

  balance: float
  launch: float
  min_reduce: int = 0


# XLA:GPU fuses a LayerNorm's statistics into one (Triton) kernel with the rest of
# its backward only from about 300 elements up (compile-only H100, jax 0.11.2 and
# 0.12: 8 rows of 40 or 16 of 32 fuse, 8 rows of 32 or of 16 do not); below, the
# recomputed statistics are kernels of their own in B and W (RESULTS "Recompute
# where XLA:GPU fuses"), so they are saved instead.
SMALL_REDUCE = 257
# A GPU fuses recomputation into B's kernels (an H100's 67 fp32 TFLOP/s over
# 3.35 TB/s is 20 flops a byte); a kernel launch costs microseconds (2.7 us an
# extra kernel on the H200, RESULTS issue 48), here a conservative 1 MiB's worth.
# A CPU core pays for each flop, and a loop of its own costs little.
GPU = Costs(balance=20.0, launch=float(1 << 20), min_reduce=SMALL_REDUCE)
CPU = Costs(balance=2.0, launch=8192.0)


@dataclasses.dataclass(frozen=True)
class Recompute:
  """`recomputed`: eqn indices (of F) that B and W rerun for the values they read;
  `saved`: the F values the records keep instead (for tests)."""

  recomputed: frozenset
  saved: tuple


def _numel(aval) -> int:
  return math.prod(getattr(aval, "shape", ()))


def _extended(aval) -> bool:
  return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)


def _nbytes(var) -> int:
  aval = var.aval
  # a PRNG key's bytes are its raw data's (it is never recomputed: `_cost`)
  return _numel(aval) * (8 if _extended(aval) else np.dtype(aval.dtype).itemsize)


def _cost(eqn, costs: Costs, own_kernel: bool) -> float | None:
  """Bytes-equivalent of recomputing `eqn`, or None when it is never recomputed."""
  flops = FLOPS.get(eqn.primitive.name)
  if flops is None or eqn.effects or len(eqn.outvars) != 1 or _extended(eqn.outvars[0].aval):
    return None
  n = _numel(eqn.outvars[0].aval)
  if eqn.primitive.name in _REDUCE:
    n = max([_numel(v.aval) for v in eqn.invars], default=n)
    if n < costs.min_reduce:
      return None
  return flops * n / costs.balance + (costs.launch if own_kernel else 0.0)


def cheap(eqn) -> bool:
  """Whether `eqn` is one that a phase may recompute (fuses with its readers)."""
  return eqn.primitive.name in FLOPS


def _is_var(v) -> bool:
  return isinstance(v, _compat.Var) and not isinstance(v, _compat.DropVar)


class _Flow:
  """Dinic's maximum flow on a small graph (nodes 0..n-1), float capacities."""

  def __init__(self, n: int):
    self.adj: list[list[int]] = [[] for _ in range(n)]
    self.to: list[int] = []
    self.cap: list[float] = []

  def edge(self, a: int, b: int, c: float) -> None:
    self.adj[a].append(len(self.to))
    self.to.append(b)
    self.cap.append(c)
    self.adj[b].append(len(self.to))
    self.to.append(a)
    self.cap.append(0.0)

  def _levels(self, s: int) -> list[int]:
    level = [-1] * len(self.adj)
    level[s] = 0
    todo = collections.deque([s])
    while todo:
      a = todo.popleft()
      for e in self.adj[a]:
        if self.cap[e] > 1e-9 and level[self.to[e]] < 0:
          level[self.to[e]] = level[a] + 1
          todo.append(self.to[e])
    return level

  def cut(self, s: int, t: int) -> set:
    """The source side of a minimum s-t cut."""
    while True:
      level = self._levels(s)
      if level[t] < 0:
        return {a for a, lv in enumerate(level) if lv >= 0}
      self._block(s, t, level)

  def _block(self, s: int, t: int, level) -> None:
    """Saturates the level graph, one path at a time (a loop: the paths of a deep
    stage's F are longer than Python's recursion limit)."""
    it = [0] * len(self.adj)
    path: list[int] = []
    a = s
    while True:
      if a == t:
        f = min(self.cap[e] for e in path)  # every path crosses a finite in -> out edge
        for e in path:
          self.cap[e] -= f
          self.cap[e ^ 1] += f
        path, a = [], s
        continue
      while it[a] < len(self.adj[a]):
        e = self.adj[a][it[a]]
        if self.cap[e] > 1e-9 and level[self.to[e]] == level[a] + 1:
          break
        it[a] += 1
      else:  # a dead end: back one edge, past it
        if a == s:
          return
        e = path.pop()
        a = self.to[e ^ 1]
        it[a] += 1
        continue
      path.append(e)
      a = self.to[e]


def choose(jaxpr, f_eqns, free, sinks, kernel_reads, costs: Costs) -> Recompute:
  """Which of F's equations (`f_eqns`, indices into `jaxpr.eqns`) later phases
  rerun. `free`: vars every phase has without a record (the phase's static
  inputs, values of the weights alone); `sinks`: the F values B and W read,
  `kernel_reads` those of them that an equation which is not `cheap` reads (a
  GEMM: recomputed, the value is a kernel of its own). Other vars F reads (the
  received activation) are saved when read."""
  node: dict = {}  # var -> index of its in-node; its out-node is index + 1

  def add(v) -> int:
    if v not in node:
      node[v] = 2 * len(node) + 2
    return node[v]

  defs = {v: k for k in f_eqns for v in jaxpr.eqns[k].outvars if _is_var(v) and v not in free}
  edges, S, T = [], 0, 1
  for v, k in defs.items():
    e, a = jaxpr.eqns[k], add(v)
    ins = [u for u in e.invars if _is_var(u) and u not in free]
    cost = _cost(e, costs, v in kernel_reads)
    for u in ins:
      edges.append((add(u) + 1, a, math.inf))
    edges.append((S, a, math.inf if cost is None else cost))
  for v in list(node):
    if v not in defs:  # read by F, defined outside it (the received activation): kept
      edges.append((S, node[v], math.inf))
  for v, a in node.items():
    edges.append((a, a + 1, 2 * _nbytes(v) + PER_VALUE))
  for v in sinks:
    if v in node:
      edges.append((node[v] + 1, T, math.inf))
  g = _Flow(2 * len(node) + 2)
  for a, b, c in edges:
    g.edge(a, b, c)
  src = g.cut(S, T)
  saved = tuple(v for v, a in node.items() if a in src and a + 1 not in src)
  recomputed = frozenset(defs[v] for v, a in node.items() if a not in src and v in defs)
  return Recompute(recomputed, saved)
