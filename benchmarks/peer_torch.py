"""torch.distributed.pipelining on pipeline_mp's model: one stage process's worker.

Run by `benchmarks/vs_torch.py` with the peer's own Python (a venv with torch,
never a dependency of ooojax: `python3.11 -m venv .venv-torch &&
.venv-torch/bin/pip install torch==2.13.0 numpy`), one process per stage,
pinned and launched as `benchmarks/pipeline_mp.py` launches its own workers
(the same cores, the same shaped loopback). It imports neither jax nor ooojax.

The model is `benchmarks/_mlp_model.py`'s: `layers` blocks
`x + gelu(LN(x) @ w1) @ w2` (LN without parameters, tanh GELU as jax's
default), MSE loss, float32, the same weights. One thread per process
(`torch.set_num_threads(1)`), gloo over TCP. Each timed step runs between two
barriers, so it is the slower process's step, as ooojax's steps end in a
collective. Process 0 writes `{"<schedule>/<m>": {"ms": [...]}}` to `out`.
"""

from __future__ import annotations

import json
import sys
import time

# ooojax's names -> torch's schedule classes, and where the virtual stages live
SCHEDULES = {
  "gpipe": ("ScheduleGPipe", "one"),
  "1f1b": ("Schedule1F1B", "one"),
  "interleaved": ("ScheduleInterleaved1F1B", "loop"),
  "zb-interleaved": ("ScheduleInterleavedZeroBubble", "loop"),
  "zb-v": ("ScheduleZBVZeroBubble", "v"),
  "dualpipe-v": ("ScheduleDualPipeV", "v"),
}


def _stages_of(rank: int, n: int, placement: str) -> list[int]:
  if placement == "one":
    return [rank]
  if placement == "loop":  # chunk c of rank r: stage c * n + r
    return [rank, rank + n]
  return [rank, 2 * n - 1 - rank]  # a V: rank 0 holds the first and the last


def main(cfg: dict) -> None:
  import numpy as np
  import torch
  import torch.distributed as dist
  import torch.nn.functional as F
  from torch.distributed import pipelining as pp

  torch.set_num_threads(1)
  L, D, H, B = cfg["layers"], cfg["dim"], cfg["hidden"], cfg["batch"]
  # _mlp_model.make_params(1, ...) and make_batch: the same numbers as ooojax's runs
  rng = np.random.default_rng(0)
  w1 = (rng.standard_normal((L, D, H)) / D**0.5).astype(np.float32)
  w2 = (rng.standard_normal((L, H, D)) * 0.5 / H**0.5).astype(np.float32)
  rng = np.random.default_rng(1)
  x = torch.from_numpy(rng.standard_normal((B, D)).astype(np.float32))
  t = torch.from_numpy(rng.standard_normal((B, D)).astype(np.float32))

  class Blocks(torch.nn.Module):
    # one parameter per layer, as torch models hold them (the zero-bubble
    # schedules' weight-gradient pass fails on slices of one stacked parameter)
    def __init__(self, lo: int, hi: int):
      super().__init__()
      par = lambda a: torch.nn.Parameter(torch.from_numpy(a.copy()))  # noqa: E731
      self.w1 = torch.nn.ParameterList([par(w1[j]) for j in range(lo, hi)])
      self.w2 = torch.nn.ParameterList([par(w2[j]) for j in range(lo, hi)])

    def forward(self, h):
      for a, b in zip(self.w1, self.w2):
        h = h + F.gelu(F.layer_norm(h, (D,), eps=1e-5) @ a, approximate="tanh") @ b
      return h

  def loss_fn(y, target):
    return F.mse_loss(y, target)

  if cfg["mode"] == "baseline":
    return _baseline(cfg, Blocks(0, L), loss_fn, x, t)
  rank, n = cfg["process_id"], cfg["num_processes"]
  dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=n
  )

  runs = {}
  for name in cfg["schedules"]:
    cls, placement = SCHEDULES[name]
    ids = _stages_of(rank, n, placement)
    V = n * len(ids)
    per = L // V
    for m in cfg["microbatches"]:
      stages = [
        pp.PipelineStage(Blocks(s * per, (s + 1) * per), s, V, torch.device("cpu")) for s in ids
      ]
      Sched = getattr(pp, cls)
      if len(stages) == 1:
        sched = Sched(stages[0], n_microbatches=m, loss_fn=loss_fn)
      else:
        sched = Sched(stages, n_microbatches=m, loss_fn=loss_fn)
      args = (x,) if 0 in ids else ()
      kw = {"target": t, "losses": []} if V - 1 in ids else {}
      mods = [s.submod for s in stages]

      def step(sched=sched, args=args, kw=kw, mods=mods):
        for mod in mods:
          mod.zero_grad(set_to_none=True)
        if "losses" in kw:
          kw["losses"].clear()
        dist.barrier()
        t0 = time.perf_counter()
        sched.step(*args, **kw)
        dist.barrier()
        return time.perf_counter() - t0

      runs[f"{name}/{m}"] = step
  out = {
    k: {"schedule": k.split("/")[0], "microbatches": int(k.split("/")[1]), "ms": []} for k in runs
  }
  for step in runs.values():
    for _ in range(max(1, cfg["warmup"])):
      step()
  for _ in range(cfg["rounds"]):  # rounds alternate over the schedules
    for k, step in runs.items():
      out[k]["ms"].append(step() * 1e3)
  calib = _calibrate(cfg, Blocks, loss_fn, x, t, rank, n)
  if rank == 0:
    out["_calibration"] = calib
    out["_meta"] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    with open(cfg["out"], "w") as f:
      json.dump(out, f)
  dist.destroy_process_group()


def _calibrate(cfg: dict, Blocks, loss_fn, x, t, rank: int, n: int, reps: int = 5) -> dict:
  """What `benchmarks.vs_torch` replays torch's one-chunk tables with: per
  microbatch count, each stage's forward and its full backward (seconds, the
  median of `reps` loops over the microbatches on this process's own stage),
  and one activation's exchange with the peer (a loop of blocking send / recv
  pairs, alternating direction: seconds per transfer). Process 0 gets all."""
  import numpy as np
  import torch
  import torch.distributed as dist

  L = cfg["layers"]
  mod = Blocks(rank * L // n, (rank + 1) * L // n)
  out = {}
  for m in cfg["microbatches"]:
    xs = x.chunk(m)
    ct = torch.ones_like(xs[0])

    def fwd():
      for xm in xs:
        mod(xm.detach().requires_grad_(rank > 0))

    def fwd_bwd():
      for xm, tm in zip(xs, t.chunk(m)):
        y = mod(xm.detach().requires_grad_(rank > 0))
        (loss_fn(y, tm) if rank == n - 1 else (y * ct).sum()).backward()

    times = {}
    for name, f in (("F", fwd), ("FB", fwd_bwd)):
      f()
      ts = []
      for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
      times[name] = float(np.median(ts)) / m
    buf, k = torch.zeros_like(xs[0]), 20
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(k):  # rank i % 2 sends
      if rank == i % 2:
        dist.send(buf, 1 - rank)
      else:
        dist.recv(buf, 1 - rank)
    dist.barrier()
    per = (time.perf_counter() - t0) / k
    got = [None] * n
    dist.all_gather_object(got, [times["F"], times["FB"] - times["F"], per])
    out[str(m)] = {
      "phases": [[f, bw] for f, bw, _ in got],  # forward, full backward
      "exchange": float(np.median([p for _, _, p in got])),
      "nbytes": xs[0].numel() * 4,
    }
  return out


def _baseline(cfg: dict, model, loss_fn, x, t) -> None:
  """One process: the whole model's step (forward, backward) on the batch, and
  accumulated over each microbatch count, alternating (as pipeline_mp's)."""
  import torch

  def whole():
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), t).backward()

  def accumulated(m):
    def run():
      model.zero_grad(set_to_none=True)
      for xm, tm in zip(x.chunk(m), t.chunk(m)):
        (loss_fn(model(xm), tm) / m).backward()

    return run

  steps = {"baseline": whole, **{f"accum/{m}": accumulated(m) for m in cfg["microbatches"]}}
  out = {k: {"ms": []} for k in steps}
  for f in steps.values():
    for _ in range(max(1, cfg["warmup"])):
      f()
  for _ in range(cfg["rounds"]):
    for k, f in steps.items():
      t0 = time.perf_counter()
      f()
      out[k]["ms"].append((time.perf_counter() - t0) * 1e3)
  out["_meta"] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
  with open(cfg["out"], "w") as f:
    json.dump(out, f)


if __name__ == "__main__":
  main(json.loads(sys.argv[1]))
