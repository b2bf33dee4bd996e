"""Models with the features real training code has: the rows of the model matrix.

Each `make(name, real=False)` returns a `Case`: `loss(params, *batch) ->
(scalar, aux)` with `has_aux` semantics, its arguments, and how the batch
splits over a data axis. `real=True` gives sizes for the compiled-H100 overlap
figures; the default sizes compile in seconds on a 2-core CPU and are just
big enough (GEMMs of 2^23 FLOPs and up) that the H100 cost model puts dW
clusters on stream 1, so the CPU cells run the pinned-call path too.

Cases whose model is a stack of identical blocks also carry a `Stack`: the
same model as `ooo.pipeline.value_and_grad`'s `(stage_fn, loss_fn, input_fn)`
with per-block parameters stacked on a leading axis.

The rows live in modules by idea (`_feature_training`, `_feature_transformer`,
`_feature_control`; the types in `_feature_case`); this module is the registry.
"""

from __future__ import annotations

import functools

from ooojax.models._feature_case import AXIS, Case, Stack
from ooojax.models._feature_control import (
  cond_while,
  linen_scan,
  nnx_scan,
  while_differentiated,
)
from ooojax.models._feature_training import (
  REMAT_POLICIES,
  ResNet18,
  _BasicBlock,
  bf16_loss_scaling,
  dropout_rng,
  remat,
  resnet18_sync_bn,
)
from ooojax.models._feature_transformer import (
  attention_custom_vjp,
  attention_kernel,
  attention_masked,
  moe_top_k,
)

__all__ = [
  "AXIS",
  "CASES",
  "REMAT_POLICIES",
  "STACKED",
  "Case",
  "ResNet18",
  "Stack",
  "_BasicBlock",
  "attention_custom_vjp",
  "attention_kernel",
  "attention_masked",
  "bf16_loss_scaling",
  "cond_while",
  "dropout_rng",
  "linen_scan",
  "make",
  "moe_top_k",
  "nnx_scan",
  "remat",
  "resnet18_sync_bn",
  "while_differentiated",
]


CASES = {
  "resnet18_sync_bn": resnet18_sync_bn,
  "dropout_rng": dropout_rng,
  "bf16_loss_scaling": bf16_loss_scaling,
  **{f"remat_{p}": functools.partial(remat, p) for p in REMAT_POLICIES},
  "attention_masked": attention_masked,
  "attention_custom_vjp": attention_custom_vjp,
  "moe_top_k": moe_top_k,
  "cond_while": cond_while,
  "while_differentiated": while_differentiated,
  "linen_scan": linen_scan,
  "nnx_scan": nnx_scan,
}


# the cases whose model is a stack of identical blocks (they carry a `Stack`)
STACKED = (
  "bf16_loss_scaling",
  *(f"remat_{p}" for p in REMAT_POLICIES),
  "attention_masked",
  "attention_custom_vjp",
  "moe_top_k",
  "cond_while",
  "linen_scan",
  "nnx_scan",
)


def make(name: str, real: bool = False) -> Case:
  """The matrix row `name` (one of `CASES`), tiny or at a `real` size."""
  if name not in CASES:
    raise ValueError(f"unknown case {name!r}; known: {sorted(CASES)}")
  return CASES[name](real=real)
