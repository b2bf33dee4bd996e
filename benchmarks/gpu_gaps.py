"""What the host does while the GPU idles: device gaps against host events.

`benchmarks.gpu_trace` found that ooojax's pinned second-stream windows leave
the H200 idle (ResNet-50: busy time equal to jax.grad's, idle 18-26 ms a step)
while each stream call costs 0-7 us in isolation (`benchmarks.stream_pairs`).
This traces the same jitted SGD steps and, for every gap of at least
`--min-gap` us in the device timeline (no stream running), sums which host
events overlap it: CUDA API calls recorded by CUPTI (`cuStreamWaitEvent`,
`cuEventSynchronize`, `cuLaunchKernel`, ...) and XLA's own host annotations
(thunks, executables). A gap that overlaps a synchronising API call is the
host waiting on the device; one that overlaps only launches is the host too
slow to feed it; one around a `call-start`/`call-done` thunk names the window.

It also lists, per variant, the host events with the most total time per step
(the diff against the first variant shows what a variant adds), and the kernels
just before and after the largest gaps with their streams.

  python -m benchmarks.gpu_gaps --model demo_cnn --batch 32
  python -m benchmarks.gpu_gaps --dry     # CPU: tiny sizes, the path runs (no device lines)
"""

from __future__ import annotations

import argparse
import bisect
import collections
import re
import time

from benchmarks import _report
from benchmarks.gpu_trace import trace
from benchmarks.step_time import VARIANTS, case, sgd_step, variant_grad

DEFAULT = ("jax.grad", "ooo single_gpu", "ooo single_gpu (none)")


def _norm(name: str) -> str:
  """A host event's name without its per-op arguments ("Thunk:#hlo_op=x.3#" ->
  "Thunk:hlo_op=x"), so events of one kind add up."""
  name = re.sub(r"#([^#=]*)=([^#,]*)[^#]*#?", lambda m: f"{m.group(1)}={m.group(2)}", name)
  name = re.sub(r"\.\d+\b", "", name)  # instruction numbers
  return name.replace("#", "")[:90]


def _device_events(profile):
  out = []
  for p in profile.planes:
    if not p.name.startswith("/device:GPU"):
      continue
    for ln in p.lines:
      if ln.name.startswith("Stream"):
        out += [(e.start_ns, e.end_ns, e.name, ln.name) for e in ln.events]
  return sorted(out)


def _host_events(profile):
  """(plane/line, start, end, normalized name) of every host event but python's."""
  out = []
  for p in profile.planes:
    if p.name.startswith("/device:") or p.name == "/host:metadata":
      continue
    for ln in p.lines:
      if ln.name == "python":
        continue
      out += [(f"{p.name}", e.start_ns, e.end_ns, _norm(e.name)) for e in ln.events]
  return out


def gaps(dev, min_gap_ns: float):
  """Device idle gaps (start, end, kernel before, kernel after) of at least min_gap_ns."""
  out, end, last = [], None, None
  for s, e, name, stream in dev:
    if end is not None and s - end >= min_gap_ns:
      out.append((end, s, last, (name, stream)))
    if end is None or e > end:
      end, last = e, (name, stream)
  return out


def overlap_by_name(gs, host, long_ns: float = 1e6):
  """Host time (ns) overlapping the gaps, per (plane, event name)."""
  acc = collections.Counter()
  # short events by start time (a window search per gap); the few long ones
  # (a whole execution) against every gap
  short = sorted((h for h in host if h[2] - h[1] < long_ns), key=lambda h: h[1])
  long_ = [h for h in host if h[2] - h[1] >= long_ns]
  starts = [h[1] for h in short]
  for gs_, ge, *_ in gs:
    lo, hi = bisect.bisect_left(starts, gs_ - long_ns), bisect.bisect_left(starts, ge)
    for plane, s, e, name in short[lo:hi] + long_:
      o = min(e, ge) - max(s, gs_)
      if o > 0:
        acc[(plane, name)] += o
  return acc


def analyse(profile, steps: int, min_gap_us: float, top: int):
  dev, host = _device_events(profile), _host_events(profile)
  totals = collections.defaultdict(lambda: [0, 0.0, 0.0])
  for plane, s, e, name in host:
    t = totals[(plane, name)]
    t[0] += 1
    t[1] += (e - s) / 1e6
    t[2] = max(t[2], (e - s) / 1e3)
  if not dev:
    return None, totals
  gs = gaps(dev, min_gap_us * 1e3)
  idle_ms = sum(ge - gs_ for gs_, ge, *_ in gs) / 1e6 / steps
  over = overlap_by_name(gs, host)
  big = sorted(gs, key=lambda g: g[0] - g[1])[:top]
  return dict(n=len(gs) / steps, idle_ms=idle_ms, over=over, big=big), totals


def report(name, res, totals, base_totals, steps, top) -> list[str]:
  out = ["", f"#### {name}", ""]
  g = res[0]
  if g is None:
    out.append("No GPU stream lines in the trace (a CPU backend).")
  else:
    out += [
      f"Device gaps: {g['n']:.0f} per step, {g['idle_ms']:.2f} ms per step.",
      "",
      "| host plane | event overlapping the gaps | ms per step |",
      "|---|---|---|",
    ]
    for (plane, ev), ns in g["over"].most_common(top):
      out.append(f"| {plane} | `{ev}` | {ns / 1e6 / steps:.3f} |")
    out += ["", "Largest gaps (us; kernel before -> after, stream):", ""]
    for gs_, ge, before, after in g["big"]:
      b = f"{before[0][:50]} ({before[1][:12]})" if before else "-"
      out.append(f"- {(ge - gs_) / 1e3:.0f} us: `{b}` -> `{after[0][:50]} ({after[1][:12]})`")
  slow = sum(c for (_, ev), (c, _, _) in totals.items() if ev.endswith("cache_miss"))
  if slow >= steps:  # the third H200 run: a jaxpr effect cost single_gpu 0.6-6 ms a step
    out += [
      "",
      f"**jit dispatched through Python {slow / steps:.0f}x a step** (pjit's `cache_miss`): "
      "its C++ fast path is off, e.g. for an effect in the step's jaxpr.",
    ]
  out += [
    "",
    "Host events, most time per step (count, ms, longest us; + vs the first variant):",
    "",
  ]
  rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
  for (plane, ev), (c, ms, mx) in rows:
    diff = ""
    if base_totals is not None:
      b = base_totals.get((plane, ev), (0, 0.0, 0.0))[1]
      diff = f" ({(ms - b) / steps:+.3f})"
    out.append(f"- {plane} `{ev}`: {c / steps:.0f}x, {ms / steps:.3f} ms, max {mx:.0f} us{diff}")
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.gpu_gaps",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("--model", default="demo_cnn")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--min-gap", type=float, default=10.0, help="us")
  ap.add_argument("--top", type=int, default=12)
  ap.add_argument("--variants", nargs="+", default=list(DEFAULT), choices=list(VARIANTS))
  ap.add_argument("--dry", action="store_true", help="tiny sizes (CPU)")
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  loss_fn, args, kw, desc = case(a.model, 4 if a.dry else a.batch, a.dry)
  lines = _report.header(f"Device gaps against host events, {desc}") + [
    f"Measured: {a.steps} jitted SGD steps per variant under `jax.profiler.trace` "
    f"(after 3 warm-up steps); gaps: no stream running for >= {a.min_gap:g} us. "
    "Host time overlapping the gaps is summed per event name (nested events each count).",
  ]
  base = None
  for name in a.variants:
    t0 = time.perf_counter()
    step = sgd_step(variant_grad(name), loss_fn, kw)
    _, prof = trace(step, args, a.steps)
    res = analyse(prof, a.steps, a.min_gap, a.top)
    lines += report(name, res, res[1], base, a.steps, a.top)
    base = res[1] if base is None else base
    print(f"{name}: compiled+traced in {time.perf_counter() - t0:.1f} s", flush=True)
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
