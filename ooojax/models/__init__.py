"""The model zoo: workloads for benchmarks, tests and `python -m ooojax hlo`.

Flax linen, synthetic data, shapes configurable; installed with ooojax so the
CLI works from a pip install (an installed package never imports `benchmarks/`).

Each `make(...)` returns `(loss_fn, args, kw)`: `grad(loss_fn, **kw)(*args)`.
`ZOO` maps a name to `(make, full-size kwargs, tiny kwargs)`; tiny sizes trace
in seconds on a 2-core CPU (the tests use them).
"""

from ooojax.models import densenet, mobilenet, resnet, transformer

ZOO = {
  "mobilenet_v3_small": (
    mobilenet.make,
    {"size": "small"},
    {"size": "small", "batch": 2, "image": 32, "width": 0.5, "classes": 10},
  ),
  "mobilenet_v3_large": (
    mobilenet.make,
    {"size": "large"},
    {"size": "large", "batch": 2, "image": 32, "width": 0.35, "classes": 10},
  ),
  "densenet121": (
    densenet.make,
    {"growth": 32},
    {"batch": 2, "image": 32, "growth": 4, "blocks": (2, 2), "classes": 10},
  ),
  "resnet50": (resnet.make, {"depth": 50}, {"depth": 26, "batch": 2, "image": 32, "width": 8}),
  "resnet101": (resnet.make, {"depth": 101}, {"depth": 26, "batch": 1, "image": 32, "width": 4}),
  "bert": (
    transformer.make_bert,
    {"layers": 12},
    {"layers": 2, "batch": 2, "seq": 8, "dim": 32, "heads": 4, "vocab": 64},
  ),
  "gpt": (
    transformer.make_gpt,
    {"layers": 12},
    {"layers": 2, "batch": 2, "seq": 8, "dim": 32, "heads": 4, "vocab": 64},
  ),
}
