"""Pick a pipeline table by timing it: `ooo.pipeline.tune`, `PipelineTrainStep.tune`.

The replay (`passes.pipeline.link`) chooses `ooo`'s in-flight depth on a
modelled link, and it ranks tables only to its own accuracy: 0.87-1.02 of the
measured steps on the 2-process CPU harness, where the best tables are 1-4%
apart (`benchmarks/RESULTS.md`, issue 34). Timing a few steps of each candidate
on the user's own devices, link and model settles what the model cannot, the
way XLA autotunes a GEMM. So `ooo`, tuned, is GPipe's or 1F1B's table whenever
one of them is measurably faster there.

Every process must run the same table, and a shared host's steps differ
between processes. So process 0's times decide for all of them
(`multihost_utils.broadcast_one_to_all`), and every process reaches the same
pick from the same numbers.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ooojax.passes.pipeline.depth import measured_scores, pick_measured, trial_tables
from ooojax.passes.pipeline.generate import generate
from ooojax.passes.pipeline.schedule import PipelineSchedule

__all__ = ["Tuning", "tune"]


@dataclasses.dataclass(frozen=True)
class Tuning:
  """What `tune` measured and picked.

  `label`: the chosen candidate; `schedule`: its table; `times`: `{label:
  (ms per round, ...)}`, process 0's, in the candidates' order of preference;
  `peaks`: `{label: activations held per stage}`; `tie`: the relative margin
  within which an earlier label wins (`pick_measured`); `failed`: `{label:
  error}` of the candidates whose first run failed (in one process) and were
  left out.
  """

  label: str
  schedule: PipelineSchedule
  times: dict
  peaks: dict
  tie: float
  failed: dict = dataclasses.field(default_factory=dict)  # label -> its error, left out

  def summary(self) -> str:
    """One line per candidate: median ms, the score `pick_measured` ranked by
    (its time over the first candidate's in the same round), peak activations."""
    med = {k: statistics.median(v) for k, v in self.times.items()}
    score = measured_scores(self.times)
    first = next(iter(self.times))
    lines = [
      f"tuned pipeline table: {self.label!r} (process 0's times; score: time over "
      f"{first!r}'s in the same round, the earliest within {self.tie:.0%} of the lowest wins)"
    ]
    for k, m in med.items():
      mark = "*" if k == self.label else " "
      lines.append(
        f" {mark} {k:<12} {m:8.3f} ms  score {score[k]:5.3f}  "
        f"peak {self.peaks[k]} activations/stage  ({len(self.times[k])} rounds)"
      )
    lines += [f" x {k:<12} left out, its first run failed: {e}" for k, e in self.failed.items()]
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.summary()


def _candidates(
  stages: int,
  microbatches: int,
  names: Sequence[str | tuple[str, PipelineSchedule]] | None = None,
  *,
  budget: int | None = None,
  link=None,
  costs=None,
  mode: str = "executor",
  lag: int | Sequence[int] = 0,
) -> tuple[tuple[str, PipelineSchedule], ...]:
  """`(label, table)` pairs to time: `trial_tables` (ooo at 1F1B's depth, ooo
  planned on `link`, 1F1B's, GPipe's; within `budget`) when `names` is None,
  else each name generated (or each `(label, table)` as given). Names are
  generated at each of `lag`'s lags in turn; a lag-1 table's label ends in
  ", lag 1" when lag 0 is tried too."""
  lags = _lags(lag)
  if isinstance(names, str):
    raise TypeError(f"candidates is a sequence of names, got the string {names!r}")
  tag = lambda lab, g: f"{lab}, lag {g}" if g and 0 in lags else lab  # noqa: E731
  if names is None:
    return tuple(
      (tag(lab, g), t)
      for g in lags
      for lab, t in trial_tables(stages, microbatches, costs, link, budget, mode, g)
    )
  out = []
  for c in names:
    if isinstance(c, str):
      out += [(tag(c, g), generate(c, stages, microbatches, lag=g)) for g in lags]
      continue
    label, t = c
    if not isinstance(t, PipelineSchedule):
      raise TypeError(f"a candidate is a schedule name or (label, PipelineSchedule), got {c!r}")
    out.append((label, t))
  return _checked(out, stages, microbatches, budget)


def _lags(lag) -> tuple[int, ...]:
  try:
    lags = (lag,) if isinstance(lag, (int, np.integer)) else tuple(lag)
  except TypeError:
    lags = ()
  if not lags or any(g not in (0, 1) or isinstance(g, bool) for g in lags):
    raise ValueError(f"lag must be 0, 1 or a sequence of them, got {lag!r}")
  return tuple(dict.fromkeys(int(g) for g in lags))


def _checked(cands, stages: int, microbatches: int, budget) -> tuple:
  out = []
  for label, t in cands:
    if (t.stages, t.microbatches) != (stages, microbatches):
      raise ValueError(
        f"candidate {label!r} is a table of {t.stages} stages and {t.microbatches} "
        f"microbatches; this step runs {stages} and {microbatches}"
      )
    if budget is not None and max(t.peak_activations()) > budget:
      continue
    out.append((label, t.validate()))
  if len({label for label, _ in out}) != len(out):
    raise ValueError(f"candidate labels must differ, got {[label for label, _ in out]}")
  if not out:
    raise ValueError(f"no candidate fits budget={budget} activations per stage")
  return tuple(out)


def _barrier() -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("ooojax.pipeline.tune")


def _agree(times: dict) -> dict:
  """Process 0's times on every process (all must run the same table)."""
  if jax.process_count() == 1:
    return times
  from jax.experimental import multihost_utils

  got = np.asarray(multihost_utils.broadcast_one_to_all(np.array(list(times.values()))))
  return {k: tuple(float(x) for x in got[i]) for i, k in enumerate(times)}


def tune(
  build: Callable[[PipelineSchedule], Callable],
  args: tuple,
  *,
  stages: int,
  microbatches: int,
  candidates: Sequence[str | tuple[str, PipelineSchedule]] | None = None,
  budget: int | None = None,
  link=None,
  costs=None,
  rounds: int = 5,
  tie: float = 0.03,
  lag: int | Sequence[int] = 0,
) -> tuple[Callable, Tuning]:
  """Time each candidate table and keep the fastest: `(fn, Tuning)`.

  `build(table)` returns the step to time (e.g. `jax.jit` of
  `value_and_grad(..., schedule=table)` with `compiler_options=
  compiler_options(table)`, which a lag-1 table of more than 2 stages needs on
  a GPU), called as `fn(*args)`. Each candidate
  runs once to compile and warm up, then `rounds` times, the candidates
  alternating within each round; the pick is `pick_measured(times, tie)` on
  process 0's times (every process gets the same). Its outputs are discarded,
  so a step that updates a state leaves `args` as they were.

  Args:
    build: `table -> callable`.
    args: the arguments each step is timed with (a real batch).
    stages, microbatches: the tables' shape.
    candidates: None (the default: `trial_tables`: `ooo` at 1F1B's depth, then
      `ooo` planned on `link` when one is given, then 1F1B's and GPipe's tables,
      each named "ooo"), or schedule names / `(label, PipelineSchedule)` pairs,
      in order of preference.
    budget: activations a stage may hold; candidates above it are left out
      (default: GPipe's, `microbatches`).
    link, costs: a `LinkModel` and `{"F", "B", "W"}` seconds, to add the table
      planned on that link (`plan_ooo`).
    rounds: timed rounds (each runs every candidate once).
    tie: a candidate within this fraction of the fastest that comes earlier in
      the order of preference wins (a shared host's equal tables differ by a
      few percent).
    lag: the lag the named (and default) candidates are generated at, or a
      sequence of lags to try each at, in order of preference: `(0, 1)` also
      times every table receiving one tick after its send (labels ending in
      ", lag 1"), which lets a GPU overlap a tick's transfer with its compute
      (`docs/pipeline.md`); on a CPU it only adds ticks.

  >>> import jax, jax.numpy as jnp
  >>> from ooojax import pipeline
  >>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
  >>> build = lambda t: jax.jit(pipeline.value_and_grad(
  ...     lambda w, x: jnp.tanh(x @ w), lambda y, t: jnp.mean((y - t) ** 2),
  ...     mesh=mesh, axis_name="stage", schedule=t),
  ...     compiler_options=pipeline.compiler_options(t))
  >>> w, batch = jnp.ones((2, 3, 3)) * 0.1, (jnp.ones((8, 3)), jnp.zeros((8, 3)))
  >>> fn, tuning = pipeline.tune(build, (w, batch), stages=2, microbatches=4, rounds=2)
  >>> sorted(tuning.times)
  ['1f1b', 'gpipe', 'ooo']
  """
  if not (isinstance(rounds, int) and rounds >= 1):
    raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
  if not 0 <= tie < 1:
    raise ValueError(f"tie must be in [0, 1), got {tie!r}")
  cands = _candidates(
    stages, microbatches, candidates, budget=budget, link=link, costs=costs, lag=lag
  )
  fns = {label: build(t) for label, t in cands}
  failed = _warm_up(fns, args)
  times = {label: [] for label in fns}
  for _ in range(rounds):
    for label, fn in fns.items():
      _barrier()  # every process starts the step together, so process 0 times the one its peers run
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[label].append((time.perf_counter() - t0) * 1e3)
  times = _agree({k: tuple(v) for k, v in times.items()})
  label = pick_measured(times, tie)
  tables = dict(cands)
  peaks = {k: max(t.peak_activations()) for k, t in cands}
  return fns[label], Tuning(label, tables[label], times, peaks, tie, failed)


def _warm_up(fns: dict, args) -> dict:
  """Compiles and runs each candidate once. In one process, a candidate that
  fails (a deep table out of memory) is dropped and its error kept, unless every
  candidate fails (then the first error is raised: the step itself is broken).
  Across processes a failure is raised: one process dropping a table while its
  peers run it would leave them waiting in its collectives."""
  failed, first = {}, None
  for label, fn in list(fns.items()):
    try:
      jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001 - any failure of a candidate is a result
      if jax.process_count() > 1:
        raise
      first = first or e
      msg = str(e).strip().splitlines()
      failed[label] = f"{type(e).__name__}: {msg[0][:200] if msg else ''}"
      del fns[label]
  if not fns:
    raise first
  return failed
