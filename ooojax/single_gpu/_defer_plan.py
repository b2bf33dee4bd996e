"""What the single-GPU deferred train step leaves to the next step, and its simulated effect.

`plan_deferral` turns a traced gradient and a `defer` choice ("auto", path
substrings, a predicate) into a `Plan`: the deferred parameter leaves, the
values carried in `Pending`, the simulated steady-state step with and without
the deferral. `ooojax.single_gpu.make_train_step` builds its step from it;
`ooo.explain(..., defer=...)` shows it.
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any

import jax
import numpy as np

from ooojax.passes import defer as defer_pass
from ooojax.passes.cost import CostModel
from ooojax.passes.simulate import simulate


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `init` chose: deferred leaves, what they carry, the simulated effect.

  `simulated`: (steady-state step without deferral, with it), seconds, from
  the cost model (`passes.defer.steady_state`), never measured; `dw_seconds`
  the cost-model time of each deferred leaf's dW cluster. `ooo.explain(loss,
  params, batch, defer=...)` shows the same plan (`Report.carried`).
  """

  paths: tuple[str, ...]  # every parameter leaf
  deferred: tuple[int, ...]  # leaves whose dW run in the next step
  kept: tuple[int, ...]
  carried: tuple[Any, ...]  # ShapeDtypeStructs of pending.local
  anchor: int
  first_use: int
  coupled: bool  # the optimizer reads every leaf: updates wait
  simulated: tuple[float, float]
  device: str
  late: Any = dataclasses.field(repr=False, compare=False)  # jaxpr carried -> deferred grads
  treedef: Any = dataclasses.field(repr=False, compare=False)
  dw_seconds: tuple[float, ...] = ()  # per deferred leaf, cost model
  # the simulated steady-state steps (without, with deferral): `plot` draws them
  timelines: tuple = dataclasses.field(default=(), repr=False, compare=False)
  deferred_units: tuple[str, ...] = ()  # their dW units in the timelines (`W<cluster>`)

  @property
  def deferred_paths(self) -> tuple[str, ...]:
    return tuple(self.paths[i] for i in self.deferred)

  @property
  def carried_bytes(self) -> int:
    """Bytes of `pending.local`: the values step t leaves for step t + 1's deferred dW."""
    return sum(int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize for c in self.carried)

  @property
  def hidden_seconds(self) -> float:
    """Simulated step time the deferral saves (negative: it costs)."""
    return self.simulated[0] - self.simulated[1]

  def __str__(self) -> str:
    t0, t1 = self.simulated
    lines = [
      f"deferred dW (next step, beside the forward): {len(self.deferred)} of "
      f"{len(self.paths)} parameter leaves; carried in Pending: "
      f"{len(self.carried)} values, {self.carried_bytes} bytes"
    ]
    for j, p in enumerate(self.deferred_paths):
      dw = f": dW {self.dw_seconds[j] * 1e3:.4f} ms" if j < len(self.dw_seconds) else ""
      lines.append(f"  {p}{dw}")
    lines.append(
      f"simulated steady-state step (cost model, {self.device}, not measured): "
      f"{t0 * 1e3:.3f} ms without deferral, {t1 * 1e3:.3f} ms with"
      + (f" ({t0 / t1:.3f}x)" if t1 else "")
    )
    if self.coupled:
      lines.append("coupled optimizer: every update waits for the deferred dW")
    return "\n".join(lines)

  def _repr_html_(self) -> str:
    return f"<pre>{html.escape(str(self))}</pre>"

  def plot(self, ax=None):
    """The simulated steady-state step without and with deferral, stacked;
    returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
      fig, ax = plt.subplots(figsize=(10, 2.4))
      fig.subplots_adjust(left=0.14, bottom=0.2)
    colors = {"F": "#9e9e9e", "X": "#d62728", "W": "#1f77b4"}
    rows = []
    for r, (label, tl) in enumerate(zip(("without", "with"), self.timelines)):
      for span in tl.spans:
        late = label == "with" and span.unit in self.deferred_units
        ax.barh(
          2 * r + span.stream,
          (span.end - span.start) * 1e3,
          left=span.start * 1e3,
          color="#ff7f0e" if late else colors[span.unit[0]],
          edgecolor="white",
          linewidth=0.3,
        )
      rows += [f"{label}: stream 0", f"{label}: stream 1"]
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel(f"ms (simulated steady-state step, {self.device} cost model)")
    ax.set_title(
      "F forward / dX (red) / dW (blue); carried dW from the last step (orange)", fontsize=9
    )
    return ax


def _choose(d, sp, sched, paths, cm) -> tuple[int, ...]:
  can = defer_pass.deferrable(sp)
  if d is None or d is False or (isinstance(d, (tuple, list)) and not d):
    return ()
  if isinstance(d, str) and d == "auto":
    return defer_pass.choose(sp, sched, cm)
  if callable(d):
    chosen = tuple(i for i, p in enumerate(paths) if d(p))
  else:
    pats = (d,) if isinstance(d, str) else tuple(d)
    chosen = []
    for pat in pats:
      hit = [i for i, p in enumerate(paths) if pat in p]
      if not hit:
        raise ValueError(f"defer={pat!r} names no parameter; parameter paths: {list(paths)}")
      chosen += hit
    chosen = tuple(sorted(set(chosen)))
  bad = [paths[i] for i in chosen if i not in can]
  if bad:
    raise ValueError(
      f"cannot defer {bad}: their gradient has no dW cluster of its own "
      "(it is part of the dX chain, or computed in a loop); deferrable: "
      f"{[paths[i] for i in sorted(can)]}"
    )
  return chosen


def plan_deferral(plan, params, defer, cm: CostModel, has_aux: bool = False) -> Plan:
  """The `Plan` for `defer` over a traced gradient (`value_and_grad(...).plan`'s
  `_Plan`, params its first argument), optimizer not consulted (`coupled=False`)."""
  sp, sched = plan.split, plan.schedule
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  paths = tuple(jax.tree_util.keystr(k) for k, _ in flat)
  if any(p is not None for p in plan.out_tree[3]) or len(
    sp.jaxpr.jaxpr.outvars
  ) - sp.grad_out_start != len(paths):
    bad = [p for (p, x) in zip(paths, (x for _, x in flat)) if not _is_float_array(x)]
    raise TypeError(
      "make_train_step: every parameter leaf must be a float array"
      + (f"; params{bad[0]} is a {type(flat[paths.index(bad[0])][1]).__name__}" if bad else "")
      + ". An Equinox module's static fields (functions, ints) are no parameters here: "
      "pass params, static = eqx.partition(model, eqx.is_inexact_array) and rebuild the "
      "model with eqx.combine(params, static) inside loss_fn"
    )
  if plan.n_aux and not has_aux:  # pragma: no cover - value_and_grad refuses it first
    raise TypeError("make_train_step: loss_fn returns aux: pass has_aux=True")
  deferred = _choose(defer, sp, sched, paths, cm)
  dfr = defer_pass.defer(sp, sched, deferred)
  st = defer_pass._Steady(sp, sched, cm)
  runs = (st.run(()), st.run(dfr.leaves))
  can = defer_pass.deferrable(sp)
  dw = tuple(sched.unit(f"W{can[i]}").cost for i in dfr.leaves)
  tls = tuple(simulate(r.streams, r.units, cm.spec.sync) for r in runs)
  return Plan(
    paths,
    dfr.leaves,
    dfr.kept,
    dfr.carried,
    dfr.anchor,
    dfr.first_use,
    False,
    (runs[0].makespan, runs[1].makespan),
    cm.spec.name,
    dfr.late,
    jax.tree.structure(params),
    dw,
    tls,
    tuple(f"W{can[i]}" for i in dfr.leaves),
  )


def _is_float_array(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.inexact)
