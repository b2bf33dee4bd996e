"""`python -m ooojax hlo`: the compiled XLA:GPU schedule of a model's gradient.

Compiles `jax.grad` or `ooo.grad` of a zoo model (`ooojax.models`, installed
with the package) or the demo CNN for a compile-only GPU (`ooojax.gpu_hlo`) and
prints the async pairs XLA scheduled, plus "heavy dW calls overlapped: k / n":
n stream-annotated calls whose callee holds a conv/GEMM kernel, k of them with
a conv/GEMM kernel scheduled between start and done.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

MODES = ("single_gpu", "in_order", "jax")


def _parse_value(v: str):
  low = v.lower()
  if low in ("true", "false"):
    return low == "true"
  for cast in (int, float):
    try:
      return cast(v)
    except ValueError:
      pass
  if v.startswith("(") or v.startswith("["):
    import ast
    return tuple(ast.literal_eval(v))
  return v


def parse_kv(items) -> dict[str, Any]:
  """["a=1", "b=x"] -> {"a": 1, "b": "x"}."""
  out = {}
  for kv in items or ():
    if "=" not in kv:
      raise ValueError(f"expected name=value, got {kv!r}")
    k, v = kv.split("=", 1)
    out[k] = _parse_value(v)
  return out


@contextlib.contextmanager
def _shapes_only_init():
  """Zoo models' parameter init as shapes only (`jax.eval_shape`): compiling
  needs no values, and a full-size init costs minutes on a small CPU."""
  import jax

  from ooojax import models
  from ooojax.models import _common
  mods = [_common] + [getattr(models, n) for n in ("densenet", "mobilenet", "resnet",
                                                    "transformer")]
  saved = [(m, m.init_params) for m in mods if hasattr(m, "init_params")]
  try:
    for m, _ in saved:
      m.init_params = jax.eval_shape
    yield
  finally:
    for m, f in saved:
      m.init_params = f


def load_model(name: str, *, tiny: bool = False, batch: int | None = None,
               sizes: dict | None = None):
  """`(loss_fn, args, kw)` for "demo" or a zoo model; parameters as shapes."""
  import jax
  import jax.numpy as jnp
  if name == "demo":
    from ooojax import demo
    model = demo.SmallCNN()
    b = batch or (8 if tiny else 32)
    x = jax.ShapeDtypeStruct((b, 32, 32, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((b,), jnp.int32)
    v = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
    _, loss_fn = demo.make_step(jax.grad, model, None)
    return loss_fn, (v["params"], v["batch_stats"], x, y), {"has_aux": True}
  from ooojax.models import ZOO
  if name not in ZOO:
    raise ValueError(f"unknown model {name!r}; choose 'demo' or one of {sorted(ZOO)}")
  make, full_kw, tiny_kw = ZOO[name]
  kw = dict(tiny_kw if tiny else full_kw)
  if batch is not None:
    kw["batch"] = batch
  kw.update(sizes or {})
  with _shapes_only_init():
    return make(**kw)


def grad_fn(loss_fn, kw: dict, mode: str, gpu: str = "H100", ordering: str | None = None):
  """The gradient function for a mode ("jax" = `jax.grad`)."""
  import jax

  import ooojax as ooo
  from passes.cost import DEVICE_SPECS
  if mode == "jax":
    return jax.grad(loss_fn, **kw)
  if mode not in MODES:
    raise ValueError(f"unknown mode {mode!r}; allowed: {MODES}")
  spec = gpu.upper() if gpu.upper() in DEVICE_SPECS else "H100"
  opts = {"ordering": ordering} if ordering else {}
  return ooo.grad(loss_fn, mode=mode, device=spec, **opts, **kw)


@dataclasses.dataclass(frozen=True)
class CompiledModel:
  schedule: Any          # passes.hlo.schedule.HloSchedule
  text: str              # the scheduled HLO
  lower_s: float
  compile_s: float


def _place_batch(args, m):
  """Parameters replicated; other arrays sharded on their leading axis when it
  divides by the device count (a data-parallel step)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  n = m.devices.size
  params, rest = args[0], args[1:]

  def shard(a):
    shape = getattr(a, "shape", ())
    spec = P("d") if shape and shape[0] % n == 0 else P()
    return jax.ShapeDtypeStruct(shape, a.dtype, sharding=NamedSharding(m, spec))
  return (params, *jax.tree.map(shard, rest))


def compile_model(fn, args, *, gpu: str = "H100", devices: int = 1,
                  compiler_options: dict | None = None) -> CompiledModel:
  """Lowers and compiles `fn(*args)` for `devices` compile-only `gpu`s, timed."""
  import jax

  from ooojax import gpu_hlo
  from passes.hlo import schedule as hlo_schedule
  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    raise RuntimeError(f"cannot compile for a GPU here: {reason}")
  m = gpu_hlo.mesh(gpu, devices)
  placed = gpu_hlo._place(_place_batch(args, m) if devices > 1 else args, m)
  t0 = time.perf_counter()
  lowered = jax.jit(fn).lower(*placed)
  t1 = time.perf_counter()
  text = lowered.compile(compiler_options=dict(compiler_options or {})).as_text()
  t2 = time.perf_counter()
  return CompiledModel(hlo_schedule.parse(text), text, t1 - t0, t2 - t1)


def add_parser(sub) -> None:
  p = sub.add_parser("hlo", help="print the compiled XLA:GPU schedule of a model's gradient "
                     "(compile-only, no GPU needed)")
  p.add_argument("--model", default="demo", help="'demo' or a zoo name (ooojax/models)")
  p.add_argument("--tiny", action="store_true", help="the zoo's tiny sizes")
  p.add_argument("--batch", type=int, default=None)
  p.add_argument("--size", action="append", default=[], metavar="NAME=VALUE",
                 help="override a zoo size argument, e.g. layers=1 (repeatable)")
  p.add_argument("--gpu", default="H100", help="H100, H200 or A100")
  p.add_argument("--mode", default="single_gpu", choices=MODES,
                 help="ooo.grad mode, or 'jax' for jax.grad")
  p.add_argument("--ordering", default=None, help="ooo.grad ordering option (default: ooo's)")
  p.add_argument("--devices", type=int, default=1,
                 help="compile-only devices; >1 shards the batch (data parallel)")
  p.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE",
                 help="XLA option for the compile (repeatable)")
  p.add_argument("--out", default=None, help="write the scheduled HLO text here")


def run(args) -> int:
  loss_fn, fargs, kw = load_model(args.model, tiny=args.tiny, batch=args.batch,
                                  sizes=parse_kv(args.size))
  fn = grad_fn(loss_fn, kw, args.mode, args.gpu, args.ordering)
  import jax
  print(f"{args.model} ({'tiny' if args.tiny else 'full'} size), mode={args.mode}, "
        f"compile-only {args.gpu} x{args.devices}, jax {jax.__version__}")
  try:
    c = compile_model(fn, fargs, gpu=args.gpu, devices=args.devices,
                      compiler_options=parse_kv(args.opt))
  except Exception as e:  # noqa: BLE001 - say what to change, not a traceback
    msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    hint = (" (XLA:GPU cannot compile ordering='control_deps': pass --ordering none)"
            if "control_dep" in str(e) else "")
    print(f"compile failed: {type(e).__name__}: {msg}{hint}")
    return 1
  print(f"lower {c.lower_s:.2f} s, compile {c.compile_s:.2f} s")
  print(c.schedule.summary())
  if not any(ln.startswith("heavy dW calls overlapped") for ln in c.schedule.summary().splitlines()):
    k, n = c.schedule.heavy_overlap()
    print(f"heavy dW calls overlapped: {k} / {n}")
  if args.out:
    with open(args.out, "w") as f:
      f.write(c.text)
    print(f"scheduled HLO written to {args.out}")
  return 0
