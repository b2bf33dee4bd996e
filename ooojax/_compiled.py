"""`Report.compiled(gpu=...)`: the explained function compiled for a compile-only GPU.

Compiles the same `ooo.grad` the report describes with `ooojax.gpu_hlo`, then
`passes.hlo.compare` puts each dW unit's predicted stream and overlap beside
what XLA scheduled; `plot_compiled` draws XLA's instruction order as a lane
of kernels with the stream-call windows on a second lane.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ooojax.passes.hlo import compare as hlo_compare


@dataclasses.dataclass(frozen=True)
class Call:
  """What `explain` was called with, kept to compile the same gradient again."""

  fun: Any
  args: tuple
  argnums: Any
  has_aux: bool
  options: dict
  kwargs: dict


def _is_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def compile_report(
  report, gpu: str = "H100", *, devices: int = 1, compiler_options=None
) -> hlo_compare.Comparison:
  from ooojax import gpu_hlo
  from ooojax._api import grad

  call: Call | None = report.call
  if call is None:
    raise ValueError(
      "this Report was not made by ooo.explain(fun, *args, ...), so there "
      "is no function to compile; use ooo.explain"
    )
  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    raise RuntimeError(f"cannot compile for a GPU here: {reason}")
  opts = dict(call.options)
  opts.setdefault("mode", report.mode)
  g = grad(call.fun, call.argnums, call.has_aux, **opts)
  # Only arrays become compile arguments; other leaves stay static, as in the report.
  leaves, tree = jax.tree_util.tree_flatten(call.args)
  dyn = [i for i, x in enumerate(leaves) if _is_array(x)]

  def f(*dyn_vals):
    vals = list(leaves)
    for i, v in zip(dyn, dyn_vals):
      vals[i] = v
    return g(*jax.tree_util.tree_unflatten(tree, vals), **call.kwargs)

  try:
    hlo = gpu_hlo.schedule(
      f, *[leaves[i] for i in dyn], gpu=gpu, devices=devices, compiler_options=compiler_options
    )
  except Exception as e:
    if "control_dep" in str(e):
      raise RuntimeError(
        f"the {gpu} compile failed on ordering='control_deps' (XLA:GPU has no "
        "control-dep-rewriter): pass ordering='none' or "
        "'scheduling_group' to ooo.explain"
      ) from e
    raise
  return hlo_compare.compare(report.schedule, report.timeline(), hlo, gpu)


_COLORS = {"F": "#9e9e9e", "X": "#d62728", "W": "#1f77b4", "S": "#2ca02c"}


def plot_compiled(comparison: hlo_compare.Comparison, ax):
  """XLA's entry schedule as slots: kernels on lane 0 (coloured by unit), stream
  calls on lane 1 spanning start..done. Order only: XLA gives no timings here."""
  hlo = comparison.hlo
  seq = [i for i in hlo.entry if i.kind != "trivial"]
  pos: dict[str, int] = {}
  slot = 0
  for i in seq:
    pos[i.name] = slot
    if i.kind not in ("start", "done"):
      slot += 1
  for i in seq:
    if i.kind in ("start", "done"):
      continue
    u = hlo_compare.unit_of(i) or "?"
    ax.barh(
      0,
      1,
      left=pos[i.name],
      height=0.8,
      color=_COLORS.get(u[0], "#dddddd"),
      edgecolor="black" if i.is_heavy else "white",
      linewidth=0.6 if i.is_heavy else 0.2,
    )
  # Windows that overlap each other go on separate rows of the calls lane.
  rows: list[int] = []  # per row: the slot where its last window ends
  windows = []
  for p in hlo.pairs:
    if p.computation != hlo.entry_name or p.kind != "call":
      continue
    a, b = pos[p.start.name], max(pos[p.done.name], pos[p.start.name] + 0.3)
    r = next((k for k, end in enumerate(rows) if end <= a), len(rows))
    if r == len(rows):
      rows.append(b)
    rows[r] = b
    windows.append((p, a, b, r))
  h = 0.8 / max(len(rows), 1)
  for p, a, b, r in windows:
    u = hlo_compare.unit_of(p.start) or "?"
    ax.barh(
      0.6 + (r + 0.5) * h,
      b - a,
      left=a,
      height=h * 0.9,
      color=_COLORS.get(u[0], "#dddddd"),
      edgecolor="black" if p.heavy_callee else "white",
      linewidth=0.6,
    )
  ax.set_yticks([0, 1])
  ax.set_yticklabels(["main stream", "stream calls"])
  ax.invert_yaxis()
  k, n = comparison.heavy_overlap
  ax.set_xlabel("kernel slot in XLA's schedule (order, not time)")
  ax.set_title(
    f"what XLA actually scheduled ({comparison.gpu}, compile-only): heavy dW "
    f"calls overlapped {k}/{n}; black edge = conv/GEMM",
    fontsize=9,
  )
  return ax
