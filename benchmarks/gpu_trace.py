"""Where a step's GPU time goes: a profiler trace of each variant, summarised.

The first GPU run (RESULTS.md, 2026-11-27, H100, jax 0.11.2) measured
`ooo.grad(mode="single_gpu")` at 0.51-0.72x jax.grad's step, although the
compiled schedule holds every planned overlap window. Step time alone cannot
say why. This traces a few jitted SGD steps of each variant
(`jax.profiler.trace`, CUPTI on a GPU) and reads the device's stream lines:

* wall: host time per step around the traced loop;
* span: first kernel start to last kernel end, per step;
* busy: time any stream runs a kernel or copy; idle = span - busy (launch and
  synchronisation gaps);
* 2+ streams: time two or more streams run at once (the overlap itself);
* kernel time: the sum of kernel durations; "shared" sums only the kernels
  whose names jax.grad's step also runs, so it rises when the same kernels
  run slower beside each other (contention) or more often; "own" counts the
  kernels jax.grad's step never runs (copies, concatenations, layouts).

Per stream it lists the kernels per step and their time. `--hlo-dir` also
writes each variant's compiled HLO (this device's layouts and algorithms).

  python -m benchmarks.gpu_trace --model demo_cnn --batch 32
  python -m benchmarks.gpu_trace --model resnet50 --batch 32 --hlo-dir /tmp/hlo

On a machine with no GPU the trace has no stream lines: the table says so and
keeps the wall time (the CPU dry run of benchmarks/gpu.sh checks the path).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import pathlib
import tempfile
import time

import jax

from benchmarks import _report
from benchmarks.step_time import VARIANTS, case, sgd_step, variant_grad

DEFAULT = ("jax.grad", "ooo single_gpu", "ooo single_gpu (none)", "ooo in_order")


_DERIVED = frozenset(
  {
    "XLA Modules",
    "XLA Ops",
    "Steps",
    "TensorFlow Ops",
    "TensorFlow Name Scope",
    "Launch Stats",
    "Source code",
    "XLA TraceMe",
    "Framework Name Scope",
    "Framework Ops",
  }
)


@dataclasses.dataclass(frozen=True)
class Summary:
  """One variant's device time per step, in milliseconds (see the module doc)."""

  span: float
  busy: float
  both: float
  kernel: float
  streams: tuple[tuple[str, float, float], ...]  # (line name, kernels per step, ms per step)
  kernels: dict  # kernel name -> (count, total ms) over the traced steps

  @property
  def idle(self) -> float:
    return self.span - self.busy


def _union_and_overlap(intervals):
  """(time covered by any interval, time covered by two or more)."""
  edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
  depth, last, any_, two = 0, None, 0.0, 0.0
  for t, d in edges:
    if last is not None:
      any_ += (t - last) if depth >= 1 else 0.0
      two += (t - last) if depth >= 2 else 0.0
    depth, last = depth + d, t
  return any_, two


def summarize(profile, steps: int) -> Summary | None:
  """The device stream lines of a `jax.profiler.ProfileData`, per step; None
  when the trace has no GPU stream lines (a CPU backend)."""
  device = [ln for p in profile.planes if p.name.startswith("/device:GPU") for ln in p.lines]
  # CUPTI's lines are "Stream #<id>(...)"; the others are derived from them
  # ("XLA Ops", "XLA Modules", "Steps", ...). Should the naming change, every
  # line not known to be derived is taken, and the table names them.
  lines = [ln for ln in device if ln.name.startswith("Stream")] or [
    ln for ln in device if ln.name not in _DERIVED
  ]
  events = {ln.name: [(e.start_ns, e.end_ns, e.name) for e in ln.events] for ln in lines}
  flat = [ev for evs in events.values() for ev in evs]
  if not flat:
    return None
  per = 1e6 * steps  # ns over the traced steps -> ms per step
  busy, both = _union_and_overlap([(s, e) for s, e, _ in flat])
  span = max(e for _, e, _ in flat) - min(s for s, _, _ in flat)
  kernels: dict = collections.defaultdict(lambda: [0, 0.0])
  for s, e, name in flat:
    kernels[name][0] += 1
    kernels[name][1] += (e - s) / 1e6
  streams = tuple(
    (name, len(evs) / steps, sum(e - s for s, e, _ in evs) / per)
    for name, evs in sorted(events.items())
    if evs
  )
  return Summary(
    span=span / per,
    busy=busy / per,
    both=both / per,
    kernel=sum(e - s for s, e, _ in flat) / per,
    streams=streams,
    kernels={k: tuple(v) for k, v in kernels.items()},
  )


def shared_ms(s: Summary, base: Summary, steps: int) -> tuple[float, float]:
  """Per step, (base's, this variant's) time in the kernels both run."""
  names = s.kernels.keys() & base.kernels.keys()
  return (
    sum(base.kernels[k][1] for k in names) / steps,
    sum(s.kernels[k][1] for k in names) / steps,
  )


def own(s: Summary, base: Summary, steps: int) -> tuple[float, float]:
  """Per step, (count, ms) of the kernels whose names base's step never runs
  (the copies, concatenations and layout changes a variant adds)."""
  names = s.kernels.keys() - base.kernels.keys()
  return (
    sum(s.kernels[k][0] for k in names) / steps,
    sum(s.kernels[k][1] for k in names) / steps,
  )


def trace(step, args, steps: int, warmup: int = 3):
  """(wall seconds per step, ProfileData) of `steps` calls of `step` traced."""
  from jax.profiler import ProfileData

  for _ in range(warmup):
    jax.block_until_ready(step(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      t0 = time.perf_counter()
      for _ in range(steps):
        out = step(*args)
      jax.block_until_ready(out)
      wall = (time.perf_counter() - t0) / steps
    (pb,) = pathlib.Path(d).rglob("*.xplane.pb")
    return wall, ProfileData.from_file(str(pb))


def _executor_cases(m: int, tiny: bool):
  """The pipeline executor beside the accumulated step (benchmarks.executor_cost)."""
  import numpy as np

  from benchmarks import _mlp_model, executor_cost

  sizes = (2, 16, 32, 16) if tiny else (8, 256, 1024, 256)  # layers, D, H, batch
  params = _mlp_model.make_params(1, *sizes[:3])
  batch = _mlp_model.make_batch(sizes[3], sizes[1])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("stage",))
  steps = executor_cost.steps(m, mesh, params, batch)
  order = (f"loop accumulated/{m}", f"loop automatic/{m}", f"accumulated/{m}", f"executor/{m}")
  cases = {k: (jax.jit(steps[k][0]), steps[k][1]) for k in order}
  desc = f"pipeline executor, one stage, {m} microbatches, D={sizes[1]}"
  return cases, desc, "calls"


def table(rows: dict, steps: int) -> list[str]:
  """rows: variant -> (wall s, Summary or None); the first row is the base."""
  base = next(iter(rows.values()), (None, None))[1]
  out = [
    "| variant | wall ms | span ms | busy ms | idle ms | 2+ streams ms | kernel ms "
    "| shared kernels ms (the first row's) | own kernels: count, ms | per stream: kernels, ms |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, (wall, s) in rows.items():
    if s is None:
      out.append(f"| {name} | {wall * 1e3:.2f} | no GPU stream lines in the trace | | | | | | | |")
      continue
    shared = extra = "-"
    if base is not None and s is not base:
      b, v = shared_ms(s, base, steps)
      shared = f"{v:.2f} ({b:.2f})"
      extra = "{:.0f}, {:.2f}".format(*own(s, base, steps))
    per = "; ".join(f"{n}: {k:.0f}, {ms:.2f}" for n, k, ms in s.streams)
    out.append(
      f"| {name} | {wall * 1e3:.2f} | {s.span:.2f} | {s.busy:.2f} | {s.idle:.2f} "
      f"| {s.both:.2f} | {s.kernel:.2f} | {shared} | {extra} | {per} |"
    )
  return out


def top_kernels(rows: dict, steps: int, n: int) -> list[str]:
  out = []
  for name, (_, s) in rows.items():
    if s is None:
      continue
    top = sorted(s.kernels.items(), key=lambda kv: -kv[1][1])[:n]
    out += ["", f"Top {n} kernels, {name} (per step: count, ms):", ""]
    out += [f"- {c / steps:.0f}x {ms / steps:.3f} ms `{k[:110]}`" for k, (c, ms) in top]
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.gpu_trace",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("--model", default="demo_cnn")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--tiny", action="store_true", help="the zoo model's tiny (CPU) size")
  ap.add_argument("--steps", type=int, default=5, help="steps traced per variant")
  ap.add_argument("--variants", nargs="+", default=list(DEFAULT), choices=list(VARIANTS))
  ap.add_argument("--top", type=int, default=6, help="heaviest kernels listed per variant")
  ap.add_argument(
    "--executor",
    type=int,
    metavar="M",
    help="instead: the pipeline executor's one-stage step over M microbatches beside "
    "the accumulated one (benchmarks.executor_cost's model and steps; its ticks' gaps)",
  )
  ap.add_argument("--hlo-dir", help="write each variant's compiled HLO here (gzipped)")
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  tag = f"executor{a.executor}" if a.executor else a.model  # names the HLO files
  if a.executor:
    cases, desc, what = _executor_cases(a.executor, a.tiny)
  else:
    loss_fn, args, kw, desc = case(a.model, a.batch, a.tiny)
    cases = {n: (sgd_step(variant_grad(n), loss_fn, kw), args) for n in a.variants}
    what = "jitted SGD steps"
  rows = {}
  for name, (step, args) in cases.items():
    t0 = time.perf_counter()
    if a.hlo_dir:
      d = pathlib.Path(a.hlo_dir)
      d.mkdir(parents=True, exist_ok=True)
      slug = "".join(c if c.isalnum() else "_" for c in f"{tag}_{name}")
      text = step.lower(*args).compile().as_text()
      with gzip.open(d / f"{slug}.hlo.gz", "wt") as f:
        f.write(text)
    wall, prof = trace(step, args, a.steps)
    rows[name] = (wall, summarize(prof, a.steps))
    print(f"{name}: compiled+traced in {time.perf_counter() - t0:.1f} s", flush=True)
  lines = _report.header(f"Device trace, {desc}") + [
    f"Measured: {a.steps} {what} per variant under `jax.profiler.trace` "
    "(after 3 warm-up steps), per step. busy: any stream running; idle: span - busy; "
    "2+ streams: two or more streams running at once; shared kernels: kernels "
    f"with the same name in {next(iter(cases))}'s step (its time in brackets).",
    "",
    *table(rows, a.steps),
    *top_kernels(rows, a.steps, a.top),
  ]
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
