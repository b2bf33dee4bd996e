"""ooojax's data-parallel step next to XLA's own, both compiled and replayed per link.

`DataParallelReport.versus_xla()` compiles the explained gradient twice for
`n` compile-only GPUs: ooojax's (`report.compiled()`: its buckets and
first-k under `shard_map`) and XLA's own (plain `jax.jit(jax.grad(fun))`
with the batch sharded over the axis: GSPMD inserts the reduction, XLA's
combiner sizes it and its latency-hiding scheduler places it). Each compiled
schedule is replayed on each link (`passes.hlo.replay`: the cost model on the
compute stream, ring costs on the link), giving step, exposed communication
and the number of reductions, next to the compiled temp memory. Where XLA's
step is shorter the report says so: step aside, use plain `jax.grad` there.
Everything is a model of the compiled programs, never a timing.
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any

from ooojax.passes.cost import get_spec
from ooojax.passes.hlo.replay import Replay, replay

LINKS = ("nvlink", "IB400", "IB100", "25GbE")
# ooojax must beat XLA's step by this share to be worth its extra reductions.
TIE = 0.02


@dataclasses.dataclass(frozen=True)
class LinkRow:
  """One link: ooojax's replayed step and XLA's."""

  link: str
  ooo: Replay
  xla: Replay
  bucket_bytes: int = 0  # the bucket size of the `ooo` program replayed here

  @property
  def speedup(self) -> float:
    """XLA's step over ooojax's (> 1: ooojax is faster)."""
    return self.xla.step / self.ooo.step if self.ooo.step else 1.0

  @property
  def verdict(self) -> str:
    if self.speedup >= 1 + TIE:
      return "ooojax"
    if self.speedup <= 1 - TIE:
      return "XLA (step aside: plain jax.grad under jax.jit)"
    return "tie (plain jax.grad is as good)"


@dataclasses.dataclass(frozen=True)
class VersusXla:
  """`rows` per link; compiled temp memory of both programs."""

  gpu: str
  devices: int
  rows: tuple[LinkRow, ...]
  ooo_temp: int  # the plan's program
  xla_temp: int
  buckets: tuple[int, ...] = ()  # bucket sizes compiled beside the plan's
  texts: Any = dataclasses.field(default=None, compare=False, repr=False)  # (ooo, xla) HLO

  def best(self, link: str) -> str:
    """ "ooojax" or "XLA" for `link` (a tie goes to XLA: fewer moving parts)."""
    row = next(r for r in self.rows if r.link.lower() == link.lower())
    return "ooojax" if row.verdict == "ooojax" else "XLA"

  def summary(self) -> str:
    lines = [
      f"ooojax vs XLA's own data parallel (plain jax.jit of jax.grad, GSPMD), compiled for "
      f"{self.gpu} x{self.devices} (compile-only), replayed per link (not timed):",
      f"  temp memory per device: ooojax {self.ooo_temp / 1e6:.1f} MB, XLA "
      f"{self.xla_temp / 1e6:.1f} MB",
      f"  {'link':<8} {'ooojax step (exposed) ms':>26} {'XLA step (exposed) ms':>24} "
      f"{'XLA/ooo':>8} {'reductions ooo/XLA':>19}  faster",
    ]
    if self.buckets:
      lines.insert(
        2,
        "  ooojax's bucket size chosen per link on the compiled programs: "
        + ", ".join(f"{r.link} {r.bucket_bytes} B" for r in self.rows),
      )
    for r in self.rows:
      o, x = r.ooo, r.xla
      lines.append(
        f"  {r.link:<8} {o.step * 1e3:>15.3f} ({o.exposed * 1e3:7.3f}) "
        f"{x.step * 1e3:>13.3f} ({x.exposed * 1e3:7.3f}) {r.speedup:>7.2f}x "
        f"{o.reductions:>9} / {x.reductions:<7}  {r.verdict}"
      )
    return "\n".join(lines)

  def __repr__(self) -> str:
    return self.summary()

  def _repr_html_(self) -> str:
    return f"<pre>{html.escape(self.summary())}</pre>"


def versus_xla(
  report, gpu: str = "H100", links=None, batch_argnums=None, compiler_options=None, buckets=()
) -> VersusXla:
  """`DataParallelReport.versus_xla`: see the module docstring."""
  from ooojax.data_parallel._compile import compile_dp, compile_xla

  plan_bb = report.plan.bucket_bytes
  # the plan's bucket size first: a tie keeps it
  more = [int(b) for b in dict.fromkeys(buckets) if int(b) != plan_bb]
  if any(b <= 0 for b in more):
    raise ValueError(f"buckets must be positive byte counts, got {tuple(buckets)!r}")
  ours = report.compiled(gpu, batch_argnums=batch_argnums, compiler_options=compiler_options)
  others = [
    (b, compile_dp(report, gpu, batch_argnums, compiler_options, bucket_bytes=b)) for b in more
  ]
  theirs = compile_xla(report, gpu, batch_argnums, compiler_options)
  text = theirs.as_text()
  n = report.plan.n_devices
  try:  # price the GPU compiled for, not the device the plan was made on
    device = get_spec(gpu)
  except ValueError:  # a GPU the cost model has no spec for: H100's
    device = get_spec("H100")
  names = tuple(links) if links is not None else (report.plan.link.name, *LINKS)
  names = tuple(dict.fromkeys(l if isinstance(l, str) else l.name for l in names))
  by_name = {report.plan.link.name: report.plan.link}
  rows = []
  for l in names:
    lk = by_name.get(l, l)
    tried = [(replay(ours.text, n, lk, device), plan_bb)]
    tried += [(replay(c.text, n, lk, device), b) for b, c in others]
    best, bb = min(tried, key=lambda t: t[0].step)
    rows.append(LinkRow(l, best, replay(text, n, lk, device), bb))
  rows = tuple(rows)
  return VersusXla(
    gpu,
    n,
    rows,
    ours.temp_bytes,
    int(theirs.memory_analysis().temp_size_in_bytes),
    tuple(more),
    (ours.text, text),
  )
