"""Pipeline schedules on real parallel hardware: one stage per process, one core each.

  python -m benchmarks.pipeline_mp                   # unshaped localhost, print the table
  python -m benchmarks.pipeline_mp --link-gbit 1     # and again over a 1 Gbit/s loopback
  python -m benchmarks.pipeline_mp --write           # append the tables to RESULTS.md
  python -m benchmarks.pipeline_mp --tiled 4         # training: 4 steps per call, tiled
  python -m benchmarks.pipeline_mp --predict --rt 1  # predicted beside measured, SCHED_FIFO
  python -m benchmarks.pipeline_mp --link-gbit 0.1 --duplex full  # a full-duplex veth pair

Starts `--stages` worker processes (benchmarks/_pipeline_mp_worker.py), each
pinned to its own core (`taskset`) with one CPU device, joined by
`jax.distributed` on localhost with gloo collectives: the stages really run in
parallel and their activations really cross a (TCP) link. Each runs
`jax.jit(ooo.pipeline.value_and_grad(...))` of SpectraX's residual GELU MLP
(benchmarks/_mlp_model.py) for every schedule; the baseline is the unpipelined
`jax.jit(jax.value_and_grad(loss))` on one core (and the same model accumulated
over the microbatches), timed in every round on process 0's core while its peer
waits, so speedups pair with their round. Timing: warm-up, then rounds
alternating over the schedules, a barrier before each timed step, median per
schedule. `--link-gbit X` runs the stage processes in a network
namespace whose loopback is shaped to X Gbit/s by a tbf qdisc (needs root,
`unshare` and `tc`): both directions share its one queue (half duplex).
`--duplex full` (2 stages) puts each process in its own namespace instead,
joined by a veth pair with a tbf on each end: one queue per direction, as on
Ethernet.

`--tiled N` times training instead (`ooo.pipeline.train`, Adam, per stage
inside the tick loop), per schedule (default zb-h2 and 1f1b): N steps as N
calls of the one-step program (`steps=1`) against one call of the table tiled
over N steps (`steps=N`: step t + 1's warm-up under step t's drain), per step,
rounds alternating, medians; no unpipelined baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import jax
import numpy as np

from benchmarks import _report
from benchmarks._pipeline_mp_predict import (  # noqa: F401 - read as pipeline_mp.<name> too
  _dry_scaled,
  link_model,
  paired,
  predict_table,
  predicted,
  stage_costs,
  tbf_burst,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_pipeline_mp_worker.py")
SCHEDULES = ("gpipe", "1f1b", "ooo", "zb-h1", "zb-h2", "interleaved", "zb-v")
# also: "ooo-link" (ooo planned on the startup calibration, with --predict) and
# "ooo-auto" (a short measured trial at startup picks the fastest of the planned
# table, ooo at 1F1B's depth, GPipe's and 1F1B's: `depth.trial_tables`)


# tbf: the bucket holds one timer tick (1 ms) of the rate and at least a few
# packets: a larger bucket lets a whole activation through at loopback speed
# (a 1 MB bucket did: 0.1 Gbit/s changed nothing). The loopback's MTU drops to
# Ethernet's so a packet fits such a bucket; 50 ms of queue drops nothing.
def tbf(gbit: float) -> str:
  return f"tbf rate {gbit}gbit burst {int(tbf_burst(gbit))} latency 50ms"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


# glibc hands a freed block of more than 32 MiB (its largest mmap threshold) back to
# the kernel, and XLA:CPU allocates each execution's temp buffer anew: a program
# whose temp exceeds 32 MiB (GPipe at m = 8 here: 33.7 MiB) page-faults all of it
# on every step, 8400 faults and 10-20 ms per process (RESULTS.md, issue 34). A
# GPU runtime pools its memory; `--malloc pool` (the default) makes glibc keep
# freed memory too, so each step times its schedule, not its first touches.
POOL_MALLOC = {
  "MALLOC_MMAP_MAX_": "0",  # never mmap a block: it would be unmapped when freed
  "MALLOC_TRIM_THRESHOLD_": str(1 << 30),  # never give the heap's top back
  "MALLOC_TOP_PAD_": str(64 << 20),
  "MALLOC_ARENA_MAX": "1",  # threads' arenas are mmap'd heaps that shrink on free
}


def worker_env() -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  if os.environ.get("PIPELINE_MP_MALLOC", "pool") == "pool":
    env = {**POOL_MALLOC, **env}  # a value the caller set wins
  env.update(
    JAX_PLATFORMS="cpu",
    # PIPELINE_MP_XLA_FLAGS: extra XLA flags for the workers (probes)
    XLA_FLAGS=" ".join(
      ["--xla_force_host_platform_device_count=1", os.environ.get("PIPELINE_MP_XLA_FLAGS", "")]
    ).strip(),
    PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])),
  )
  return env


def _pinned(core: int | None, cfg: dict) -> list[str]:
  # cfg["cmd"]: another worker (a peer's, `benchmarks/vs_torch.py`) in the same harness
  cmd = [*cfg.get("cmd", [sys.executable, WORKER]), json.dumps(cfg)]
  # --rt: SCHED_FIFO, so that a worker woken by its peer's bytes preempts whatever
  # else runs on its core at once (the kernel's fair scheduler lets the running
  # task finish its slice first: ms per wake-up on a shared host)
  if os.environ.get("PIPELINE_MP_RT") and shutil.which("chrt"):
    cmd = ["chrt", "-f", os.environ["PIPELINE_MP_RT"], *cmd]
  if core is None or shutil.which("taskset") is None:
    return cmd
  return ["taskset", "-c", str(core), *cmd]


def wait_workers(procs, timeout: float = 3600) -> None:
  """Waits for every worker; the first to fail ends the others at once.

  A failed worker's peers would wait on it in a collective until `timeout`:
  ending them there makes a failure quick. `timeout` only stops a hang (a
  healthy run on a busy machine must never reach it).
  """
  logs: list[str] = [""] * len(procs)

  def read(i: int) -> None:
    logs[i] = procs[i].communicate()[0] or ""

  readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
  for t in readers:
    t.start()
  deadline = time.monotonic() + timeout
  hung = False
  while any(t.is_alive() for t in readers):
    failed = any(p.poll() not in (None, 0) for p in procs)
    hung = time.monotonic() > deadline
    if failed or hung:
      for q in procs:
        if q.poll() is None:
          q.kill()
      break
    time.sleep(0.2)
  for t in readers:
    t.join()
  if hung:
    raise RuntimeError(f"a worker ran past {timeout:.0f} s (hung?)")
  # the worker that failed first, not the peers ended for it (killed: -9)
  bad = sorted((p.returncode == -9, i) for i, p in enumerate(procs) if p.returncode != 0)
  if bad:
    i = bad[0][1]
    raise RuntimeError(f"worker {i} exited {procs[i].returncode}:\n{logs[i][-3000:]}")


def run_workers(cfg: dict, n: int, cores=None, timeout: float = 3600) -> None:
  """Runs `n` stage processes (process i pinned to cores[i]) on a fresh port."""
  port = free_port()
  cores = list(cores) if cores is not None else list(range(n))
  procs = [
    subprocess.Popen(
      _pinned(
        cores[i % len(cores)],
        {**cfg, "mode": "pipeline", "process_id": i, "num_processes": n, "port": port},
      ),
      env=worker_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(n)
  ]
  wait_workers(procs, timeout)


def run_baseline(cfg: dict, core: int = 0, timeout: float = 3600) -> dict:
  with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, "base.json")
    p = subprocess.Popen(
      _pinned(core, {**cfg, "mode": "baseline", "out": out}),
      env=worker_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    wait_workers([p], timeout)
    with open(out) as f:
      return json.load(f)


def run_shaped(cfg: dict, n: int, cores, gbit: float, timeout: float = 3600) -> None:
  """`run_workers` inside a new network namespace whose loopback is shaped to `gbit`."""
  missing = [t for t in ("unshare", "tc", "ip") if shutil.which(t) is None]
  if missing or os.geteuid() != 0:
    raise RuntimeError(
      f"--link-gbit needs root and unshare/tc/ip (missing: {missing}, uid {os.geteuid()})"
    )
  # PIPELINE_MP_NETNS: extra shell commands run inside the namespace first (probes:
  # e.g. a sysctl of the namespace's TCP buffers)
  extra = os.environ.get("PIPELINE_MP_NETNS", "true")
  script = (
    f'ip link set lo mtu 1500 up && tc qdisc add dev lo root {tbf(gbit)} && {extra} && exec "$@"'
  )
  inner = [
    sys.executable,
    "-m",
    "benchmarks.pipeline_mp",
    "--_spawn",
    json.dumps({"cfg": cfg, "n": n, "cores": list(cores), "timeout": timeout}),
  ]
  p = subprocess.run(
    ["unshare", "-n", "sh", "-c", script, "sh", *inner],
    cwd=ROOT,
    env=worker_env(),
    capture_output=True,
    text=True,
    timeout=timeout + 60,
  )
  if p.returncode != 0:
    raise RuntimeError(f"shaped run failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")


def run_veth(cfg: dict, n: int, cores, gbit: float, timeout: float = 3600) -> None:
  """`run_workers` over a full-duplex link: process 0 and 1 each in its own network
  namespace, joined by a veth pair whose two ends are each shaped to `gbit` by their
  own tbf (an Ethernet link: one queue per direction, unlike `run_shaped`'s one
  loopback queue both ways). The namespaces go away afterwards, also on failure."""
  if n != 2:
    raise RuntimeError("--duplex full joins exactly 2 stage processes (one veth pair)")
  if shutil.which("ip") is None or shutil.which("tc") is None or os.geteuid() != 0:
    raise RuntimeError(f"--duplex full needs root and ip/tc (uid {os.geteuid()})")
  tag = f"ooo{os.getpid()}"
  ns, dev, addr = [f"{tag}a", f"{tag}b"], [f"{tag}va", f"{tag}vb"], ["10.9.0.1", "10.9.0.2"]

  def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)

  try:
    for x in ns:
      sh("ip", "netns", "add", x)
    sh("ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
    for i in range(2):
      sh("ip", "link", "set", dev[i], "netns", ns[i])
      sh("ip", "-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", dev[i])
      sh("ip", "-n", ns[i], "link", "set", dev[i], "mtu", "1500", "up")
      sh("ip", "-n", ns[i], "link", "set", "lo", "up")
      sh(
        "ip",
        "netns",
        "exec",
        ns[i],
        "tc",
        "qdisc",
        "add",
        "dev",
        dev[i],
        "root",
        *tbf(gbit).split(),
      )
    port = free_port()
    procs = [
      subprocess.Popen(
        ["ip", "netns", "exec", ns[i]]
        + _pinned(
          cores[i % len(cores)],
          {
            **cfg,
            "mode": "pipeline",
            "process_id": i,
            "num_processes": n,
            "port": port,
            "coordinator": addr[0],
            "gloo_hostname": addr[i],  # gloo binds here (the host name is 127.0.0.1)
          },
        ),
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
      for i in range(n)
    ]
    wait_workers(procs, timeout)
  finally:
    for x in ns:  # deleting a namespace deletes its veth end, and so the pair
      subprocess.run(["ip", "netns", "del", x], capture_output=True)


def measure(cfg: dict, n: int, cores, gbit: float | None, full: bool = False) -> dict:
  with tempfile.TemporaryDirectory() as d:
    out = os.path.join(d, "stages.json")
    cfg = {**cfg, "out": out, "gbit": gbit, "full_duplex": full}
    if gbit is None:
      run_workers(cfg, n, cores)
    elif full:
      run_veth(cfg, n, cores, gbit)
    else:
      run_shaped(cfg, n, cores, gbit)
    with open(out) as f:
      return json.load(f)


def _over(num: list, den: list) -> float:
  """The median of per-round ratios `num / den` where both have one time per
  round (paired by round), else the ratio of the medians."""
  if len(num) == len(den):
    return float(np.median(np.asarray(num) / np.asarray(den)))
  return float(np.median(num) / np.median(den))


def table(results: dict, base: dict, n: int, link: str) -> list[str]:
  # The one-core steps timed inside this run's rounds (process 0's core, its peer
  # idle), where the run has them: speedups are then paired by round. Runs saved
  # before that use the baseline processes run before and after the stages.
  inner = results.get("_one_core")
  base = inner or base
  ms_of = lambda k: base[k]["ms"]  # noqa: E731
  med = lambda k: float(np.median(ms_of(k)))  # noqa: E731
  b = med("baseline")
  where = (
    "timed in every round on process 0's core, its peer idle; speedups below are "
    "paired by round (the median of per-round ratios)"
    if inner
    else "in processes of their own before and after the stages"
  )
  lines = [
    f"Link: {link}. One core ({where}): unpipelined jax.value_and_grad {b:.1f} ms; the same "
    "model accumulated over the microbatches (the pipeline's kernels) "
    + ", ".join(f"{med(k):.1f} ms at {k.split('/')[1]}" for k in base if k.startswith("accum/"))
    + f" (medians of {len(ms_of('baseline'))}).",
    "",
    f"| schedule | microbatches | step (ms), median [min-max] | x 1 core, unpipelined | "
    f"x 1 core, same microbatches | ideal {n}(1 - bubble) | same microbatches / ideal "
    "| ticks with a transfer / ticks | their ppermutes' share of the step |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  if any(k.startswith("executor/") for k in base):
    lines[0] += (
      " The executor on one core (a one-stage 1F1B table, same microbatches) / "
      "accumulated: "
      + ", ".join(
        f"{_over(ms_of(k), ms_of('accum/' + k.split('/')[1])):.2f}x at {k.split('/')[1]}"
        for k in base
        if k.startswith("executor/")
      )
      + " (its own overhead)."
    )
  link = results.get("_link")
  if link:
    lines[0] += (
      f" One ppermute of an activation ({link['bytes'] / 1024:.1f} KiB, both ways) "
      f"in a loop: {float(np.median(link['ppermute_ms'])):.2f} ms (median)."
    )
  pp = float(np.median(link["ppermute_ms"])) if link else None
  for key, r in results.items():
    if key.startswith("_"):
      continue
    if "error" in r:
      lines.append(f"| {r['schedule']} | {r['microbatches']} | failed: {r['error']} | | | | | | |")
      continue
    ms = float(np.median(r["ms"]))
    ideal = n * (1 - r["bubble"])
    # paired only where the one-core steps ran in the same rounds
    over = lambda k: _over(ms_of(k), r["ms"]) if inner else med(k) / ms  # noqa: E731
    over_b, over_acc = over("baseline"), over(f"accum/{r['microbatches']}")
    lines.append(
      f"| {r['schedule']} | {r['microbatches']} | {ms:.1f} [{min(r['ms']):.1f}-"
      f"{max(r['ms']):.1f}] | {over_b:.2f}x | {over_acc:.2f}x | {ideal:.2f}x | "
      f"{over_acc / ideal:.2f} | {r.get('transfer_ticks', '?')} / "
      f"{r.get('exec_ticks', '?')} | "
      + (f"{r['transfer_ticks'] * pp / ms:.2f} |" if pp and "transfer_ticks" in r else "|")
    )
  return lines


def verdict(results: dict, link: str) -> list[str]:
  """Whether ooo beats gpipe and 1f1b at each microbatch count: the ratio of the
  medians, and paired by round (the best of the two in a round over ooo's step
  in it: a round runs fast or slow as a whole on a shared host)."""
  out = []
  ok = {k: r for k, r in results.items() if not k.startswith("_") and "error" not in r}
  med = {(r["schedule"], r["microbatches"]): float(np.median(r["ms"])) for r in ok.values()}
  for m in sorted({k[1] for k in med}):
    for mine in ("ooo", "ooo-link", "ooo-auto"):
      if (mine, m) not in med:
        continue
      vs = [
        f"{other} {med[(other, m)] / med[(mine, m)]:.2f}x"
        for other in ("gpipe", "1f1b")
        if (other, m) in med
      ]
      r = ok[f"{mine}/{m}"]
      trial = (
        f" (the trial picked {r['picked']}: "
        + ", ".join(f"{lab} {float(np.median(t)):.1f}" for lab, t in r["trial_ms"].items())
        + " ms, medians)"
        if "picked" in r
        else ""
      )
      pair = _paired(ok, r, m, ("gpipe", "1f1b"), mine, "the better of them")
      # the bar is "at the same memory": only those holding no more than it
      within = tuple(
        o for o in ("gpipe", "1f1b") if ok.get(f"{o}/{m}", {}).get("peak", 1e9) <= r.get("peak", 0)
      )
      if within and len(within) < 2:
        pair += _paired(ok, r, m, within, mine, f"{within[0]}, the one within its memory")
      out.append(
        f"- {link}, {m} microbatches: {mine}'s speedup over "
        + ", ".join(vs)
        + f" (> 1: {mine} faster){pair}{trial}."
      )
  return out


def _paired(ok: dict, r: dict, m: int, others, mine: str, what: str) -> str:
  """`mine`'s step paired by round against the best of `others` in the round."""
  rounds = [ok[f"{o}/{m}"]["ms"] for o in others if f"{o}/{m}" in ok]
  if not rounds or any(len(x) != len(r["ms"]) for x in rounds):
    return ""
  per = np.min(rounds, axis=0) / np.asarray(r["ms"])
  return (
    f"; paired by round over {what}: median {np.median(per):.2f}x "
    f"[{per.min():.2f}-{per.max():.2f}], {mine} faster in {int(np.sum(per > 1))} "
    f"of {len(per)} rounds"
  )


def tiled_table(res: dict, n: int, link: str) -> list[str]:
  lines = [
    f"Link: {link}. Per training step (ms), {n} steps: {n} calls of the one-step "
    f"train program vs one call of the program tiled over {n} steps.",
    "",
    "| schedule | microbatches | steps=1, x"
    + str(n)
    + " calls | steps="
    + str(n)
    + ", one call | tiled speedup | simulated bubble, one step / tiled |",
    "|---|---|---|---|---|---|",
  ]
  for key in sorted({k.rsplit("/", 1)[0] for k in res}):
    one, til = res.get(f"{key}/one", {}), res.get(f"{key}/tiled", {})
    name, m = key.split("/")
    if "error" in one or not til:
      lines.append(f"| {name} | {m} | failed: {one.get('error')} | | | |")
      continue
    a, b = float(np.median(one["ms"])), float(np.median(til["ms"]))
    span = lambda r: f"[{min(r['ms']):.1f}-{max(r['ms']):.1f}]"  # noqa: E731
    lines.append(
      f"| {name} | {m} | {a:.1f} {span(one)} | {b:.1f} {span(til)} | "
      f"{a / b:.2f}x | {one['bubble']:.3f} / {til['bubble']:.3f} |"
    )
  return lines


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
  except (OSError, StopIteration):
    return "unknown CPU"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--stages", type=int, default=2, help="processes, one per core")
  ap.add_argument("--cores", type=int, nargs="*", help="core of each stage (default 0..N-1)")
  ap.add_argument("--schedules", nargs="*", default=list(SCHEDULES))
  ap.add_argument("--microbatches", type=int, nargs="*", default=[8, 16])
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--hidden", type=int, default=1024)
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--rounds", type=int, default=7, help="timed steps per schedule (median)")
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument(
    "--link-gbit",
    type=float,
    nargs="*",
    default=[],
    help="also run over a loopback shaped to this many Gbit/s",
  )
  ap.add_argument(
    "--duplex",
    choices=("half", "full"),
    default="half",
    help="the shaped link: half (both stages in one namespace, one tbf on lo: "
    "both directions share it) or full (2 stages only: a veth pair between two "
    "namespaces, one tbf per direction, as on Ethernet)",
  )
  ap.add_argument(
    "--tiled",
    type=int,
    default=0,
    metavar="N",
    help="time training: N calls of steps=1 vs one call of steps=N",
  )
  ap.add_argument(
    "--layout",
    choices=("device", "virtual"),
    default="device",
    help="row order of the stage stacks (virtual: interleaved / zb-v weights "
    "cross the link every step)",
  )
  ap.add_argument(
    "--predict",
    action="store_true",
    help="measure phase costs and the link in each run, add ooo planned on "
    "that link (ooo-link), print predicted (simulated) beside measured",
  )
  ap.add_argument(
    "--rt",
    type=int,
    default=0,
    metavar="PRIO",
    help="run the workers SCHED_FIFO at this priority (root; chrt): on a shared "
    "host a woken stage then preempts the other tenants at once",
  )
  ap.add_argument(
    "--malloc",
    choices=("pool", "system"),
    default="pool",
    help="the workers' glibc malloc: pool (keep freed memory, as a GPU runtime "
    "does) or system (glibc's defaults: a temp buffer over 32 MiB is mapped and "
    "page-faulted anew on every step)",
  )
  ap.add_argument(
    "--exchange",
    choices=("one_way", "two_way"),
    default="one_way",
    help="the executor's CPU exchange (OOOJAX_CPU_EXCHANGE): one_way (a tick's "
    "two directions in a row) or two_way (one permute: both at once, for a "
    "full-duplex link under --rt)",
  )
  ap.add_argument("--json", help="save all raw timings here")
  ap.add_argument("--from-json", help="print the tables of a run saved with --json")
  ap.add_argument("--write", action="store_true")
  ap.add_argument("--_spawn", help=argparse.SUPPRESS)  # inside the shaped namespace
  args = ap.parse_args(argv)
  if args._spawn:
    a = json.loads(args._spawn)
    run_workers(a["cfg"], a["n"], a["cores"], a["timeout"])
    return
  if args.rt:
    os.environ["PIPELINE_MP_RT"] = str(args.rt)  # the workers' launchers read it
  os.environ["PIPELINE_MP_MALLOC"] = args.malloc  # and worker_env
  os.environ["OOOJAX_CPU_EXCHANGE"] = args.exchange  # the workers' executor, and the replay
  n = args.stages
  cores = args.cores or list(range(n))
  if len(cores) != n:
    raise SystemExit(f"--cores names {len(cores)} cores for {n} stages")
  if n > (os.cpu_count() or 1):
    print(f"warning: {n} stages on {os.cpu_count()} cores: stages share cores", flush=True)
  cfg = {
    k: getattr(args, k)
    for k in (
      "layers",
      "dim",
      "hidden",
      "batch",
      "rounds",
      "warmup",
      "schedules",
      "microbatches",
      "layout",
      "predict",
    )
  }
  if args.predict and "ooo-link" not in cfg["schedules"]:
    cfg["schedules"] = [*cfg["schedules"], "ooo-link"]
  if args.tiled:
    return _main_tiled(args, cfg, n, cores)
  if args.from_json:  # re-print (and re-predict) a saved run
    with open(args.from_json) as f:
      saved = json.load(f)
    base, runs, args.link_gbit = saved["baseline"], saved["runs"], saved.get("gbits", [])
    args.duplex = saved.get("duplex", "half")
    args.exchange = saved.get("exchange", "one_way")
    args.malloc = saved.get("malloc", "system")  # runs saved before --malloc
    os.environ["OOOJAX_CPU_EXCHANGE"] = args.exchange
  full = args.duplex == "full"
  if not args.from_json:
    base = run_baseline(cfg, cores[0])
    runs = {"unshaped localhost": measure(cfg, n, cores, None)}
    for g in args.link_gbit:
      runs[shaped_name(g, full)] = measure(cfg, n, cores, g, full)
    # The baseline again after the stage runs, pooled: load drift hits both sides.
    for k, v in run_baseline(cfg, cores[0]).items():
      base[k]["ms"] += v["ms"]
  lines = _report.header("Pipeline schedules, one stage per process (benchmarks/pipeline_mp.py)")
  lines += [
    f"**Measured** on {_cpu_name()}: {n} processes, each pinned to its own core with one "
    f"jax CPU device, jax.distributed + gloo over localhost TCP; model: {args.layers} "
    f"residual blocks x + gelu(LN(x) W1) W2, D={args.dim}, H={args.hidden}, batch "
    f"{args.batch}, MSE, float32; {args.rounds} timed rounds alternating over the "
    f"schedules after {args.warmup} warm-up steps; stage stacks in {args.layout} "
    f"order; glibc malloc {'pooled (--malloc pool)' if args.malloc == 'pool' else 'as the system sets it'}"
    f"{', SCHED_FIFO workers' if args.rt else ''}"
    f"{', two-way exchanges (--exchange two_way)' if args.exchange == 'two_way' else ''}. Ideal = {n} x (1 - bubble fraction) "
    "of the table with F = B = W (jax " + jax.__version__ + ").",
    "",
  ]
  gbits = dict(zip(runs, [None, *args.link_gbit]))
  args.predict = args.predict or any("_calibration" in r for r in runs.values())
  for link, res in runs.items():
    lines += table(res, base, n, link) + [""] + verdict(res, link) + [""]
    if args.predict:
      lines += predict_table(res, n, link, gbits[link], full) + [""]
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {
          "baseline": base,
          "runs": runs,
          "gbits": args.link_gbit,
          "duplex": args.duplex,
          "exchange": args.exchange,
          "malloc": args.malloc,
        },
        f,
        indent=1,
      )
  _report.emit(lines, args.write)


def shaped_name(gbit: float, full: bool) -> str:
  if full:
    return f"veth pair shaped to {gbit:g} Gbit/s each way (tbf, full duplex)"
  return f"loopback shaped to {gbit:g} Gbit/s (tbf)"


def _main_tiled(args, cfg, n, cores):
  if args.tiled < 2:
    raise SystemExit("--tiled N needs N >= 2 steps per call")
  if args.schedules == list(SCHEDULES):  # not given: the two the issue compares
    cfg["schedules"] = ["zb-h2", "1f1b"]
  cfg["tiled"] = args.tiled
  runs = {"unshaped localhost": measure(cfg, n, cores, None)}
  for g in args.link_gbit:
    runs[shaped_name(g, args.duplex == "full")] = measure(cfg, n, cores, g, args.duplex == "full")
  lines = _report.header(
    "Pipeline training tiled over steps, one stage per process (benchmarks/pipeline_mp.py --tiled)"
  )
  lines += [
    f"**Measured** on {_cpu_name()}: {n} processes, each pinned to its own core, "
    f"jax.distributed + gloo over localhost TCP; model: {args.layers} residual "
    f"blocks, D={args.dim}, H={args.hidden}, batch {args.batch}, MSE, float32, Adam "
    f"inside the tick loop; {args.rounds} timed rounds alternating after "
    f"{args.warmup} warm-up rounds (jax {jax.__version__}). Simulated bubble: "
    "F = B = W, free update; tiled: over the whole tiled run.",
    "",
  ]
  for link, res in runs.items():
    lines += tiled_table(res, args.tiled, link) + [""]
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"runs": runs}, f, indent=1)
  _report.emit(lines, args.write)


if __name__ == "__main__":
  main()
