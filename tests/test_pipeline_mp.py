"""2 processes, one pipeline stage each (jax.distributed + gloo on localhost), give
jax.grad of the unpipelined model: the benchmark's worker code path, small model."""

import dataclasses
import os

import jax
import numpy as np
import pytest

import ooojax as ooo
from benchmarks import _mlp_model as model, pipeline_mp

SIZES = {"layers": 4, "dim": 32, "hidden": 64, "batch": 16}
SCHEDULES = pipeline_mp.SCHEDULES  # every one; interleaved / zb-v: 4 virtual stages
M = 4


def _run(cfg):
  """Two stage processes, one core each where there are two."""
  try:
    # no time limit but the hang guard's: a failed worker ends its peer at once
    pipeline_mp.run_workers(cfg, 2, cores=None if (os.cpu_count() or 1) >= 2 else [0])
  except RuntimeError as e:
    # The one public sign of a jaxlib without them: the workers fail to set them up.
    if "gloo" in str(e).lower() and "collectives" in str(e).lower():
      pytest.skip(f"gloo CPU collectives unavailable: {str(e)[-300:]}")
    raise


def test_two_stage_processes_match_jax_grad(tmp_path):
  out = str(tmp_path / "grads.npz")
  cfg = {
    **SIZES,
    "schedules": list(SCHEDULES),
    "microbatches": [M],
    "rounds": 0,
    "warmup": 1,
    "check": True,
    "out": out,
  }
  _run(cfg)
  got = dict(np.load(out))
  params = model.make_params(2, SIZES["layers"], SIZES["dim"], SIZES["hidden"])
  batch = model.make_batch(SIZES["batch"], SIZES["dim"])
  with jax.default_matmul_precision("highest"):
    loss, grads = jax.jit(jax.value_and_grad(model.flat_loss))(params, batch)
  for name in SCHEDULES:
    key = f"{name}/{M}"
    np.testing.assert_allclose(got[f"{key}/loss"], loss, rtol=1e-5, atol=1e-6)
    # the stacks come back in device order (the worker's layout): to virtual stages
    back = np.argsort(ooo.pipeline.device_order(ooo.pipeline.schedule(name, 2, M)))
    for k in ("w1", "w2"):
      # (V, layers / V, ...) stacks of the same layers in the same order
      assert got[f"{key}/{k}"].size == grads[k].size
      np.testing.assert_allclose(
        got[f"{key}/{k}"][back].reshape(grads[k].shape),
        grads[k],
        rtol=1e-5,
        atol=1e-6,
        err_msg=f"{name} d{k}",
      )


def test_tiled_training_mode_matches_optax_loop(tmp_path):
  # the --tiled benchmark's plumbing: 2 calls of steps=1 and one call of steps=2
  # (zb-h2, Adam inside the tick loop) give the plain optax loop's 2 steps
  import optax

  out = str(tmp_path / "tiled.npz")
  cfg = {
    **SIZES,
    "schedules": ["zb-h2"],
    "microbatches": [M],
    "rounds": 0,
    "warmup": 1,
    "check": True,
    "out": out,
    "tiled": 2,
  }
  _run(cfg)
  got = dict(np.load(out))
  params = jax.tree.map(
    jax.numpy.asarray, model.make_params(2, SIZES["layers"], SIZES["dim"], SIZES["hidden"])
  )
  x, t = model.make_batch(SIZES["batch"], SIZES["dim"])
  opt = optax.adam(1e-4)
  state, losses = opt.init(params), []
  with jax.default_matmul_precision("highest"):
    for k in range(2):
      loss, g = jax.jit(jax.value_and_grad(model.flat_loss))(
        params, (np.roll(x, k, axis=0), np.roll(t, k, axis=0))
      )
      u, state = opt.update(g, state, params)
      params = optax.apply_updates(params, u)
      losses.append(loss)
  for how in ("one", "tiled"):
    np.testing.assert_allclose(got[f"zb-h2/{M}/{how}/loss"], losses, rtol=1e-5, atol=1e-6)
    for k in ("w1", "w2"):
      np.testing.assert_allclose(
        got[f"zb-h2/{M}/{how}/{k}"], params[k], rtol=1e-5, atol=1e-6, err_msg=f"{how} {k}"
      )


def test_a_failed_worker_ends_its_peers():
  """A worker that fails ends the one waiting on it (no time limit decides anything)."""
  import subprocess
  import sys

  procs = [
    subprocess.Popen(
      [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for code in ("import time; time.sleep(600)", "print('boom'); raise SystemExit(3)")
  ]
  with pytest.raises(RuntimeError, match=r"worker 1 exited 3:\nboom"):
    pipeline_mp.wait_workers(procs)
  assert procs[0].returncode is not None  # ended, not left running


def test_full_duplex_link_model_prices_each_direction_apart():
  """`--duplex full` (a veth pair, one tbf per direction) predicts on a duplex link:
  the same latency and wire as the half-duplex loopback (125 kB at 0.1 Gbit/s: 10
  ms, the probe's 11 ms less it: 1 ms), each direction its own resource. The CPU
  executor sends the two directions in a row (`one_way`), so there that changes
  little; sent together (`one_way=False`), 1F1B's activation up and gradient down
  no longer share the wire, and its step is shorter."""
  from ooojax.passes.pipeline.generate import generate
  from ooojax.passes.pipeline.link import simulate_link

  calib = {"link": {"nbytes": 125e3, "transfer": 0.011, "gap": 0.0}}
  half, full = (pipeline_mp.link_model(calib, 0.1, f) for f in (False, True))
  assert (half.duplex, full.duplex) == (False, True)
  for lk in (half, full):
    assert lk.wire == pytest.approx(0.01) and lk.latency == pytest.approx(0.001)
  costs = {"F": 0.01, "B": 0.01, "W": 0.01}
  f = generate("1f1b", 2, 4)
  span = {
    lk.duplex: simulate_link(f, costs, dataclasses.replace(lk, one_way=False)).makespan
    for lk in (half, full)
  }
  assert span[True] < span[False]


def test_workers_pool_freed_memory_unless_told_not_to(monkeypatch):
  """`--malloc pool` (the default): glibc keeps freed memory, so a step whose temp
  buffer exceeds 32 MiB is not mapped and page-faulted anew every step; a value
  the caller set wins, and `--malloc system` leaves glibc's defaults. The
  priced exchange follows OOOJAX_CPU_EXCHANGE (`--exchange`)."""
  monkeypatch.delenv("PIPELINE_MP_MALLOC", raising=False)
  monkeypatch.setenv("MALLOC_TOP_PAD_", "1")
  env = pipeline_mp.worker_env()
  assert env["MALLOC_MMAP_MAX_"] == "0" and env["MALLOC_ARENA_MAX"] == "1"
  assert env["MALLOC_TOP_PAD_"] == "1"
  monkeypatch.delenv("MALLOC_TOP_PAD_")
  monkeypatch.setenv("PIPELINE_MP_MALLOC", "system")
  assert not set(pipeline_mp.POOL_MALLOC) & set(pipeline_mp.worker_env())
  calib = {"link": {"transfer": 1e-4, "gap": 1e-3, "nbytes": 32768}}
  monkeypatch.setenv("OOOJAX_CPU_EXCHANGE", "two_way")
  assert not pipeline_mp.link_model(calib, 0.1, full=True).one_way
  monkeypatch.setenv("OOOJAX_CPU_EXCHANGE", "one_way")
  assert pipeline_mp.link_model(calib, 0.1).one_way


def test_prediction_prices_the_exchange_probe_and_scales_compute_to_the_dry_step():
  """The link is priced from the back-to-back exchange probe (each transfer pays
  its whole wire: 125 kB at 0.1 Gbit/s is 10 ms, the probe's 11 ms less it: 1 ms
  of latency); the compute of each table is scaled so that its busiest device's
  actions take its measured dry step (no exchanges, no waits)."""
  from ooojax.passes.pipeline.generate import generate

  lk = {"nbytes": 125e3, "transfer": 0.5, "gap": 0.0, "exchange": 0.011}
  link = pipeline_mp.link_model({"link": lk}, 0.1)
  assert link.wire == pytest.approx(0.01) and link.latency == pytest.approx(0.001)
  sched = generate("1f1b", 2, 4)
  costs = [{"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 1.0, "B": 1.0, "W": 2.0}]
  scaled = pipeline_mp._dry_scaled(sched, costs, 8.0)
  # the last stage is the busiest: 4 x (1 + 1 + 2) = 16 -> 8, every stage halved
  assert scaled == [{"F": 0.5, "B": 0.5, "W": 0.5}, {"F": 0.5, "B": 0.5, "W": 1.0}]
  calib = {"phases": [[1.0, 1.0, 1.0], [1.0, 1.0, 2.0]], "link": {**lk, "exchange": 0.0}}
  res = {
    "_calibration": {"4": calib},
    "1f1b/4": {"schedule": "1f1b", "microbatches": 4, "ms": [20.0], "dry_ms": [8000.0]},
  }
  with_dry, without = (pipeline_mp.predicted(res, 2, None, dry=d)["1f1b/4"] for d in (1, 0))
  assert with_dry == pytest.approx(without / 2)


def test_prediction_and_verdict_pair_the_rounds():
  """A round runs fast or slow as a whole on a shared host: the prediction paired
  by round scales the replay to that round's dry step and compares it with that
  round's step, where the medians of the two can come from rounds in different
  states; the verdict compares ooo with the better of GPipe and 1F1B per round."""
  calib = {"phases": [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], "link": {"nbytes": 1.0, "exchange": 0.0}}
  res = {"_calibration": {"4": calib}}
  res["1f1b/4"] = {"schedule": "1f1b", "microbatches": 4, "ms": [1.0] * 3, "dry_ms": [1.0] * 3}
  k = pipeline_mp.predicted(res, 2, None)["1f1b/4"] * 1e3  # replay / dry step
  # rounds 1 and 3 fast; the dry step's slow round is not the step's
  res["1f1b/4"].update(ms=[10 * k, 30 * k, 30 * k], dry_ms=[10.0, 10.0, 30.0])
  assert pipeline_mp.paired(res, 2, None)["1f1b/4"] == pytest.approx(1.0)
  assert pipeline_mp.predicted(res, 2, None)["1f1b/4"] * 1e3 / (30 * k) == pytest.approx(1 / 3)
  rounds = {"gpipe": [10.0, 20.0, 10.0], "1f1b": [12.0, 22.0, 11.0], "ooo": [9.0, 21.0, 9.5]}
  res = {f"{s}/8": {"schedule": s, "microbatches": 8, "ms": ms} for s, ms in rounds.items()}
  (line,) = pipeline_mp.verdict(res, "link")
  assert "median 1.05x [0.95-1.11], ooo faster in 2 of 3 rounds" in line
  assert "within its memory" not in line  # no peaks recorded: nothing to tell apart
  # the bar is "at the same memory": GPipe holds 8, ooo and 1F1B 2
  for s, peak in (("gpipe", 8), ("1f1b", 2), ("ooo", 2)):
    res[f"{s}/8"]["peak"] = peak
  (line,) = pipeline_mp.verdict(res, "link")
  assert "over 1f1b, the one within its memory: median 1.16x [1.05-1.33]" in line


def test_speedup_over_one_core_pairs_the_rounds_it_was_timed_in():
  """The one-core steps timed inside the run's rounds (`_one_core`) pair each
  schedule's speedup with its round; a run without them falls back on the
  separate baseline's medians."""
  one = {"baseline": {"ms": [40.0, 60.0, 40.0]}, "accum/8": {"ms": [60.0, 90.0, 60.0]}}
  one["executor/8"] = {"ms": [72.0, 108.0, 72.0]}
  cell = {"schedule": "1f1b", "microbatches": 8, "ms": [30.0, 45.0, 45.0], "bubble": 0.0}
  row = lambda lines: next(x for x in lines if x.startswith("| 1f1b"))  # noqa: E731
  lines = pipeline_mp.table({"1f1b/8": cell, "_one_core": one}, {}, 2, "link")
  # per round 2, 2, 4/3: the median 2.00 (the medians' ratio would be 60 / 45)
  assert "| 1.33x | 2.00x | 2.00x | 1.00 |" in row(lines)
  assert "paired by round" in lines[0] and "1.20x at 8" in lines[0]
  lines = pipeline_mp.table({"1f1b/8": cell}, one, 2, "link")
  assert "| 0.89x | 1.33x | 2.00x | 0.67 |" in row(lines)
