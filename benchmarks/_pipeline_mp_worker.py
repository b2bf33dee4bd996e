"""One process of the multi-process pipeline benchmark (or of its baseline).

Usage: python benchmarks/_pipeline_mp_worker.py CONFIG_JSON
Started by `benchmarks/pipeline_mp.py` (and tests/test_pipeline_mp.py), one per
pipeline stage, each pinned to its own core, with JAX_PLATFORMS=cpu and
XLA_FLAGS=--xla_force_host_platform_device_count=1 in its environment: one CPU
device per process, the stages talk over gloo (TCP on localhost).

CONFIG_JSON keys: mode ("pipeline" or "baseline"), process_id, num_processes,
port, layers, dim, hidden, batch, schedules, microbatches, rounds, warmup,
layout ("device", the default, or "virtual": the stage stacks' row order), out,
and check (true: save loss and gradients to `out` (.npz) instead of
timing), one_core_rounds (default true: process 0 also times the one-core
steps in every round, `_one_core` in `out`). Process 0 writes `out`; the baseline is one process, no jax.distributed.
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
  if cfg.get("gloo_hostname"):  # --duplex full: bind gloo to this namespace's veth address
    from jaxlib import _jax

    _make_gloo = _jax.make_gloo_tcp_collectives
    _jax.make_gloo_tcp_collectives = lambda **kw: _make_gloo(
      **{**kw, "hostname": cfg["gloo_hostname"]}
    )
  jax.distributed.initialize(
    f"{cfg.get('coordinator', 'localhost')}:{cfg['port']}", num_processes=nproc, process_id=pid
  )

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


def _one_core_steps():
  """One core: the unpipelined step, the same model accumulated over each
  microbatch count (the pipeline's kernels without a pipeline), and the executor
  itself on a one-stage 1F1B table over the same microbatches (against accum/m:
  its own overhead, record copies and per-tick dispatch, with no parallelism and
  no link). `{key: (step, params, batch)}` on this process's first device."""
  dev = jax.local_devices()[0]
  put = lambda a: jax.device_put(a, dev)  # noqa: E731
  params = jax.tree.map(put, model.make_params(1, cfg["layers"], cfg["dim"], cfg["hidden"]))
  batch = tuple(map(put, model.make_batch(cfg["batch"], cfg["dim"])))
  steps = {"baseline": jax.jit(jax.value_and_grad(model.flat_loss))}
  steps.update({f"accum/{m}": jax.jit(model.accumulated(m)) for m in cfg["microbatches"]})
  mesh = jax.sharding.Mesh(np.array([dev]), ("stage",))
  for m in cfg["microbatches"]:
    sched = ooo.pipeline.schedule("1f1b", stages=1, microbatches=m)
    steps[f"executor/{m}"] = jax.jit(
      ooo.pipeline.value_and_grad(
        model.stage_fn, model.loss_fn, mesh=mesh, axis_name="stage", schedule=sched
      )
    )
  return {k: (f, params, batch) for k, f in steps.items()}


def _baseline():
  """The one-core steps in a process of their own, alternating."""
  steps = _one_core_steps()
  out = {}
  for k, (step, params, batch) in steps.items():
    t0 = time.perf_counter()
    for _ in range(cfg["warmup"]):
      jax.block_until_ready(step(params, batch))
    out[k] = {"ms": [], "compile_s": time.perf_counter() - t0}
  for _ in range(cfg["rounds"]):
    for k, (step, params, batch) in steps.items():
      out[k]["ms"].append(_time_once(step, params, batch) * 1e3)
  return out


LAYOUT = cfg.get("layout", "device")


def _stage_params(mesh, sched) -> dict:
  """The model's stage stacks sharded on the stage axis, this process holding its
  rows: in `LAYOUT` order ("device": its own chunks, so no weight moves; "virtual":
  virtual-stage order, where interleaved / zb-v weights cross every step)."""
  v = sched.virtual_stages
  full = model.make_params(v, cfg["layers"], cfg["dim"], cfg["hidden"])
  if LAYOUT == "device":
    full = {k: a[ooo.pipeline.device_order(sched)] for k, a in full.items()}
  per = v // nproc
  return {
    k: jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("stage")), a[pid * per : (pid + 1) * per], a.shape
    )
    for k, a in full.items()
  }


def _median_s(f, *args, reps: int = 15) -> float:
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


class _Calibration:
  """Measured inputs of the simulator, taken at startup (before the timed rounds:
  the prediction is made from them) and again between the rounds (to show the
  drift). Per microbatch count, on this process's stage (the first or the last),
  each a jitted loop over the microbatches (no per-call dispatch in the figure):

  - F, B (dX) and W (dW): a loop of forwards, of forward + dX, of forward + dX +
    dW; F = the first / M, B and W the differences. They are then scaled by the
    executor itself: a one-stage `ooo` table (F, B, W split) over this stage's
    layers and the same microbatches, on this process's own device (no link),
    against M x (F + B + W). That factor holds what the executor adds to each
    action (record packing, slot writes, its loop).
  - The link: a loop of exchanges of one microbatch's activation around the
    ring, sent as the executor sends them (`_exchange_loop`); per transfer
    (`exchange`). Runs saved before it hold an older probe (`transfer`: a
    forward then a send per tick, less the forwards), which also priced the
    wait for the slower forward that the replay counts (RESULTS.md).

  Each table's compute is measured apart, in the timed rounds: the same step with
  every exchange replaced by zeros (`_dry`).
  """

  LOOP = 20

  def __init__(self, mesh):
    import jax.numpy as jnp
    from jax import lax

    self.fns, self.samples = {}, {}
    self.permutes = len(_groups(mesh))
    full = model.make_params(nproc, cfg["layers"], cfg["dim"], cfg["hidden"])
    p = {k: jnp.asarray(a[pid]) for k, a in full.items()}
    one = jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("stage",))
    xb, tb = (jnp.asarray(a) for a in model.make_batch(cfg["batch"], cfg["dim"]))
    p1 = {k: a[None] for k, a in p.items()}
    last = pid == nproc - 1
    L = self.LOOP

    for m in cfg["microbatches"]:
      rows = cfg["batch"] // m
      xs, ts = (a.reshape(m, rows, -1) for a in (xb, tb))
      f = (
        (lambda p, x, t: model.loss_fn(model.stage_fn(p, x), t))
        if last
        else (lambda p, x, t: model.stage_fn(p, x))
      )

      def loop(kind, f=f):
        # Each phase's outputs are accumulated, as the executor accumulates dW
        # (and writes dX, y): summing them to a scalar instead made a reduce of
        # every dW, which priced W at 2x its cost in the executor (RESULTS.md).
        def run(p, xs, ts):
          def one(acc, xt):
            ay, ap = acc
            x, t = xt
            if kind == "F":
              return (ay + f(p, x, t), ap), None
            y, pb = jax.vjp(lambda p, x: f(p, x, t), p, x)
            g = jnp.ones_like(y)
            if kind == "FB":  # dX only: the weights' cotangent is never formed
              _, pbx = jax.vjp(lambda x: f(p, x, t), x)
              return (ay + pbx(g)[0], ap), None
            dp, dx = pb(g)
            return (ay + dx, jax.tree.map(jnp.add, ap, dp)), None

          y0 = jax.eval_shape(f, p, xs[0], ts[0]) if kind == "F" else xs[0]
          zero = (jnp.zeros(y0.shape, y0.dtype), jax.tree.map(jnp.zeros_like, p))
          return lax.scan(one, zero, (xs, ts))[0]

        return jax.jit(run)

      exe = jax.jit(
        ooo.pipeline.value_and_grad(
          model.stage_fn,
          model.loss_fn,
          mesh=one,
          axis_name="stage",
          schedule=ooo.pipeline.schedule("ooo", stages=1, microbatches=m),
        )
      )
      self.fns[m] = {
        "F": (loop("F"), (p, xs, ts)),
        "FB": (loop("FB"), (p, xs, ts)),
        "FBW": (loop("FBW"), (p, xs, ts)),
        "exec": (exe, (p1, (xb, tb))),
        "link": _exchange_loop(mesh, rows, cfg["dim"] * 4, L),
      }
      self.samples[m] = {k: [] for k in self.fns[m]}

  def sample(self, reps: int) -> None:
    for m, fns in self.fns.items():
      for k, (f, args) in fns.items():
        if k == "link":  # collectives: both processes together
          multihost_utils.sync_global_devices("probe")
        self.samples[m][k].append(_median_s(f, *args, reps=reps))

  def result(self, stat=np.median, first: bool = False) -> dict:
    """Per microbatch count (str): every process's [F, B, W] (executor-scaled) and
    process 0's link probe, `stat` over the samples (`first`: the startup sample
    alone, what the prediction uses)."""
    res = {}
    for m, sm in self.samples.items():
      med = {k: float(v[0] if first else stat(v)) for k, v in sm.items()}
      f = med["F"] / m
      raw = [max(f, 1e-6), max(med["FB"] / m - f, 1e-6), max((med["FBW"] - med["FB"]) / m, 1e-6)]
      scale = med["exec"] / (m * sum(raw))
      ph = [x * scale for x in raw] + [scale]
      allph = np.asarray(multihost_utils.process_allgather(np.array(ph), tiled=False))
      L = self.LOOP
      # per transfer: an exchange is one permute per one-way group, in a row
      lk = [med["link"] / L / self.permutes]
      # process 0's probe on every process: both must plan the same table
      got = np.asarray(multihost_utils.process_allgather(np.array(lk), tiled=False))[0]
      res[str(m)] = {
        "phases": allph[:, :3].tolist(),
        "scale": allph[:, 3].tolist(),
        "link": {
          "exchange": float(got[0]),
          "nbytes": cfg["batch"] // m * cfg["dim"] * 4,
        },
      }
    return res


def _table(name: str, m: int, calib: dict):
  """The named table; "ooo-link": ooo planned on the measured link and costs."""
  if name != "ooo-link":
    return ooo.pipeline.schedule(name, stages=nproc, microbatches=m)
  from benchmarks._pipeline_mp_predict import link_model, stage_costs
  from ooojax.passes.pipeline.depth import plan_ooo

  c = calib[str(m)]
  sched, _ = plan_ooo(
    nproc, m, stage_costs(c, nproc), link_model(c, cfg.get("gbit"), cfg.get("full_duplex", False))
  )
  return sched


TRIAL = 7  # ooo-auto: timed steps of each candidate, alternating (after one warm-up)


def _compiled(sched, mesh, batch):
  """(jitted step, its stage params, the warm-up's result) of one table."""
  params = _stage_params(mesh, sched)
  step = jax.jit(
    ooo.pipeline.value_and_grad(
      model.stage_fn, model.loss_fn, mesh=mesh, axis_name="stage", schedule=sched, layout=LAYOUT
    )
  )
  res = None
  for _ in range(max(1, cfg["warmup"])):
    res = jax.block_until_ready(step(params, batch))
  return step, params, res


def _dry(sched, mesh, batch):
  """`_compiled` with every exchange replaced by zeros: the table's own compute
  (its actions, slot writes, idle ticks, run concurrently with the other
  process's) with no link and no waits. Its gradients are wrong; only its time
  is read (`--predict`: the replay's compute is scaled to it)."""
  from ooojax.passes.pipeline import ticks

  real = ticks._permute
  ticks._permute = lambda x, *a, **k: jax.numpy.zeros_like(x)
  try:  # the patch is read while the step traces: at its first (warm-up) call
    return _compiled(sched, mesh, batch)
  finally:
    ticks._permute = real


def _auto(m: int, calib: dict, mesh, batch):
  """ooo-auto: the measured runs decide. The candidates of
  `depth.trial_tables` (ooo planned on the startup calibration when there is
  one, ooo at 1F1B's depth, GPipe's and 1F1B's tables) each run TRIAL steps,
  alternating, in `ooo.pipeline.tune`: process 0's times pick for both
  processes. Returns (table, label, {label: trial ms})."""
  from ooojax.pipeline import tune

  link = costs = None
  if str(m) in calib:
    from benchmarks._pipeline_mp_predict import link_model, stage_costs

    c = calib[str(m)]
    costs, link = (
      stage_costs(c, nproc),
      link_model(c, cfg.get("gbit"), cfg.get("full_duplex", False)),
    )

  def build(t):
    step, params, _ = _compiled(t, mesh, batch)
    return lambda: step(params, batch)

  _, tuned = tune(build, (), stages=nproc, microbatches=m, link=link, costs=costs, rounds=TRIAL)
  return tuned.schedule, tuned.label, {k: list(v) for k, v in tuned.times.items()}


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
  cal = _Calibration(mesh) if cfg.get("predict") else None
  if cal is not None:  # the startup sample: ooo-link is planned and every cell predicted on it
    cal.sample(reps=10)
  calib = cal.result(first=True) if cal is not None else {}
  for name in cfg["schedules"]:
    for m in cfg["microbatches"]:
      key = f"{name}/{m}"
      try:
        extra = {}
        if name == "ooo-auto":
          sched, label, trial = _auto(m, calib, mesh, batch)
          extra = {"picked": label, "trial_ms": trial}
        else:
          sched = _table(name, m, calib)
        t0 = time.perf_counter()
        step, params, res = _compiled(sched, mesh, batch)
        out[key] = {
          **extra,
          "schedule": name,
          "microbatches": m,
          "ms": [],
          "compile_s": time.perf_counter() - t0,
          "bubble": sched.bubble_fraction(),
          "peak": max(sched.peak_activations()),
          "ticks": sched.ticks,
          **_ticks(sched, params, batch),
          "table": sched.to_text(),
        }
        runs[key] = (step, params, res)
        if cal is not None:
          runs[key + "/dry"] = _dry(sched, mesh, batch)
          out[key]["dry_ms"] = []
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
    return _gathered(
      {key: (loss, grads) for key, (_, _, (loss, grads)) in runs.items() if "/dry" not in key}
    )
  # Rounds alternate between schedules, so drift (the other core's load) hits all alike.
  probe = _ppermute_probe(mesh, batch[0].shape[1] * 4, max(cfg["microbatches"]))
  # The one-core steps run in every round too, on process 0's core while its peer
  # waits in the probe's exchange: a schedule's speedup over one core is then
  # paired with the same round (the host's state moves whole rounds together).
  one = _one_core_steps() if pid == 0 and cfg.get("one_core_rounds", True) else {}
  for k, (f, p, b) in one.items():
    for _ in range(cfg["warmup"]):
      jax.block_until_ready(f(p, b))
  out_one = {k: {"ms": []} for k in one}
  for _ in range(cfg["rounds"]):
    for key, (step, params, _) in runs.items():
      dry = key.endswith("/dry")
      ms = _time_once(step, params, batch) * 1e3
      out[key.removesuffix("/dry")]["dry_ms" if dry else "ms"].append(ms)
    for k, (f, p, b) in one.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(p, b))
      out_one[k]["ms"].append((time.perf_counter() - t0) * 1e3)
    probe()
    if cal is not None:
      cal.sample(reps=3)
  out["_link"] = {"ppermute_ms": probe.ms, "bytes": probe.bytes}
  if out_one:
    out["_one_core"] = out_one
  if cal is not None:
    out["_calibration"] = calib  # the startup sample
    out["_calibration_median"] = cal.result()
    out["_calibration_min"] = cal.result(np.min)
  return out


def _ticks(sched, params, batch) -> dict:
  """The executor's ticks (the unfused table) and those that carry a transfer
  (a lag-0 tick with one waits for it: each costs one ppermute's latency)."""
  from ooojax.passes.pipeline.plan import F
  from ooojax.passes.pipeline.program import program

  pl = program(model.stage_fn, model.loss_fn, sched, params, batch).plan
  busy = np.zeros(pl.rows.shape[0], bool)
  for ring, pats in pl.patterns.items():
    busy |= np.array([bool(pats[k]) for k in pl.rows[:, 0, F[f"{ring}_pat"]]])
  return {"exec_ticks": int(pl.rows.shape[0]), "transfer_ticks": int(busy.sum())}


def _groups(mesh) -> list:
  """The permutes of one exchange around the ring, as the executor sends them
  (`execute.one_way`: on CPU one-way permutes in a row)."""
  from ooojax.passes.pipeline.execute import one_way
  from ooojax.passes.pipeline.link import one_way_groups

  pairs = [(k, (k + 1) % nproc) for k in range(nproc)]
  return one_way_groups(pairs) if one_way(mesh) else [pairs]


def _exchange_loop(mesh, rows: int, row_bytes: int, n: int):
  """(jitted f, its args): a loop of `n` lag-0-style exchanges of one activation
  around the ring (each device sends one and receives one, `_groups`), in one
  program."""
  groups = _groups(mesh)

  def exchange(c, _):
    return sum(jax.lax.ppermute(c, "stage", list(g)) for g in groups), None

  def body(x):
    return jax.lax.scan(exchange, x, None, length=n)[0]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("stage"), out_specs=P("stage")))
  x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("stage")),
    np.ones((rows, row_bytes // 4), np.float32),
    (nproc * rows, row_bytes // 4),
  )
  jax.block_until_ready(f(x))
  return f, (x,)


def _ppermute_probe(mesh, row_bytes, micro):
  """`_exchange_loop` of 50 exchanges: `probe()` times it, `probe.ms` collects
  ms per exchange. What each of a step's transfer ticks costs on this link
  (latency, the processes' wake-ups)."""
  n, rows = 50, cfg["batch"] // micro
  f, args = _exchange_loop(mesh, rows, row_bytes, n)

  def probe():
    probe.ms.append(_time_once(f, *args) * 1e3 / n)

  probe.ms, probe.bytes = [], rows * row_bytes
  return probe


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
        params = _stage_params(mesh, ooo.pipeline.schedule(name, stages=nproc, microbatches=m))
        state = jax.jit(jax.vmap(opt.init), out_shardings=stage)(params)
        kw = dict(mesh=mesh, axis_name="stage", schedule=name, microbatches=m, layout=LAYOUT)
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
