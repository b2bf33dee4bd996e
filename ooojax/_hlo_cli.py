"""`python -m ooojax hlo`: the compiled XLA:GPU schedule of a model's gradient.

Compiles `jax.grad` or `ooo.grad` of a zoo model (`ooojax.models`, installed
with the package) or the demo CNN for a compile-only GPU (`ooojax.gpu_hlo`) and
prints the async pairs XLA scheduled, plus "heavy dW calls overlapped: k / n":
n stream-annotated calls whose callee holds a conv/GEMM kernel, k of them with
a conv/GEMM kernel scheduled between start and done.

`--mode data_parallel` prints `ooo.explain`'s data-parallel report (buckets,
k, link schedule, predicted overlap; the model's arguments are one device's
shard, `--devices` of them) and the compiled all-reduce windows;
`--mode pipeline` prints `ooo.pipeline.explain`'s report for the MLP stack
(`ooojax.models.mlp_stack`) and the compiled collective-permute windows.
Without the gpu-hlo extra both print the report and say why nothing compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

MODES = ("single_gpu", "in_order", "jax", "data_parallel", "pipeline")
GRAD_MODES = ("single_gpu", "in_order", "jax")
# Stack models for the pipeline mode: (make, full-size kwargs, tiny kwargs); vstages is
# set from --stages (and the schedule's chunks).
PIPELINE_MODELS = {
  "mlp_stack": ({"dim": 1024, "hidden": 4096, "batch": 64}, {"dim": 64, "hidden": 128, "batch": 16})
}


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

  mods = [_common] + [
    getattr(models, n) for n in ("densenet", "mobilenet", "resnet", "transformer")
  ]
  saved = [(m, m.init_params) for m in mods if hasattr(m, "init_params")]
  try:
    for m, _ in saved:
      m.init_params = jax.eval_shape
    yield
  finally:
    for m, f in saved:
      m.init_params = f


def load_model(
  name: str, *, tiny: bool = False, batch: int | None = None, sizes: dict | None = None
):
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

  if mode == "jax":
    return jax.grad(loss_fn, **kw)
  if mode not in GRAD_MODES:
    raise ValueError(
      f"unknown mode {mode!r}; allowed: {GRAD_MODES} (data_parallel and "
      "pipeline print explain reports: see run)"
    )
  opts = {"ordering": ordering} if ordering else {}
  return ooo.grad(loss_fn, mode=mode, device=_spec(gpu), **opts, **kw)


@dataclasses.dataclass(frozen=True)
class CompiledModel:
  schedule: Any  # passes.hlo.schedule.HloSchedule
  text: str  # the scheduled HLO
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


def compile_model(
  fn, args, *, gpu: str = "H100", devices: int = 1, compiler_options: dict | None = None
) -> CompiledModel:
  """Lowers and compiles `fn(*args)` for `devices` compile-only `gpu`s, timed."""
  import jax

  from ooojax import gpu_hlo
  from ooojax.passes.hlo import schedule as hlo_schedule

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
  p = sub.add_parser(
    "hlo",
    help="print the compiled XLA:GPU schedule of a model's gradient (compile-only, no GPU needed)",
  )
  p.add_argument(
    "--model",
    default=None,
    help="'demo' (default) or a zoo name "
    "(ooojax/models); with --mode pipeline: 'mlp_stack' (default)",
  )
  p.add_argument("--tiny", action="store_true", help="the zoo's tiny sizes")
  p.add_argument("--batch", type=int, default=None)
  p.add_argument(
    "--size",
    action="append",
    default=[],
    metavar="NAME=VALUE",
    help="override a zoo size argument, e.g. layers=1 (repeatable)",
  )
  p.add_argument("--gpu", default="H100", help="H100, H200 or A100")
  p.add_argument(
    "--mode",
    default="single_gpu",
    choices=MODES,
    help="ooo.grad mode, 'jax' for jax.grad, or the data_parallel / pipeline explain reports",
  )
  p.add_argument("--ordering", default=None, help="ooo.grad ordering option (default: ooo's)")
  p.add_argument(
    "--devices",
    type=int,
    default=1,
    help="compile-only devices; >1 shards the batch (data parallel); with "
    "--mode data_parallel the axis size (default 8)",
  )
  p.add_argument(
    "--link",
    default=None,
    help="data_parallel / pipeline: network preset (nvlink, 100GbE, 25GbE, 10GbE)",
  )
  p.add_argument("--schedule", default="ooo", help="pipeline: a schedule name")
  p.add_argument("--stages", type=int, default=4, help="pipeline: stages (devices)")
  p.add_argument(
    "--microbatches", type=int, default=None, help="pipeline: microbatches (default 2 x stages)"
  )
  p.add_argument("--chunks", type=int, default=None, help="pipeline: interleaved chunks")
  p.add_argument(
    "--lag", type=int, default=0, help="pipeline: 1 receives each transfer one tick after its send"
  )
  p.add_argument(
    "--opt",
    action="append",
    default=[],
    metavar="NAME=VALUE",
    help="XLA option for the compile (repeatable)",
  )
  p.add_argument("--out", default=None, help="write the scheduled HLO text here")


def _spec(gpu: str) -> str:
  from ooojax.passes.cost import DEVICE_SPECS

  return gpu.upper() if gpu.upper() in DEVICE_SPECS else "H100"


def _first_line(e: Exception) -> str:
  return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


def batch_argnums(args) -> tuple[int, ...]:
  """The zoo's per-example arguments: single arrays after the parameters (images,
  labels, tokens), not collections (batch_stats) nor PRNG keys."""
  import jax
  import numpy as np

  def is_key(a):
    return jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) or (
      a.dtype == np.uint32 and tuple(a.shape) == (2,)
    )

  return tuple(
    i
    for i, a in enumerate(args)
    if i > 0 and hasattr(a, "shape") and len(a.shape) >= 1 and not is_key(a)
  )


def run_data_parallel(args) -> int:
  import jax

  import ooojax as ooo
  from ooojax import gpu_hlo

  model = args.model or "demo"
  loss_fn, fargs, kw = load_model(
    model, tiny=args.tiny, batch=args.batch, sizes=parse_kv(args.size)
  )
  n = args.devices if args.devices > 1 else 8
  print(
    f"{model} ({'tiny' if args.tiny else 'full'} size, arguments = one device's shard), "
    f"mode=data_parallel over {n} devices, jax {jax.__version__}"
  )
  report = ooo.explain(
    loss_fn,
    *fargs,
    **kw,
    mode="data_parallel",
    axis_name="d",
    axis_size=n,
    device=_spec(args.gpu),
    link=args.link,
  )
  print(report)
  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    print(f"compiled: skipped ({reason})")
    return 0
  try:
    print(
      report.compiled(
        args.gpu, batch_argnums=batch_argnums(fargs), compiler_options=parse_kv(args.opt)
      )
    )
  except Exception as e:  # noqa: BLE001 - say what failed, not a traceback
    print(f"compile failed: {type(e).__name__}: {_first_line(e)}")
    return 1
  return 0


def run_pipeline(args) -> int:
  import jax

  import ooojax as ooo
  from ooojax import gpu_hlo
  from ooojax.models import mlp_stack

  model = args.model or "mlp_stack"
  if model not in PIPELINE_MODELS:
    raise ValueError(
      f"--mode pipeline needs a stack model: one of {sorted(PIPELINE_MODELS)}, got {model!r}"
    )
  sched = ooo.pipeline.schedule(
    args.schedule, args.stages, args.microbatches or 2 * args.stages, args.chunks, args.lag
  )
  full, tiny = PIPELINE_MODELS[model]
  kw = {
    **(tiny if args.tiny else full),
    "vstages": sched.virtual_stages,
    "layers": 2 * sched.virtual_stages,
  }
  if args.batch is not None:
    kw["batch"] = args.batch
  kw.update(parse_kv(args.size))
  stage_fn, loss_fn, params, batch = mlp_stack.make(**kw)
  print(
    f"{model} ({'tiny' if args.tiny else 'full'} size: {kw}), mode=pipeline, jax {jax.__version__}"
  )
  report = ooo.pipeline.explain(
    stage_fn, loss_fn, sched, params, batch, device=_spec(args.gpu), link=args.link
  )
  reason = gpu_hlo.unavailable_reason()
  if reason is None:
    try:
      report = report.compiled(args.gpu, compiler_options=parse_kv(args.opt))
    except Exception as e:  # noqa: BLE001 - say what failed, not a traceback
      print(report)
      print(f"compile failed: {type(e).__name__}: {_first_line(e)}")
      return 1
  print(report)
  if reason is not None:
    print(f"compiled: skipped ({reason})")
  return 0


def run(args) -> int:
  if args.mode == "data_parallel":
    return run_data_parallel(args)
  if args.mode == "pipeline":
    return run_pipeline(args)
  args.model = args.model or "demo"
  loss_fn, fargs, kw = load_model(
    args.model, tiny=args.tiny, batch=args.batch, sizes=parse_kv(args.size)
  )
  fn = grad_fn(loss_fn, kw, args.mode, args.gpu, args.ordering)
  import jax

  print(
    f"{args.model} ({'tiny' if args.tiny else 'full'} size), mode={args.mode}, "
    f"compile-only {args.gpu} x{args.devices}, jax {jax.__version__}"
  )
  try:
    c = compile_model(
      fn, fargs, gpu=args.gpu, devices=args.devices, compiler_options=parse_kv(args.opt)
    )
  except Exception as e:  # noqa: BLE001 - say what to change, not a traceback
    msg = _first_line(e)
    hint = (
      " (XLA:GPU cannot compile ordering='control_deps': pass --ordering none)"
      if "control_dep" in str(e)
      else ""
    )
    print(f"compile failed: {type(e).__name__}: {msg}{hint}")
    return 1
  print(f"lower {c.lower_s:.2f} s, compile {c.compile_s:.2f} s")
  print(c.schedule.summary())
  if not any(
    ln.startswith("heavy dW calls overlapped") for ln in c.schedule.summary().splitlines()
  ):
    k, n = c.schedule.heavy_overlap()
    print(f"heavy dW calls overlapped: {k} / {n}")
  if args.out:
    with open(args.out, "w") as f:
      f.write(c.text)
    print(f"scheduled HLO written to {args.out}")
  return 0
