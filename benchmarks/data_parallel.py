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

  python -m benchmarks.data_parallel [--models resnet50 resnet101 bert_large] [--write]
"""
from __future__ import annotations

import argparse

import jax

import ooojax as ooo
from benchmarks import _report
from benchmarks.models import resnet, transformer
from passes import collectives
from passes.cost import CostModel

MODELS = {
    # the paper's per-GPU batches: 128 (ResNet-50), 96 (ResNet-101)
    "resnet50": lambda: resnet.make(50, batch=128, image=224, real_init=False),
    "resnet101": lambda: resnet.make(101, batch=96, image=224, real_init=False),
    "bert_large": lambda: transformer.make_bert(layers=24, batch=8, seq=512, dim=1024,
                                                heads=16, vocab=30522),
}
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
  total = sum(b.nbytes for b in collectives.make_buckets(split, sched.units, sched.streams[0],
                                                         1 << 62))
  out = []
  for link in links:
    l = collectives.get_link(link)
    for n in devices:
      one = collectives.build_plan(split, sched, 0, 1 << 62, l, n).makespan
      per = collectives.build_plan(split, sched, 0, 1, l, n).makespan
      best = collectives.plan(split, sched, cm, n, l, cross_step=True)
      bound = max(compute, collectives.allreduce_seconds(l, total, n))
      out.append(dict(model=name, link=link, n=n, compute=compute, one=one, per=per,
                      ooo=best.cross_step, k=best.first_k, layers=best.n_layers,
                      bucket=best.bucket_bytes, bound=bound, grad_mb=total / 2**20))
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  ap.add_argument("--device", default="V100", help="cost-model device spec (the paper: V100)")
  ap.add_argument("--write", action="store_true")
  a = ap.parse_args(argv)
  lines = _report.header(f"Data parallel, SIMULATED step time (cost model {a.device} spec, "
                         "ring all-reduce link model; no GPU ran)")
  lines += ["| model | grads MiB | link | GPUs | compute ms | one AR ms | per-layer ms | "
            "ooojax ms (k/layers, bucket) | bound ms | ooojax vs one AR | vs per-layer | "
            "bound vs one AR |", "|---" * 12 + "|"]
  for m in a.models:
    for r in rows(m, a.device):
      ms = lambda t: f"{t * 1e3:.1f}"
      bucket = "per-leaf" if r["bucket"] == 0 else f"{r['bucket'] / 2**20:.2g} MiB"
      lines.append(f"| {m} | {r['grad_mb']:.0f} | {r['link']} | {r['n']} | {ms(r['compute'])} | "
                   f"{ms(r['one'])} | {ms(r['per'])} | {ms(r['ooo'])} ({r['k']}/{r['layers']}, "
                   f"{bucket}) | {ms(r['bound'])} | {r['one'] / r['ooo']:.2f}x | "
                   f"{r['per'] / r['ooo']:.2f}x | {r['one'] / r['bound']:.2f}x |")
  _report.emit(lines, a.write)


if __name__ == "__main__":
  main()
