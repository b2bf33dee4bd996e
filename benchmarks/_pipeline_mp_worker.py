"""One process of the multi-process pipeline benchmark (or of its baseline).

Usage: python benchmarks/_pipeline_mp_worker.py CONFIG_JSON
Started by `benchmarks/pipeline_mp.py` (and tests/test_pipeline_mp.py), one per
pipeline stage, each pinned to its own core, with JAX_PLATFORMS=cpu and
XLA_FLAGS=--xla_force_host_platform_device_count=1 in its environment: one CPU
device per process, the stages talk over gloo (TCP on localhost).

CONFIG_JSON keys: mode ("pipeline" or "baseline"), process_id, num_processes,
port, layers, dim, hidden, batch, schedules, microbatches, rounds, warmup,
out, and check (true: save loss and gradients to `out` (.npz) instead of
timing). Process 0 writes `out`; the baseline is one process, no jax.distributed.
With tiled (an int n >= 2), the pipeline processes time training instead
(`_tiled`): n calls of `ooo.pipeline.train(..., steps=1)` against one call of
the n-step tiled program, per schedule and microbatch count.
"""

import json
import os
import sys
import time

cfg = json.loads(sys.argv[1])
# Set by the launcher; repeated here for a worker started by hand (jax reads
# them when it is imported and when the backend starts).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402

pid, nproc = cfg.get("process_id", 0), cfg.get("num_processes", 1)
if cfg["mode"] == "pipeline":
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # collectives across processes
  jax.distributed.initialize(f"localhost:{cfg['port']}", num_processes=nproc, process_id=pid)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ooojax as ooo  # noqa: E402
from benchmarks import _mlp_model as model  # noqa: E402


def _time_once(f, *args) -> float:
  # Both processes start the step together (barrier) so process 0 times the same
  # step its peer runs, and the barrier's own cost stays outside the timing.
  if nproc > 1:
    multihost_utils.sync_global_devices("pipeline_mp")
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  return time.perf_counter() - t0


def _gathered(results) -> dict:
  """`{key: (loss, {name: array})}` sharded over the processes, gathered whole so
  process 0 can save it: `{key/loss, key/name: ndarray}`."""
  flat = {}
  for key, (loss, arrays) in results.items():
    flat[f"{key}/loss"] = np.asarray(multihost_utils.process_allgather(loss, tiled=True))
    for k, a in arrays.items():
      flat[f"{key}/{k}"] = np.asarray(multihost_utils.process_allgather(a, tiled=True))
  return flat


def _baseline():
  """One core: the unpipelined step, and the same model accumulated over each
  microbatch count (the pipeline's kernels without a pipeline), alternating."""
  params = jax.tree.map(
    jax.numpy.asarray, model.make_params(1, cfg["layers"], cfg["dim"], cfg["hidden"])
  )
  batch = tuple(map(jax.numpy.asarray, model.make_batch(cfg["batch"], cfg["dim"])))
  steps = {"baseline": jax.jit(jax.value_and_grad(model.flat_loss))}
  steps.update({f"accum/{m}": jax.jit(model.accumulated(m)) for m in cfg["microbatches"]})
  out = {}
  for k, step in steps.items():
    t0 = time.perf_counter()
    for _ in range(cfg["warmup"]):
      jax.block_until_ready(step(params, batch))
    out[k] = {"ms": [], "compile_s": time.perf_counter() - t0}
  for _ in range(cfg["rounds"]):
    for k, step in steps.items():
      out[k]["ms"].append(_time_once(step, params, batch) * 1e3)
  return out


def _pipeline():
  devs = jax.devices()
  if len(devs) != nproc:
    raise RuntimeError(
      f"expected one device per process ({nproc}), got {len(devs)}: "
      "set XLA_FLAGS=--xla_force_host_platform_device_count=1"
    )
  mesh = jax.sharding.Mesh(np.array(devs), ("stage",))
  rep = NamedSharding(mesh, P())
  x, t = model.make_batch(cfg["batch"], cfg["dim"])
  batch = tuple(jax.make_array_from_process_local_data(rep, a, a.shape) for a in (x, t))
  runs, out = {}, {}
  for name in cfg["schedules"]:
    for m in cfg["microbatches"]:
      key = f"{name}/{m}"
      try:
        sched = ooo.pipeline.schedule(name, stages=nproc, microbatches=m)
        v = sched.virtual_stages
        full = model.make_params(v, cfg["layers"], cfg["dim"], cfg["hidden"])
        # Stage params sharded on the stage axis: this process holds its rows.
        per = v // nproc
        params = {
          k: jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("stage")), a[pid * per : (pid + 1) * per], a.shape
          )
          for k, a in full.items()
        }
        step = jax.jit(
          ooo.pipeline.value_and_grad(
            model.stage_fn, model.loss_fn, mesh=mesh, axis_name="stage", schedule=sched
          )
        )
        t0 = time.perf_counter()
        for _ in range(max(1, cfg["warmup"])):
          res = jax.block_until_ready(step(params, batch))
        out[key] = {
          "schedule": name,
          "microbatches": m,
          "ms": [],
          "compile_s": time.perf_counter() - t0,
          "bubble": sched.bubble_fraction(),
          "ticks": sched.ticks,
        }
        runs[key] = (step, params, res)
      except Exception as e:  # noqa: BLE001 - a schedule that cannot run is a result
        out[key] = {
          "schedule": name,
          "microbatches": m,
          "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",
        }
      print(
        f"[{pid}] {key}: {out[key].get('error') or 'compiled, %.1f s' % out[key]['compile_s']}",
        flush=True,
      )
  if cfg.get("check"):
    # Gradients are sharded over the processes: gather them so process 0 saves all.
    return _gathered({key: (loss, grads) for key, (_, _, (loss, grads)) in runs.items()})
  # Rounds alternate between schedules, so drift (the other core's load) hits all alike.
  for _ in range(cfg["rounds"]):
    for key, (step, params, _) in runs.items():
      out[key]["ms"].append(_time_once(step, params, batch) * 1e3)
  return out


def _tiled():
  """n steps of training two ways, per (schedule, microbatches): `one` runs n calls
  of the one-step train program (each step's updates inside its own tick loop),
  `tiled` one call of the table tiled over n steps (step t + 1's warm-up under
  step t's drain). Both time n steps from the same state; rounds alternate."""
  import optax

  n = int(cfg["tiled"])
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("stage",))
  rep, stage = NamedSharding(mesh, P()), NamedSharding(mesh, P("stage"))
  x, t = model.make_batch(cfg["batch"], cfg["dim"])
  # n different batches (rolled rows), stacked on a leading steps axis
  xs, ts = (np.stack([np.roll(a, k, axis=0) for k in range(n)]) for a in (x, t))
  batches = tuple(jax.make_array_from_process_local_data(rep, a, a.shape) for a in (xs, ts))
  opt = optax.adam(1e-4)
  runs, out = {}, {}
  for name in cfg["schedules"]:
    for m in cfg["microbatches"]:
      key = f"{name}/{m}"
      try:
        v = ooo.pipeline.schedule(name, stages=nproc, microbatches=m).virtual_stages
        full = model.make_params(v, cfg["layers"], cfg["dim"], cfg["hidden"])
        per = v // nproc
        local = (
          lambda a: jax.make_array_from_process_local_data(  # noqa: E731
            stage, a[pid * per : (pid + 1) * per], a.shape
          )
        )
        params = {k: local(a) for k, a in full.items()}
        state = jax.jit(jax.vmap(opt.init), out_shardings=stage)(params)
        kw = dict(mesh=mesh, axis_name="stage", schedule=name, microbatches=m)
        one = jax.jit(ooo.pipeline.train(model.stage_fn, model.loss_fn, opt, steps=1, **kw))
        many = jax.jit(ooo.pipeline.train(model.stage_fn, model.loss_fn, opt, steps=n, **kw))
        slices = [jax.tree.map(lambda b, k=k: b[k : k + 1], batches) for k in range(n)]

        def ones(p, o, one=one, slices=slices):
          losses = []
          for b in slices:
            p, o, l = one(p, o, b)
            losses.append(l)
          return p, o, jax.numpy.concatenate(losses)

        t0 = time.perf_counter()
        res = {}
        for _ in range(max(1, cfg["warmup"])):
          res = {
            "one": jax.block_until_ready(ones(params, state)),
            "tiled": jax.block_until_ready(many(params, state, batches)),
          }
        for k, (fn, args) in {
          "one": (ones, (params, state)),
          "tiled": (many, (params, state, batches)),
        }.items():
          out[f"{key}/{k}"] = {
            "schedule": name,
            "microbatches": m,
            "how": k,
            "ms": [],
            "steps": n,
            "compile_s": time.perf_counter() - t0,
          }
          runs[f"{key}/{k}"] = (fn, args, res[k])
        sched = ooo.pipeline.schedule(name, stages=nproc, microbatches=m)
        st = sched.steady_state(steps=n) if n >= 2 else None
        out[f"{key}/one"]["bubble"] = sched.bubble_fraction()
        out[f"{key}/tiled"]["bubble"] = st.bubble if st else sched.bubble_fraction()
      except Exception as e:  # noqa: BLE001 - a schedule that cannot run is a result
        out[f"{key}/one"] = {
          "schedule": name,
          "microbatches": m,
          "how": "one",
          "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",
        }
      print(f"[{pid}] {key}: {out[f'{key}/one'].get('error') or 'compiled'}", flush=True)
  if cfg.get("check"):
    return _gathered({key: (losses, p) for key, (_, _, (p, _, losses)) in runs.items()})
  for _ in range(cfg["rounds"]):
    for key, (fn, args, _) in runs.items():
      out[key]["ms"].append(_time_once(fn, *args) * 1e3 / n)  # per step
  return out


if cfg["mode"] == "baseline":
  result = _baseline()
else:
  result = _tiled() if cfg.get("tiled") else _pipeline()
if pid == 0:
  if cfg.get("check"):
    np.savez(cfg["out"], **result)
  else:
    with open(cfg["out"], "w") as f:
      json.dump(result, f, indent=1)
if nproc > 1:
  jax.distributed.shutdown()
