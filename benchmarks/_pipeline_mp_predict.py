"""pipeline_mp's prediction: each measured cell's table replayed on the measured link.

Read by `benchmarks/pipeline_mp.py --predict` (and `--from-json`), its worker's
`ooo-link` / `ooo-auto` planning, and `benchmarks/vs_torch.py`. Every figure
here is simulated (`passes.pipeline.link`); nothing is fitted to the measured
steps. How the pieces are measured: docs/guides/pipeline-links.md.
"""

from __future__ import annotations

import numpy as np


def stage_costs(calib: dict, n: int) -> list[dict]:
  """Measured phase seconds per virtual stage (one stage per process) from a
  worker's calibration (`_pipeline_mp_worker._Calibration`, one microbatch count)."""
  return [dict(zip("FBW", calib["phases"][s])) for s in range(n)]


def tbf_burst(gbit: float) -> float:
  """Bytes the shaped links' `tbf` qdisc (`pipeline_mp.tbf`) lets through at once
  after an idle spell: one timer tick (1 ms) of the rate, and at least a few
  packets."""
  return float(max(int(gbit * 1e9 / 8 / 1000), 8 * 1514))


def link_model(calib: dict, gbit: float | None, full: bool = False):
  """The measured link: what one transfer costs in a loop of exchanges sent as
  the executor sends them (`exchange`), less its wire time, is the latency (the
  rendezvous, the peer's wake-up). Where shaped, the bandwidth is the tbf rate
  and its bucket (`tbf_burst`) lets the bytes saved up during a tick through at
  once; one resource both ways (one qdisc on lo), or with `full` (`--duplex
  full`: a veth pair, one qdisc per direction) one resource per direction.
  Shaped, a send holds its sender for its wire time (`blocking_send`).
  Unshaped, the wire is free.

  Runs saved before that probe price a transfer by the older one (`transfer`:
  ticks of a stage forward then a one-way send, less the same ticks without the
  sends), which also holds the wait for the slower forward."""
  import math

  from ooojax.passes.pipeline.link import LinkModel

  lk = calib["link"]
  n = lk["nbytes"]
  if "transfer" not in lk and "exchange" not in lk:  # a run saved before either probe
    return _old_link_model(lk, gbit, full)
  burst = tbf_burst(gbit) if gbit else 0.0
  bw = gbit * 1e9 / 8 if gbit else math.inf
  if "exchange" in lk:  # back to back: the bucket is empty, each pays its wire
    cost, saved = lk["exchange"], 0.0
  else:  # each send follows a forward (`gap`): the bucket refilled meanwhile
    cost, saved = lk["transfer"], (min(burst, lk["gap"] * bw) if gbit else 0.0)
  wire = max(n - saved, 0.0) / bw if gbit else 0.0
  return LinkModel(
    max(cost - wire, 0.0),
    bw,
    n,
    duplex=gbit is None or full,
    one_way=_one_way(),
    # gloo sends over TCP: a shaped transfer (16-33 kB) outgrows the socket's
    # initial send buffer (tcp_wmem: 16 kB), so the send returns once its bytes
    # are on the wire, not when they are queued
    blocking_send=bool(gbit),
    burst=burst,
    name=f"measured ({'shaped ' + format(gbit, 'g') + ' Gbit/s' if gbit else 'unshaped'}"
    + (", full duplex)" if gbit and full else ")"),
  )


def _one_way() -> bool:
  """How the workers' executor exchanges (`execute.one_way` on a CPU mesh; `--exchange`)."""
  import jax

  from ooojax.passes.pipeline.execute import one_way

  return one_way(jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("stage",)))


def _old_link_model(lk: dict, gbit, full: bool = False):
  from ooojax.passes.pipeline.link import LinkModel

  n = lk["nbytes"]
  if "pp1" in lk:  # a loop of back-to-back one-way permutes
    bw = gbit * 1e9 / 8 if gbit else float("inf")
    return LinkModel(max(lk["pp1"] - n / bw, 0.0), bw, n, duplex=gbit is None or full, one_way=True)
  bw = gbit * 1e9 / 8 if gbit else 3 * n / max(lk["four"] - lk["one"], 1e-9)
  wire = n / bw
  return LinkModel(max(lk["one"] - wire, 0.0), bw, n, duplex=gbit is None or full)


# Which calibration predicts: the startup sample (before any timed round), the
# median of all samples (startup and between rounds), the fastest of them.
STATS = {
  "startup": "_calibration",
  "median": "_calibration_median",
  "min": "_calibration_min",
}


def _replay(r: dict, c: dict, n: int, gbit, full: bool = False):
  """What one measured cell replays: its table, its per-virtual-stage phase costs
  (calibrated) and the measured link."""
  from ooojax.passes.pipeline.schedule import PipelineSchedule

  sched = (
    PipelineSchedule.parse(r["table"])
    if "table" in r  # the table that ran
    else _sched(r["schedule"], n, r["microbatches"], c, gbit, full)
  )
  costs = stage_costs(c, n)
  if sched.chunks > 1:  # whole-stage costs on each chunk's device (a chunk: 1 / chunks)
    costs = [costs[sched.place(vs)[0]] for vs in range(sched.virtual_stages)]
  return sched, costs, link_model(c, gbit, full)


def _cells(results: dict, calib: dict):
  """(key, result, its microbatch count's calibration) of every measured cell."""
  for key, r in results.items():
    if not key.startswith("_") and "error" not in r and str(r["microbatches"]) in calib:
      yield key, r, calib[str(r["microbatches"])]


def predicted(
  results: dict,
  n: int,
  gbit: float | None,
  stat: str = "startup",
  full: bool = False,
  dry: bool = True,
) -> dict:
  """`{key: simulated seconds}` of every measured cell: its table replayed on the
  measured link with the measured phase costs (`passes.pipeline.link`, executor
  mode); nothing is fitted to the measured steps. With `dry` (and a run that
  timed them), each table's phase costs are scaled to its dry step (`_dry_scaled`):
  the calibration's loops miss what the table's own interleaving of actions costs
  (cache, slot writes), and that step measures it without the link."""
  out = {}
  for key, r, c in _cells(results, results.get(STATS[stat], {})):
    d = float(np.median(r["dry_ms"])) * 1e-3 if dry and r.get("dry_ms") else None
    out[key] = _cell(r, c, n, gbit, full, d)
  return out


def paired(results: dict, n: int, gbit: float | None, full: bool = False) -> dict:
  """`{key: median over rounds of predicted / measured}`, each round's prediction
  scaled to that round's dry step (the startup calibration's link and phase
  ratios). Rounds alternate over the tables, and on this VM a whole round runs
  fast or slow together (the host's other tenants): the dry step and the step
  of one round share its state, where the medians of the two may come from
  rounds in different states (a cell whose rounds split into two clusters)."""
  out = {}
  for key, r, c in _cells(results, results.get("_calibration", {})):
    if len(r.get("dry_ms", ())) == len(r["ms"]):
      per = [_cell(r, c, n, gbit, full, d * 1e-3) * 1e3 / t for d, t in zip(r["dry_ms"], r["ms"])]
      out[key] = float(np.median(per))
  return out


def _cell(r: dict, c: dict, n: int, gbit, full: bool, dry_s: float | None) -> float:
  """One cell's replayed step (seconds), its compute scaled to `dry_s` if given."""
  from ooojax.passes.pipeline.link import simulate_link

  sched, costs, link = _replay(r, c, n, gbit, full)
  if dry_s is not None:
    costs = _dry_scaled(sched, costs, dry_s)
  return simulate_link(sched, costs, link).makespan


def _dry_scaled(sched, costs, dry_s: float) -> list[dict]:
  """`costs` (per virtual stage) scaled so that the busiest device's actions sum
  to `dry_s`, the measured step of the same table with every exchange replaced by
  zeros (no link, no waits: the device that works longest sets it)."""
  from ooojax.passes.pipeline.link import simulate_link

  if isinstance(costs, dict):
    costs = [costs] * sched.virtual_stages
  busy = [0.0] * sched.stages
  for a, b, e in simulate_link(sched, costs).spans:
    busy[a.stage] += e - b
  k = dry_s / max(busy)
  return [{p: x * k for p, x in c.items()} for c in costs]


def _sched(name: str, n: int, m: int, calib: dict, gbit, full: bool = False):
  from ooojax.passes.pipeline.generate import generate

  if name == "ooo-link":
    from ooojax.passes.pipeline.depth import plan_ooo

    return plan_ooo(n, m, stage_costs(calib, n), link_model(calib, gbit, full))[0]
  return generate(name, n, m)


def predict_table(results: dict, n: int, link: str, gbit, full: bool = False) -> list[str]:
  """Predicted (simulated, from the startup calibration: before any timed round)
  beside the measured median and min step time, per cell."""
  pred = predicted(results, n, gbit, "startup", full)
  pair = paired(results, n, gbit, full)
  calib = results.get("_calibration", {})
  dry = any(r.get("dry_ms") for k, r in results.items() if not k.startswith("_"))
  lines = [
    f"Link: {link}. Predicted: the table replayed by `passes.pipeline.link` (executor "
    "mode) with the phase costs and the link measured at the start of the run"
    + (
      "; each table's phase costs scaled so that its busiest device's actions take "
      "its dry step (the same step with every exchange replaced by zeros: its "
      "compute, no link, no waits; timed in the rounds beside it)"
      if dry
      else ", before any timed step"
    )
    + " (nothing fitted to the steps):"
  ]
  for m, c in sorted(calib.items(), key=lambda kv: int(kv[0])):
    lk = link_model(c, gbit, full)
    ph = "; ".join(
      f"stage {s}: F {p[0] * 1e3:.2f} B {p[1] * 1e3:.2f} W {p[2] * 1e3:.2f}"
      + (f" (x{c['scale'][s]:.2f})" if "scale" in c else "")
      for s, p in enumerate(c["phases"])
    )
    lines.append(
      f"- {m} microbatches: {ph} ms (in brackets: the executor's factor over the "
      f"bare calls); link: {lk.latency * 1e6:.0f} us per transfer beyond its wire, "
      f"{lk.nbytes / 1e3:.0f} kB per transfer, wire {lk.wire * 1e3:.3f} ms"
      + (f" (bucket {lk.burst / 1e3:.0f} kB)" if lk.burst else "")
      + f", {'duplex' if lk.duplex else 'one resource both ways'}."
    )
  lines += [
    "",
    "| schedule | microbatches | predicted (ms) | measured, median (ms) | predicted / "
    "measured | measured, min (ms) | predicted / min | within 15% (median) |"
    + (" dry step, median (ms) | dry / measured | paired by round |" if dry else ""),
    "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if dry else ""),
  ]
  for key, r in results.items():
    if key.startswith("_") or key not in pred:
      continue
    p = pred[key] * 1e3
    med, lo = float(np.median(r["ms"])), float(np.min(r["ms"]))
    ok = "yes" if abs(p / med - 1) <= 0.15 else "no"
    row = (
      f"| {r['schedule']} | {r['microbatches']} | {p:.1f} | {med:.1f} | {p / med:.2f} | "
      f"{lo:.1f} | {p / lo:.2f} | {ok} |"
    )
    if dry:
      d = float(np.median(r["dry_ms"])) if r.get("dry_ms") else float("nan")
      pr = f"{pair[key]:.2f}" if key in pair else ""
      row += f" {d:.1f} | {d / med:.2f} | {pr} |"
    lines.append(row)
  n_ok = sum(abs(pred[k] * 1e3 / float(np.median(results[k]["ms"])) - 1) <= 0.15 for k in pred)
  lines += ["", f"Within 15%: {n_ok} of {len(pred)} cells."]
  if pair:
    lines[-1] += (
      f" Paired by round (each round's step against the replay scaled to that round's "
      f"dry step; the median of the rounds' ratios): "
      f"{sum(abs(x - 1) <= 0.15 for x in pair.values())} of {len(pair)}."
    )
  return lines
