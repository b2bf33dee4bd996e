"""pipeline.depth: `ooo` planned with the link: how many microbatches in flight.

Contract: `plan_ooo(stages, microbatches, costs, link, budget, mode, lag) ->
(PipelineSchedule, DepthChoice)` (the table validated, named "ooo"; simulated,
never measured).

Gradient fast-forwarding computes a stage's dX first, sends it upstream at once
and runs dW while it travels. That hides a transfer only while there is other
work: on a link whose round trip takes longer than a few stages' compute, a
stage that holds only 1F1B's S - s activations waits on it. The paper's answer
is to keep as many microbatches in flight as the link needs. Here the depth is
chosen by simulation: each candidate is a table the greedy generator builds
(`generate._greedy`) under a policy whose warm-up depth on stage s is
`min(S - s + extra, budget)`, with dW eager (right after dX) or filling idle
ticks, and the two fused tables, GPipe's (every microbatch in flight) and 1F1B's,
are candidates too. Each is replayed on the link (`passes.pipeline.link`);
the fastest whose peak activations per stage stay within `budget` wins, the
smaller memory on a tie. So `ooo` is never slower, in the simulator that
chose it, than GPipe or 1F1B at the same memory: it becomes either one when
the link demands it.

Where the replay cannot be trusted on a link (a shaped CPU link whose TCP
behaviour it does not model, `benchmarks/RESULTS.md`), the measured runs decide:
`trial_tables` gives the planned table beside `ooo` at 1F1B's depth, GPipe's and
1F1B's; the caller times a few steps of each, alternating, and `pick_measured`
takes the fastest median. Then `ooo` is never slower than GPipe or 1F1B by more
than the trial's noise, measured.
"""

from __future__ import annotations

import dataclasses
import functools

from ooojax.passes.pipeline.link import LinkModel, simulate_link

__all__ = ["DepthChoice", "measured_scores", "pick_measured", "plan_ooo", "trial_tables"]


@dataclasses.dataclass(frozen=True)
class DepthChoice:
  """What `plan_ooo` chose, and what it compared.

  `form`: "ooo" (dX and dW split), "gpipe" or "1f1b" (the fused table taken
  whole); `extra`: forwards in flight beyond 1F1B's S - s (the warm-up depth
  on stage s is `min(S - s + extra, budget)`); `peak`: activations held per
  stage; `step`: simulated seconds; `gpipe` / `one_f_one_b`: GPipe's and 1F1B's
  simulated step on the same link; `candidates`: (form, extra, step, peak).
  """

  form: str
  extra: int
  peak: tuple[int, ...]
  step: float
  budget: int
  gpipe: float
  one_f_one_b: float
  gpipe_peak: int
  one_f_one_b_peak: int
  mode: str
  candidates: tuple[tuple[str, int, float, int], ...]

  def summary(self, unit: float = 1e-3, unit_name: str = "ms") -> str:
    f = lambda t: f"{t / unit:.3f} {unit_name}"  # noqa: E731
    how = (
      f"dX/dW split, {self.extra} beyond 1F1B's S - s in flight"
      if self.form == "ooo"
      else f"{self.form}'s table (it wins on this link)"
    )
    return (
      f"in-flight depth (planned on the link, {self.mode} replay): {how}; peak "
      f"activations per stage {max(self.peak)} (budget {self.budget}); step "
      f"{f(self.step)} vs GPipe {f(self.gpipe)} (peak {self.gpipe_peak}), 1F1B "
      f"{f(self.one_f_one_b)} (peak {self.one_f_one_b_peak}), simulated"
    )


def _extras(S: int, M: int) -> list[int]:
  out, d = [0, 1, 2, 3], 4
  while d < M:
    out.append(d)
    d = d * 3 // 2
  return sorted({x for x in out + [M] if x <= M})


@functools.lru_cache(maxsize=64)
def _candidates(S: int, M: int, gen_costs, budget: int, lag: int, comm: float = 0.0):
  """(form, extra, table) of every candidate, generated as if each transfer took
  `comm` (a delay: the replay on the link then prices the queueing); cached, so
  a sweep over links and modes generates them once per `comm`."""
  from ooojax.passes.pipeline.generate import Policy, _greedy, generate
  from ooojax.passes.pipeline.place import _lower_comms, _place
  from ooojax.passes.pipeline.schedule import PipelineSchedule, ScheduleError

  gc = dict(gen_costs) if gen_costs is not None else None
  out = (
    []
    if comm
    else [
      (n, M if n == "gpipe" else 0, generate(n, S, M, lag=lag, costs=gc)) for n in ("gpipe", "1f1b")
    ]
  )
  seen = set()
  for extra in _extras(S, M):
    lim = tuple(min(S - s + extra, M, budget) for s in range(S))
    for w, lazy in (("eager", (S - 1,)), ("fill", ())):
      if (lim, w, lazy) in seen or min(lim) < 1:
        continue
      seen.add((lim, w, lazy))
      last = min(max(S, lim[-1]), budget)
      pol = Policy(False, "F", w, lim[:-1] + (last,), lim, lazy_stages=lazy)
      try:
        orders = _greedy(S, M, 1, pol, "modulo", gc, comm)
        grid = _place(S, M, 1, orders, lag, "modulo")
        t = PipelineSchedule(
          "ooo", S, M, 1, _lower_comms(S, 1, grid, lag, "modulo"), pol.limit, lag
        ).validate()
      except ScheduleError:
        continue
      out.append(("ooo", extra, t))
  return tuple(out)


def plan_ooo(
  stages: int,
  microbatches: int,
  costs=None,
  link: LinkModel | None = None,
  budget: int | None = None,
  mode: str = "executor",
  lag: int = 0,
):
  """The `ooo` table with the in-flight depth that is fastest on `link` within `budget`.

  Args:
    stages, microbatches: as `generate`.
    costs: `{"F", "B", "W"}` seconds per whole stage (or one mapping per stage).
    link: the transfers' `LinkModel` (None: free transfers).
    budget: activations a stage may hold (default GPipe's: `microbatches`).
    mode: "executor" (ooojax's tick loop) or "overlap" (asynchronous transfers).
    lag: the table's lag (0 or 1).

  Returns:
    `(sched, DepthChoice)`. Example:

    >>> slow = LinkModel(bandwidth=1.0, nbytes=4.0)            # a transfer: 4 F's
    >>> s, c = plan_ooo(4, 8, link=slow, mode="overlap")
    >>> c.step <= min(c.gpipe, c.one_f_one_b), max(s.peak_activations()) <= 8
    (True, True)
  """
  S, M = stages, microbatches
  budget = M if budget is None else budget
  if not (isinstance(budget, int) and budget >= 1):
    raise ValueError(f"budget must be an int >= 1 (activations per stage), got {budget!r}")
  gen = tuple(sorted(costs.items())) if isinstance(costs, dict) else None
  sim = lambda t: simulate_link(t, costs, link, mode).makespan  # noqa: E731
  tables = _candidates(S, M, gen, budget, lag)
  comm = link.seconds() if link is not None and gen is not None else 0.0
  if comm > 0:  # also orders planned with the transfer's delay (the greedy sees it)
    tables += _candidates(S, M, gen, budget, lag, comm)
  cands = [
    (sim(t), max(t.peak_activations()), form, extra, t)
    for form, extra, t in tables
    if max(t.peak_activations()) <= budget
  ]
  if not cands:
    raise ValueError(
      f"no ooo table fits a budget of {budget} activations per stage on "
      f"{S} stages; 1F1B needs {S}: raise budget"
    )
  best = min(c[0] for c in cands)  # ties (to 1e-6): the smaller memory, then ooo's own
  step, peak, form, extra, table = min(
    (c for c in cands if c[0] <= best * (1 + 1e-6)), key=lambda c: (c[1], c[2] != "ooo", c[3])
  )
  g, f = (next(t for form, _, t in tables if form == n) for n in ("gpipe", "1f1b"))
  choice = DepthChoice(
    form,
    extra,
    table.peak_activations(),
    step,
    budget,
    sim(g),
    sim(f),
    max(g.peak_activations()),
    max(f.peak_activations()),
    mode,
    tuple((c[2], c[3], c[0], c[1]) for c in cands),
  )
  return dataclasses.replace(table, name="ooo"), choice


def trial_tables(
  stages: int,
  microbatches: int,
  costs=None,
  link: LinkModel | None = None,
  budget: int | None = None,
  mode: str = "executor",
  lag: int = 0,
):
  """The tables a measured trial compares, each named "ooo": `((label, table), ...)`.

  Labels, in order of preference: "ooo" (dX/dW split at 1F1B's depth, the
  generator's default), "planned" (`plan_ooo` on `link`; only with a `link`),
  "1f1b", "gpipe". Tables
  whose peak activations exceed `budget` (default: GPipe's) are left out, and a
  table equal to an earlier one is given once (under the earlier label).

  >>> [lab for lab, _ in trial_tables(2, 4)]
  ['ooo', '1f1b', 'gpipe']
  """
  from ooojax.passes.pipeline.generate import generate

  budget = microbatches if budget is None else budget
  out = [("ooo", generate("ooo", stages, microbatches, lag=lag))]
  if link is not None:
    out.append(("planned", plan_ooo(stages, microbatches, costs, link, budget, mode, lag)[0]))
  # 1F1B before GPipe: on a tie the smaller memory (and, on the CPU host, the
  # steadier step: GPipe's measured steps spread widest)
  out += [(n, generate(n, stages, microbatches, lag=lag)) for n in ("1f1b", "gpipe")]
  seen, picked = set(), []
  for label, t in out:
    key = dataclasses.replace(t, name="ooo").to_text()
    if key in seen or max(t.peak_activations()) > budget:
      continue
    seen.add(key)
    picked.append((label, dataclasses.replace(t, name="ooo")))
  return tuple(picked)


def pick_measured(times, tie: float = 0.03) -> str:
  """The fastest label by its measured step times (seconds or ms, a list per
  label); a label within `tie` (relative) of the fastest that comes earlier in
  `times` wins instead (the trial's order states the preference,
  `trial_tables`'s: `ooo`'s own first). A few steps on a shared host differ by
  a few percent between equal tables, hence the 3% default.

  Where every label has one time per round (the trial alternates over the
  labels), each label is scored by the median over rounds of its time over
  the first label's in the same round: a round runs fast or slow as a whole on
  a shared host, and the medians of two labels' times can come from rounds in
  different states. Otherwise by the median of its times.

  >>> pick_measured({"ooo": [4.2, 4.1], "planned": [5.0, 5.1], "gpipe": [4.0, 4.1]})
  'ooo'
  """
  score = measured_scores(times)
  best = min(score.values())
  return next(k for k in times if score[k] <= best * (1 + tie))


def measured_scores(times) -> dict:
  """`pick_measured`'s score per label (lower is faster): the median over rounds
  of its time over the first label's in the same round where every label has
  one time per round, else the median of its times.

  >>> measured_scores({"ooo": [4.0, 8.0], "gpipe": [3.0, 8.8]})
  {'ooo': 1.0, 'gpipe': 0.925}
  """
  import statistics

  if not times or any(len(v) == 0 for v in times.values()):
    raise ValueError(f"pick_measured needs at least one time per label, got {dict(times)!r}")
  if any(not t > 0 for v in times.values() for t in v):  # also NaN
    raise ValueError(f"pick_measured needs positive step times, got {dict(times)!r}")
  ref = next(iter(times.values()))
  if len({len(v) for v in times.values()}) == 1:  # rounds: paired with the first label
    return {k: statistics.median(a / b for a, b in zip(v, ref)) for k, v in times.items()}
  return {k: statistics.median(v) for k, v in times.items()}
