"""Data parallel against XLA's own: exposed communication replayed from compiled H100 programs.

Each step is compiled for N compile-only H100s (no GPU runs) twice: with
`jax.value_and_grad` under plain `jax.jit` (GSPMD: XLA's own reductions,
combiner and schedule) and with `ooo.value_and_grad(mode="data_parallel")`
swapped in, nothing else changed. `passes.hlo.replay` then prices each
compiled schedule: kernels on the compute stream by the H100 roofline, each
collective on one link from its start to its done (ring costs). Replayed from
compile-only HLO, not timed.

  python -m benchmarks.dp_exposed                     # 8 devices, every model
  python -m benchmarks.dp_exposed --devices 8 64 --write

Models: nanodo's train step (`tests/nanodo.py`, adamw, optional FSDP) at
D 1024 and D 2048; a BERT-large-like encoder (nanodo's blocks at BERT-large
widths: D 1024, 16 heads, F 4096, context 512, vocabulary 30522; causal mask);
ResNet-50 (`ooojax.models.resnet`, SGD, no FSDP). Layer counts are cut
(`--layers`) so that 64-device compiles fit a 2-core machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

LINKS = ("nvlink", "IB400", "IB100", "25GbE")
NANODO = {
  "nanodo D1024": (dict(D=1024, H=8, L=512, V=32768, F=4096), 1),
  "nanodo D2048": (dict(D=2048, H=16, L=512, V=32768, F=8192), 1),
  "BERT-large-like": (dict(D=1024, H=16, L=512, V=30522, F=4096), 4),
}
MODELS = (*NANODO, "ResNet-50")


def _vg(variant):
  """ "jax", "ooo" (the default link, NVLink) or "ooo@<link>" (planned for that link);
  "ooo+bf16" (or "ooo+bf16@<link>"): with `reduce_dtype=jnp.bfloat16` (opt-in)."""
  import jax
  import jax.numpy as jnp

  import ooojax as ooo
  from ooojax.passes.collectives.plan import get_link

  if variant == "jax":
    return jax.value_and_grad
  base, _, link = variant.partition("@")
  extra = {"reduce_dtype": jnp.bfloat16} if base.endswith("+bf16") else {}
  link = link or None
  if link is not None and link not in ("nvlink", "100GbE", "25GbE", "10GbE"):
    from ooojax.passes.hlo.replay import get_link as replay_link

    link = replay_link(link)
  return functools.partial(
    ooo.value_and_grad,
    mode="data_parallel",
    ordering="none",
    device="H100",
    link=get_link(link),
    **extra,
  )


def _nanodo(name, variant, devices, fsdp, layers, compiler_options=None):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from benchmarks.dp_gspmd import _abstract_state
  from ooojax import gpu_hlo
  from tests import nanodo as nd

  sizes, rows = NANODO[name]
  cfg = nd.DoConfig(**sizes, N=layers, fsdp_enabled=fsdp)
  mesh = gpu_hlo.mesh("H100", devices, ("data",))
  shardings, state = _abstract_state(cfg, mesh)
  batch = jax.ShapeDtypeStruct(
    (rows * devices, cfg.L), jnp.int32, sharding=NamedSharding(mesh, P())
  )
  step = nd.make_step(shardings, mesh, value_and_grad=_vg(variant))
  return gpu_hlo.compiled(step, state, batch, mesh=mesh, compiler_options=compiler_options)


def _resnet(variant, devices, layers, compiler_options=None):
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from ooojax import gpu_hlo
  from ooojax.models import resnet

  loss_fn, (params, stats, x, y), _ = resnet.make(50, batch=2, image=224, real_init=False)
  mesh = gpu_hlo.mesh("H100", devices, ("data",))
  rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
  rows = 32  # per device
  xs = jax.ShapeDtypeStruct((rows * devices, *x.shape[1:]), x.dtype, sharding=dat)
  ys = jax.ShapeDtypeStruct((rows * devices,), y.dtype, sharding=dat)
  vg = _vg(variant)

  def step(p, s, x, y):
    # as nanodo does: the batch's split made visible inside the jit
    x, y = jax.lax.with_sharding_constraint((x, y), dat)
    (loss, upd), g = vg(loss_fn, has_aux=True)(p, s, x, y)
    p = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return p, upd, loss

  f = jax.jit(step, in_shardings=(rep, rep, dat, dat), out_shardings=(rep, rep, rep))
  args = (jax.tree.map(lambda a: sds(a, rep), params), jax.tree.map(lambda a: sds(a, rep), stats))
  return gpu_hlo.compiled(f, *args, xs, ys, mesh=mesh, compiler_options=compiler_options)


def measure(name, variant, devices, fsdp, layers, hlo_dir=None, pgle=None) -> dict:
  """Compiles one step and replays it on every link: seconds and temp bytes.
  With `hlo_dir`, the compiled HLO is kept there (gzip) for a later replay. With
  `pgle` (a replay link name), the step is compiled again with each collective's
  cost on that link as XLA's latency profile (`passes.hlo.pgle`), and that
  program is the one replayed (only the `pgle` link's figures mean the opt-in)."""
  t0 = time.perf_counter()

  def build(opts=None):
    if name == "ResNet-50":
      return _resnet(variant, devices, layers, opts)
    return _nanodo(name, variant, devices, fsdp, layers, opts)

  c = build()
  if pgle is not None:
    from ooojax.gpu_hlo import pgle_options

    opts = pgle_options(c, devices, pgle)
    try:
      c = build(opts)
    finally:
      os.unlink(next(iter(opts.values())))
  text = c.as_text()
  if hlo_dir:
    import gzip

    os.makedirs(hlo_dir, exist_ok=True)
    with gzip.open(_hlo_path(hlo_dir, name, devices, fsdp, variant), "wt") as f:
      f.write(text)
  out = {
    "compile_s": time.perf_counter() - t0,
    "temp": int(c.memory_analysis().temp_size_in_bytes),
  }
  out.update(replays(text, devices))
  return out


def _hlo_path(hlo_dir, name, devices, fsdp, variant) -> str:
  tag = f"{name}-{devices}-{'fsdp' if fsdp else 'dp'}-{variant}".replace(" ", "_")
  return os.path.join(hlo_dir, tag + ".hlo.gz")


def replays(text: str, devices: int) -> dict:
  """Per link, the replay at the H100 roofline; under "cal", the same with the H200's
  kernel factors (`ooojax/calibration/h200.json`: Hopper's measured efficiencies)."""
  from ooojax.passes import calibration
  from ooojax.passes.hlo.replay import replay

  cal = calibration.load(calibration.SHIPPED / "h200.json")
  out: dict = {"cal": {}}
  for link in LINKS:
    out[link] = _summary(replay(text, devices, link, "H100"))
    out["cal"][link] = _summary(replay(text, devices, link, "H100", calibration=cal))
  return out


def _summary(r) -> dict:
  return {
    "step": r.step,
    "compute": r.compute,
    "comm": r.comm,
    "exposed": r.exposed,
    "reductions": r.reductions,
    "collectives": len(r.transfers),
    # link seconds of the gradient reductions alone (not FSDP's gathers)
    "red_comm": sum(
      t.end - t.start for t in r.transfers if t.kind in ("all-reduce", "reduce-scatter")
    ),
  }


# the backward's share of a step's compute (forward : backward = 1 : 2, a GEMM's dX and dW)
BACKWARD_SHARE = 2 / 3


def floors(b: dict) -> tuple[float, float]:
  """ooojax's floors for one row: link time - compute (no schedule exposes less), and
  the floor after the forward (a gradient exists only once the backward runs: the
  reductions' link time - the backward's compute, `BACKWARD_SHARE` of it; for a
  step that reduces within itself)."""
  whole = max(b["comm"] - b["compute"], 0.0)
  red = b.get("red_comm", b["comm"])
  return whole, max(whole, red - BACKWARD_SHARE * b["compute"])


def verdict(a: dict, b: dict) -> str:
  """The issue's exposed-time bar for one row (`a`: plain jit, `b`: ooojax)."""
  if a["exposed"] <= 0.1 * a["step"]:
    return "no bar (jit exposes <= 10%)"
  if b["exposed"] <= 0.5 * a["exposed"]:
    return "meets"
  whole, bwd = floors(b)
  if whole > 0.5 * a["exposed"]:
    return "link-bound"
  if bwd > 0.5 * a["exposed"]:
    return "link-bound after the forward"
  return "misses"


def rows(results: dict, devices, layers) -> list[str]:
  lines = [
    "| model | H100s | FSDP | link | plain jit step ms (exposed ms) | ooojax step ms "
    "(exposed ms) | plain / ooojax step | jit / ooo reductions | temp MB jit / ooo | "
    "bar: half of jit's exposed ms | floor ms (after the forward) | ooo / jit above the "
    "floor after the forward ms | bar | calibrated: jit / ooo step ms (exposed ms) | "
    "bar, calibrated |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for key, r in results.items():
    name, n, fsdp = key.split("|")
    j, o = r["jax"], r["ooo"]
    for link in LINKS:
      a, b = j[link], o[link]
      whole, bwd = floors(b)
      lines.append(
        f"| {name} | {n} | {fsdp} | {link} | {a['step'] * 1e3:.3f} ({a['exposed'] * 1e3:.3f}) | "
        f"{b['step'] * 1e3:.3f} ({b['exposed'] * 1e3:.3f}) | {a['step'] / b['step']:.2f}x | "
        f"{a['reductions']} / {b['reductions']} | {j['temp'] / 1e6:.0f} / {o['temp'] / 1e6:.0f} | "
        f"{0.5 * a['exposed'] * 1e3:.3f} | {whole * 1e3:.3f} ({bwd * 1e3:.3f}) | "
        f"{(b['exposed'] - bwd) * 1e3:.3f} / {(a['exposed'] - bwd) * 1e3:.3f} | {verdict(a, b)} | "
        + _calibrated(j, o, link)
      )
  return lines


def _calibrated(j: dict, o: dict, link: str) -> str:
  if "cal" not in j or "cal" not in o:
    return "- | - |"
  a, b = j["cal"][link], o["cal"][link]
  return (
    f"{a['step'] * 1e3:.3f} ({a['exposed'] * 1e3:.3f}) / {b['step'] * 1e3:.3f} "
    f"({b['exposed'] * 1e3:.3f}) | {verdict(a, b)} |"
  )


def acceptance(results: dict, cal: bool = False) -> list[str]:
  """The issue's two bars, row by row: ooojax's step >= 0.98x plain jit's; where plain
  jit exposes > 10% of its step, ooojax exposes at most half as much. A row failing
  the second is named with its floors (`floors`). `cal`: on the calibrated replays."""
  slow, half, n, bound = [], [], 0, 0
  for key, r in results.items():
    j, o = r["jax"], r["ooo"]
    if cal and ("cal" not in j or "cal" not in o):
      continue
    for link in LINKS:
      a, b = (j["cal"][link], o["cal"][link]) if cal else (j[link], o[link])
      n += 1
      model, devices, fsdp = key.split("|")
      name = f"{model} x{devices}{' FSDP' if fsdp == 'yes' else ''}, {link}"
      if b["step"] > a["step"] / 0.98:
        slow.append(f"{name} ({a['step'] / b['step']:.2f}x)")
      v = verdict(a, b)
      if v not in ("meets", "no bar (jit exposes <= 10%)"):
        bound += v != "misses"
        whole, bwd = floors(b)
        half.append(
          f"{name} ({b['exposed'] * 1e3:.1f} of {a['exposed'] * 1e3:.1f} ms; floor "
          f"{whole * 1e3:.1f} ms, after the forward {bwd * 1e3:.1f}; {v})"
        )
  tag = "calibrated replay (H200 kernel factors): " if cal else ""
  return [
    f"- {tag}ooojax's step below 0.98x plain jit's: {len(slow)} of {n} rows"
    + (": " + "; ".join(slow) if slow else ""),
    f"- {tag}plain jit exposes > 10% and ooojax more than half of that: {len(half)} of {n} "
    "rows, "
    f"{bound} of them link-bound (a floor above half of plain jit's exposed time: no "
    "schedule reducing within the step meets the bar)" + (": " + "; ".join(half) if half else ""),
  ]


def bf16_rows(results: dict) -> list[str]:
  """The opt-in bf16 reduction next to f32, per row and link where it was compiled:
  exposed ms of plain jit, ooojax f32 and ooojax bf16, the bar and bf16's verdict
  (roofline; calibrated after the slash)."""
  lines = [
    "| model | H100s | FSDP | link | plain jit step (exposed) ms | ooojax f32 step (exposed) ms "
    "| ooojax bf16 step (exposed) ms | bar ms | bf16 verdict | calibrated: jit / f32 / bf16 "
    "exposed ms | bar, calibrated ms | bf16 verdict, calibrated |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  ms = lambda r: f"{r['step'] * 1e3:.3f} ({r['exposed'] * 1e3:.3f})"  # noqa: E731
  for key, r in results.items():
    if not all(v in r for v in ("jax", "ooo", "ooo+bf16")):
      continue
    name, n, fsdp = key.split("|")
    j, o, h = r["jax"], r["ooo"], r["ooo+bf16"]
    for link in LINKS:
      a, b, c = j[link], o[link], h[link]
      cal = ""
      if all("cal" in x for x in (j, o, h)):
        ca, cb, cc = j["cal"][link], o["cal"][link], h["cal"][link]
        cal = (
          f"{ca['exposed'] * 1e3:.3f} / {cb['exposed'] * 1e3:.3f} / {cc['exposed'] * 1e3:.3f} "
          f"| {0.5 * ca['exposed'] * 1e3:.3f} | {verdict(ca, cc)} |"
        )
      lines.append(
        f"| {name} | {n} | {fsdp} | {link} | {ms(a)} | {ms(b)} | {ms(c)} | "
        f"{0.5 * a['exposed'] * 1e3:.3f} | {verdict(a, c)} | " + (cal or "- | - | - |")
      )
  return lines


def main(argv=None):
  ap = argparse.ArgumentParser(
    prog="python -m benchmarks.dp_exposed",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("--devices", type=int, nargs="+", default=[8])
  ap.add_argument("--models", nargs="+", default=list(MODELS))
  ap.add_argument("--layers", type=int, default=4, help="transformer blocks (nanodo, BERT)")
  ap.add_argument("--json", default=None, help="cache of compiled results (read and extended)")
  ap.add_argument("--hlo-dir", default=None, help="keep each compiled HLO here (gzip)")
  ap.add_argument(
    "--rereplay",
    action="store_true",
    help="replay the cached entries' HLO in --hlo-dir again (no compile; temp from --json)",
  )
  ap.add_argument(
    "--variants",
    nargs="+",
    default=["jax", "ooo"],
    help='compiled variants: "jax", "ooo", "ooo+bf16" (reduce_dtype=jnp.bfloat16, opt-in)',
  )
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  from benchmarks import _report

  cache = {}
  if a.json and os.path.exists(a.json):
    with open(a.json) as f:
      cache = json.load(f)
  if a.rereplay:
    import gzip

    for key, r in cache.items():
      name, n, fsdp = key.split("|")
      for variant, m in r.items():
        path = _hlo_path(a.hlo_dir, name, int(n), fsdp == "yes", variant)
        if os.path.exists(path):
          with gzip.open(path, "rt") as f:
            m.update(replays(f.read(), int(n)))
  for n in a.devices:
    for name in a.models:
      for fsdp in (False, True) if name != "ResNet-50" else (False,):
        key = f"{name}|{n}|{'yes' if fsdp else 'no'}"
        for variant in a.variants:
          if variant in cache.get(key, {}):
            continue
          cache.setdefault(key, {})[variant] = measure(name, variant, n, fsdp, a.layers, a.hlo_dir)
          print(key, variant, f"{cache[key][variant]['compile_s']:.0f} s", file=sys.stderr)
          if a.json:
            with open(a.json, "w") as f:
              json.dump(cache, f)
  done = {k: v for k, v in cache.items() if "jax" in v and "ooo" in v}
  lines = _report.header("Data parallel against XLA's own: exposed communication")
  lines += [
    f"Replayed from compile-only HLO, not timed (jax {jax.__version__}, H100 roofline, "
    f"{a.layers} transformer blocks; `passes.hlo.replay`):",
    "",
    *rows(done, a.devices, a.layers),
    "",
    *acceptance(done),
    "",
    *acceptance(done, cal=True),
    "",
  ]
  if any("ooo+bf16" in v for v in done.values()):
    lines += [
      "The opt-in bf16 reduction (`reduce_dtype=jnp.bfloat16`; changes the numbers):",
      "",
      *bf16_rows(done),
      "",
    ]
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
