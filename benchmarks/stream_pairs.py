"""What a second stream costs and gains on this GPU: the one-call experiment that
calibrates single-GPU admission (issue 50; `passes.calibration`).

Two measurements, all variants compiled first, then timed alternating in one process:

* **Per-call cost.** A chain of `--calls` small dots (tanh(h W), batch 32), each
  followed by a side dot (h^T h) that is independent of the chain. The side dots
  run on stream 0 (`serial`), each in its own stream call left to XLA's
  scheduler (`unpinned`), or each in a stream call whose window is pinned around
  the next chain dot by `optimization_barrier`s, as `passes.emit` pins them
  (`pinned`). (variant - serial) / calls is what one call costs beyond its
  kernels. Timed with command buffers (CUDA graphs) on, XLA's default, and off.
* **Pair gain** G = t_serial / t_two: real dX/dW pairs (`PAIRS`: a ResNet-50
  stage-4 3x3 conv, a 1x1 conv, a MobileNet depthwise conv, the 2048x1000 dense
  head, a transformer MLP's up-projection) at batch 32 and 4, `--repeat`
  independent pairs per program. `serial`: each pair's dX then dW on stream 0;
  `two streams`: each dW in a pinned stream call beside its dX; `4 in one call`:
  the dW of four pairs in one call beside their four dX (one call's cost for four).
  G > 1 only where the kernels leave SMs idle; the per-call cost is included (a
  pair's gain must pay for its call), so G_net < 1 where it does not.

It writes a calibration file (`passes.calibration`, format 1) to
`--calibration-dir`/<device>.json: `call_seconds` (unpinned, command buffers on),
`pinned_call_seconds`, `pair_gain` (G per pair and batch) and `source`. The cost
model reads it for that device once it ships in `ooojax/calibration/`.

  PYTHONPATH=. python3 -m benchmarks.stream_pairs --calibration-dir /tmp/cal   # on the GPU
  PYTHONPATH=. python3 -m benchmarks.stream_pairs --dry                          # CPU dry run
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import _report
from ooojax.passes import _compat

CB_OFF = {"xla_gpu_enable_command_buffer": ""}
DN = ("NHWC", "HWIO", "NHWC")

# name: (kind, x shape without batch, w shape, feature groups); conv SAME, stride 1.
# In order of value: a budget cut leaves out the last ones.
PAIRS = {
  "resnet50_stage4_3x3": ("conv", (7, 7, 512), (3, 3, 512, 512), 1),
  "mobilenet_depthwise_3x3": ("conv", (56, 56, 72), (3, 3, 1, 72), 72),
  "resnet50_stage3_1x1": ("conv", (14, 14, 1024), (1, 1, 1024, 256), 1),
  "dense_2048x1000": ("dense", (2048,), (2048, 1000), 1),
  "mlp_up_1024x4096": ("dense", (16, 1024), (1024, 4096), 1),  # 16 tokens a row: 512 at b32
  "resnet50_stage1_3x3": ("conv", (56, 56, 64), (3, 3, 64, 64), 1),
  "mlp_up_1024x4096_8k": ("dense", (256, 1024), (1024, 4096), 1),  # 8192 tokens at b32
}
DRY_PAIRS = {
  "resnet50_stage4_3x3": ("conv", (4, 4, 8), (3, 3, 8, 8), 1),
  "mobilenet_depthwise_3x3": ("conv", (6, 6, 4), (3, 3, 1, 4), 4),
  "dense_2048x1000": ("dense", (16,), (16, 8), 1),
}


def _f(kind, groups):
  if kind == "conv":
    return lambda x, w: lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=DN, feature_group_count=groups
    )
  return lambda x, w: x @ w


def pair_fns(kind, groups):
  """(dX(g, x, w), dW(g, x, w)) of y = f(x, w): jax's own backward ops."""
  f = _f(kind, groups)
  dx = lambda g, x, w: jax.vjp(lambda x_: f(x_, w), x)[1](g)[0]  # noqa: E731
  dw = lambda g, x, w: jax.vjp(lambda w_: f(x, w_), w)[1](g)[0]  # noqa: E731
  return dx, dw


def _flat(x):
  return lax.reshape(x, (x.size,)) if x.ndim >= 2 else x


def pinned(main, side_fun, main_args, side_args, wait=None):
  """`side_fun(*side_args)` (arrays) in one stream call whose window holds `main(*main_args)`,
  pinned as `passes.stream_calls` pins a dW call: the call reads its inputs flat
  and returns one flat buffer; a barrier ties those flat inputs to the main op's
  inputs (the main op cannot start before the call), two chained barriers tie the
  buffer to the main op's output, whose readers read the tied copy (the done
  comes after the main op and before its readers). `wait`: an earlier call's
  output, whose done this call's start follows (XLA:GPU keeps at most two calls
  in flight from jax 0.12, as `passes.slots` plans)."""
  if wait is not None:
    _, side_args = lax.optimization_barrier((wait, list(side_args)))
  shapes = [a.shape for a in side_args]

  def body(*flat):
    outs = side_fun(*[lax.reshape(f, s) for f, s in zip(flat, shapes)])
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return (jnp.concatenate([o.reshape(-1) for o in outs]),)

  flat = [_flat(a) for a in side_args]
  (buf,) = _compat.on_stream(body, 1, 1)(*flat)
  _, tied = lax.optimization_barrier((flat, list(main_args)))
  m = main(*tied)
  tb, _ = lax.optimization_barrier(([buf], m))
  tb, m = lax.optimization_barrier((tb, m))
  return m, _unflat(tb[0], side_fun, side_args)


def _unflat(buf, side_fun, side_args):
  shapes = jax.eval_shape(side_fun, *side_args)
  many = isinstance(shapes, (tuple, list))
  shapes = shapes if many else (shapes,)
  sizes = [int(np.prod(s.shape)) for s in shapes]
  parts = jnp.split(buf, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [buf]
  outs = [p.reshape(s.shape) for p, s in zip(parts, shapes)]
  return outs if many else outs[0]


def side(fun, *args):
  """`fun(*args)` (one array) as one call on stream 1, unpinned."""
  return _compat.on_stream(lambda *a: (fun(*a),), 1, 1)(*args)[0]


def call_chain(calls: int, dim: int, batch: int):
  """{variant: fn(h, ws)} of the per-call experiment (module doc)."""
  dot = lambda h, w: jnp.tanh(h @ w)  # noqa: E731
  gram = lambda h: h.T @ h  # noqa: E731

  def serial(h, ws):
    outs = []
    for i in range(calls):
      outs.append(gram(h))
      h = dot(h, ws[i])
    return h, outs

  def unpinned(h, ws):
    outs = []
    for i in range(calls):
      outs.append(side(gram, h))
      h = dot(h, ws[i])
    return h, outs

  def pin(h, ws):
    outs = []
    for i in range(calls):
      h, s = pinned(dot, gram, (h, ws[i]), (h,), outs[-1] if outs else None)
      outs.append(s)
    return h, outs

  return {"serial": serial, "unpinned": unpinned, "pinned": pin}


def pair_variants(kind, groups, repeat: int):
  """{variant: fn(gs, xs, ws)} over `repeat` independent pairs (module doc)."""
  dx, dw = pair_fns(kind, groups)

  def serial(gs, xs, ws):
    return [(dx(g, x, w), dw(g, x, w)) for g, x, w in zip(gs, xs, ws)]

  def two(gs, xs, ws):
    out = []
    for g, x, w in zip(gs, xs, ws):
      out.append(pinned(dx, dw, (g, x, w), (g, x, w), out[-1][1] if out else None))
    return out

  def four(gs, xs, ws):  # the dW of four pairs in one call beside their dX
    out = []
    for k in range(0, len(gs), 4):
      grp = [a for t in list(zip(gs, xs, ws))[k : k + 4] for a in t]
      n = len(grp) // 3
      dxs = lambda *a: [dx(*a[3 * i : 3 * i + 3]) for i in range(n)]  # noqa: E731
      dws = lambda *a: [dw(*a[3 * i : 3 * i + 3]) for i in range(n)]  # noqa: E731
      mx, sw = pinned(dxs, dws, grp, grp)
      out += list(zip(mx, sw))
    return out

  out = {"serial": serial, "two streams": two}
  if repeat >= 4:
    out["4 in one call"] = four
  return out


def pair_args(kind, xshape, wshape, groups, batch, repeat, key):
  f = _f(kind, groups)
  xs, ws, gs = [], [], []
  for r in range(repeat):
    k1, k2, k3 = jax.random.split(jax.random.fold_in(key, r), 3)
    x = jax.random.normal(k1, (batch, *xshape), jnp.float32)
    w = jax.random.normal(k2, wshape, jnp.float32) * 0.05
    y = jax.eval_shape(f, x, w)
    xs.append(x)
    ws.append(w)
    gs.append(jax.random.normal(k3, y.shape, jnp.float32))
  return gs, xs, ws


def device_name() -> str:
  """The cost model's spec name for this device ("H200"), as `passes.cost` guesses it."""
  from ooojax.passes import cost

  return cost.get_spec(None).name


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--calls", type=int, default=16)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--batches", type=int, nargs="+", default=[32, 4])
  ap.add_argument("--repeat", type=int, default=4, help="independent pairs per program")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument(
    "--budget",
    type=float,
    default=60.0,
    help="seconds for compiling; pairs left when it is spent are skipped (and listed)",
  )
  ap.add_argument("--calibration-dir", default=None)
  ap.add_argument("--dry", action="store_true", help="tiny sizes, 1 round: a CPU check")
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  pairs = PAIRS
  if a.dry:
    pairs, a.calls, a.dim, a.batches = DRY_PAIRS, 3, 16, [2]
    a.rounds, a.iters = 1, 1
  start = time.perf_counter()
  fns, skipped = {}, []
  key = jax.random.key(0)
  # 1. per-call cost
  ws = [
    jax.random.normal(jax.random.fold_in(key, i), (a.dim, a.dim)) / a.dim**0.5
    for i in range(a.calls)
  ]
  h = jax.random.normal(key, (32, a.dim))
  for cb, opts in (("on", {}), ("off", CB_OFF)):
    for name, f in call_chain(a.calls, a.dim, 32).items():
      try:
        exe = jax.jit(f).lower(h, ws).compile(compiler_options=opts)
      except Exception as e:  # noqa: BLE001 - an option this backend lacks: a result
        print(f"calls {name} cb {cb}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        continue
      fns[f"calls/{name}/cb {cb}"] = lambda exe=exe: exe(h, ws)
  # 2. pair gains
  for pname, (kind, xs_, ws_, groups) in pairs.items():
    for b in a.batches:
      if time.perf_counter() - start > a.budget:
        skipped.append(f"{pname}/b{b}")
        continue
      args = pair_args(kind, xs_, ws_, groups, b, a.repeat, key)
      for vname, f in pair_variants(kind, groups, a.repeat).items():
        try:
          exe = jax.jit(f).lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - one pair failing is a result, not the end
          print(f"{pname}/b{b}/{vname}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
          continue
        fns[f"{pname}/b{b}/{vname}"] = lambda exe=exe, args=args: exe(*args)
  print(f"compiled {len(fns)} programs in {time.perf_counter() - start:.1f} s", flush=True)
  times, failed = _report.compile_then_alternate(fns, (), a.rounds, a.iters)
  med = {k: float(np.median(v)) for k, v in times.items()}

  def per_call(name, cb):
    t, base = med.get(f"calls/{name}/cb {cb}"), med.get(f"calls/serial/cb {cb}")
    return None if t is None or base is None else max(t - base, 0.0) / a.calls

  gains = {}
  rows = []
  for b in a.batches:
    for pname in pairs:
      s = med.get(f"{pname}/b{b}/serial")
      if s is None:
        continue
      for vname in ("two streams", "4 in one call"):
        t = med.get(f"{pname}/b{b}/{vname}")
        if t is None:
          continue
        g = s / t
        if vname == "two streams":
          gains[f"{pname}/b{b}"] = round(g, 4)
        rows.append(
          f"| {pname} | {b} | {vname} | {s / a.repeat * 1e6:.1f} | "
          f"{t / a.repeat * 1e6:.1f} | {g:.3f} |"
        )
  dev = device_name()
  cal = {
    "format": 1,
    "device": dev,
    "jax": jax.__version__,
    "call_seconds": per_call("unpinned", "on") or 0.0,
    "pinned_call_seconds": per_call("pinned", "on") or 0.0,
    "pair_gain": gains,
    "source": f"benchmarks/stream_pairs.py on {jax.devices()[0].device_kind}, "
    f"{datetime.date.today()}, jax {jax.__version__}",
  }
  if a.calibration_dir:
    p = pathlib.Path(a.calibration_dir)
    p.mkdir(parents=True, exist_ok=True)
    (p / f"{dev.lower()}.json").write_text(json.dumps(cal, indent=1) + "\n")
    print(f"wrote {p / (dev.lower() + '.json')}")
  lines = _report.header(
    "A second stream on this GPU: call cost and pair gain (benchmarks/stream_pairs.py)"
  )
  lines += [
    f"Device: {jax.devices()[0].device_kind} (cost-model spec {dev}). Median of {a.rounds} "
    f"rounds x {a.iters} calls, alternating. Per call: (variant - serial) / {a.calls} "
    f"stream calls (chained {a.dim}x{a.dim} dots, batch 32). G = serial / variant over "
    f"{a.repeat} independent pairs per program, call costs included. "
    f"Total {time.perf_counter() - start:.0f} s.",
    "",
    "| stream call | command buffers | us per call |",
    "|---|---|---|",
  ]
  for name in ("unpinned", "pinned"):
    for cb in ("on", "off"):
      c = per_call(name, cb)
      lines.append(f"| {name} | {cb} | {'-' if c is None else f'{c * 1e6:.1f}'} |")
  lines += [
    "",
    "| pair | batch | variant | serial us/pair | variant us/pair | G |",
    "|---|---|---|---|---|---|",
    *rows,
  ]
  if skipped or failed:
    lines += ["", f"Skipped (budget): {skipped}; failed: {failed}"]
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
