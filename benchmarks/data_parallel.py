"""Simulated data-parallel step time: ooojax's buckets + reverse first-k + cross-step overlap.

Everything here is SIMULATED (passes.cost roofline on a device spec +
passes.simulate with a ring all-reduce on a link model); nothing runs on a GPU.
Per model, device count and link it prints:

* `one AR`: backward, then one all-reduce of every gradient (XLA's default
  combined all-reduce; nothing overlaps);
* `per-layer`: one all-reduce per parameter issued as its dW finishes, in the
  order the backward produces them, no reordering (Horovod/DDP-like, no
  cross-step);
* `ooojax`: the bucket size and k the cost model chooses, with the first-k
  reductions finishing under the next step's forward (`ooojax.data_parallel`);
* `bound`: max(compute, communication of all gradients in one all-reduce).

For a scanned stack (`bert_large_scan`: the BERT-large stack as one flax
`nn.scan`) it prints instead, with one all-reduce per leaf and k = 0: the
stacked dW reduced after the loop (per leaf, as for any parameter) against
one all-reduce per layer from inside the loop (`passes.collectives.loops`).

  python -m benchmarks.data_parallel [--models resnet50 resnet101 bert_large bert_large_scan] [--write]
"""

from __future__ import annotations

import argparse

import jax

import ooojax as ooo
from benchmarks import _report
from ooojax.models import resnet, scanned, transformer
from ooojax.passes.collectives import plan as collectives
from ooojax.passes.cost import CostModel

MODELS = {
  # the paper's per-GPU batches: 128 (ResNet-50), 96 (ResNet-101)
  "resnet50": lambda: resnet.make(50, batch=128, image=224, real_init=False),
  "resnet101": lambda: resnet.make(101, batch=96, image=224, real_init=False),
  "bert_large": lambda: transformer.make_bert(
    layers=24, batch=8, seq=512, dim=1024, heads=16, vocab=30522
  ),
  "bert_large_scan": lambda: scanned.make(
    layers=24, batch=8, seq=512, dim=1024, heads=16, vocab=30522
  ),
}
SCANNED = ("bert_large_scan",)
LINKS = ("10GbE", "25GbE", "nvlink")
DEVICES = (4, 16, 48)


def _abstract(args):
  return jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype), args)


def plan_of(name: str, device: str):
  loss_fn, args, kw = MODELS[name]()
  vg = ooo.value_and_grad(loss_fn, mode="in_order", device=device, **kw)
  box = {}

  def trace(*a):
    box["plan"], _ = vg.plan(a, {})
    return 0.0

  jax.eval_shape(trace, *args)  # shapes only: no arrays of the full batch
  return box["plan"]


def rows(name: str, device: str, devices=DEVICES, links=LINKS) -> list[dict]:
  plan = plan_of(name, device)
  split, sched = plan.split, plan.schedule
  cm = CostModel(device)
  compute = sum(u.cost for u in sched.units)
  total = sum(
    b.nbytes for b in collectives.make_buckets(split, sched.units, sched.streams[0], 1 << 62)
  )
  out = []
  for link in links:
    l = collectives.get_link(link)
    for n in devices:
      one = collectives.build_plan(split, sched, 0, 1 << 62, l, n).makespan
      per = collectives.build_plan(split, sched, 0, 1, l, n).makespan
      best = collectives.plan(split, sched, cm, n, l, cross_step=True)
      bound = max(compute, collectives.allreduce_seconds(l, total, n))
      out.append(
        dict(
          model=name,
          link=link,
          n=n,
          compute=compute,
          one=one,
          per=per,
          ooo=best.cross_step,
          k=best.first_k,
          layers=best.n_layers,
          bucket=best.bucket_bytes,
          bound=bound,
          grad_mb=total / 2**20,
        )
      )
  return out


def scan_rows(name: str, device: str, devices=DEVICES, links=LINKS) -> list[dict]:
  """Simulated: a scanned stack's dW reduced after its loop vs per layer inside it."""
  plan = plan_of(name, device)
  split, sched = plan.split, plan.schedule
  compute = sum(u.cost for u in sched.units)
  out = []
  for link in links:
    l = collectives.get_link(link)
    for n in devices:
      one = collectives.build_plan(split, sched, 0, 1 << 62, l, n, in_loop=False)
      after = collectives.build_plan(split, sched, 0, 1, l, n, in_loop=False)
      inside = collectives.build_plan(split, sched, 0, 1, l, n)
      out.append(
        dict(
          model=name,
          link=link,
          n=n,
          compute=compute,
          one=one.makespan,
          after=after.makespan,
          inside=inside.makespan,
          loop_mb=sum(x.nbytes for x in inside.loops) / 2**20,
          layers=inside.loops[0].trips if inside.loops else 0,
        )
      )
  return out


def _scan_table(models, device) -> list[str]:
  lines = [
    f"Scanned stack, SIMULATED ({device} spec): stacked dW all-reduced after the "
    "loop vs one all-reduce per layer inside it (per-leaf buckets, k = 0)",
    "",
    "| model | stacked dW MiB | layers | link | GPUs | compute ms | one AR ms | "
    "after the loop ms | in the loop ms | in vs after |",
    "|---" * 10 + "|",
  ]
  ms = lambda t: f"{t * 1e3:.1f}"  # noqa: E731
  for m in models:
    for r in scan_rows(m, device):
      lines.append(
        f"| {m} | {r['loop_mb']:.0f} | {r['layers']} | {r['link']} | {r['n']} | "
        f"{ms(r['compute'])} | {ms(r['one'])} | {ms(r['after'])} | "
        f"{ms(r['inside'])} | {r['after'] / r['inside']:.2f}x |"
      )
  return lines


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  ap.add_argument("--device", default="V100", help="cost-model device spec (the paper: V100)")
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  lines = _report.header(
    f"Data parallel, SIMULATED step time (cost model {a.device} spec, "
    "ring all-reduce link model; no GPU ran)"
  )
  plain = [m for m in a.models if m not in SCANNED]
  if plain:
    lines += [
      "| model | grads MiB | link | GPUs | compute ms | one AR ms | per-layer ms | "
      "ooojax ms (k/layers, bucket) | bound ms | ooojax vs one AR | vs per-layer | "
      "bound vs one AR |",
      "|---" * 12 + "|",
    ]
  for m in plain:
    for r in rows(m, a.device):
      ms = lambda t: f"{t * 1e3:.1f}"
      bucket = "per-leaf" if r["bucket"] == 0 else f"{r['bucket'] / 2**20:.2g} MiB"
      lines.append(
        f"| {m} | {r['grad_mb']:.0f} | {r['link']} | {r['n']} | {ms(r['compute'])} | "
        f"{ms(r['one'])} | {ms(r['per'])} | {ms(r['ooo'])} ({r['k']}/{r['layers']}, "
        f"{bucket}) | {ms(r['bound'])} | {r['one'] / r['ooo']:.2f}x | "
        f"{r['per'] / r['ooo']:.2f}x | {r['one'] / r['bound']:.2f}x |"
      )
  scans = [m for m in a.models if m in SCANNED]
  if scans:
    lines += ([""] if plain else []) + _scan_table(scans, a.device)
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
