"""2 processes, one pipeline stage each (jax.distributed + gloo on localhost), give
jax.grad of the unpipelined model: the benchmark's worker code path, small model."""
import os

import jax
import numpy as np
import pytest

from benchmarks import _mlp_model as model
from benchmarks import pipeline_mp

SIZES = {"layers": 4, "dim": 32, "hidden": 64, "batch": 16}
SCHEDULES = pipeline_mp.SCHEDULES   # every one; interleaved / zb-v: 4 virtual stages
M = 4


def test_two_stage_processes_match_jax_grad(tmp_path):
  out = str(tmp_path / "grads.npz")
  cfg = {**SIZES, "schedules": list(SCHEDULES), "microbatches": [M], "rounds": 0,
         "warmup": 1, "check": True, "out": out}
  try:
    pipeline_mp.run_workers(cfg, 2, cores=None if (os.cpu_count() or 1) >= 2 else [0],
                            timeout=120)
  except RuntimeError as e:
    # The one public sign of a jaxlib without them: the workers fail to set them up.
    if "gloo" in str(e).lower() and "collectives" in str(e).lower():
      pytest.skip(f"gloo CPU collectives unavailable: {str(e)[-300:]}")
    raise
  got = dict(np.load(out))
  params = model.make_params(2, SIZES["layers"], SIZES["dim"], SIZES["hidden"])
  batch = model.make_batch(SIZES["batch"], SIZES["dim"])
  with jax.default_matmul_precision("highest"):
    loss, grads = jax.jit(jax.value_and_grad(model.flat_loss))(params, batch)
  for name in SCHEDULES:
    key = f"{name}/{M}"
    np.testing.assert_allclose(got[f"{key}/loss"], loss, rtol=1e-5, atol=1e-6)
    for k in ("w1", "w2"):
      # (V, layers / V, ...) stacks of the same layers in the same order
      assert got[f"{key}/{k}"].size == grads[k].size
      np.testing.assert_allclose(got[f"{key}/{k}"].reshape(grads[k].shape), grads[k],
                                 rtol=1e-5, atol=1e-6,
                                 err_msg=f"{name} d{k}")
