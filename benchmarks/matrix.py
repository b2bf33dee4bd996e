"""The model matrix as a table: every `ooojax.models.features` case in every mode.

Cells: "equal" (gradients and aux equal `jax.grad`'s), "same error" (jax.grad
refuses the model and ooojax raises the same type), "n/a" (no hand-written
pipeline form: not a stack of identical blocks), or the error (pipeline_auto:
the models automatic stage cutting refuses, with its message). The H100 column is the
single-GPU gradient compiled for a compile-only H100 at the case's real size:
heavy dW calls with dX GEMMs/convs between start and done, of all heavy dW
calls on stream 1.

  python -m benchmarks.matrix [--cases a,b] [--no-h100] [--write]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._report import emit, header  # noqa: E402
from ooojax import gpu_hlo  # noqa: E402
from ooojax.models import features, matrix  # noqa: E402

MODES = matrix.MODES


def _close(got, want, rtol):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if jax.dtypes.issubdtype(getattr(b, "dtype", np.float32), jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.max(np.abs(b))) if b.size else 0.0, 1.0)
    if a.shape != b.shape or not np.allclose(a, b, rtol=rtol, atol=rtol * scale):
      return False
  return jax.tree.structure(got) == jax.tree.structure(want)


def _error(e: Exception) -> str:
  return f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"


def cell(case, mode) -> str:
  if case.raises is not None:
    try:
      matrix.cell(case, mode)
    except matrix.NotAStack:
      return "n/a"
    except case.raises:
      return "same error"
    except Exception as e:  # noqa: BLE001 - the table reports it
      return _error(e)
    return "no error (jax.grad raises)"
  try:
    got, want = matrix.cell(case, mode)
  except matrix.NotAStack:
    return "n/a"
  except Exception as e:  # noqa: BLE001
    return _error(e)
  return "equal" if _close(got, want, case.rtol) else "**differs**"


def h100(name) -> str:
  case = features.make(name, real=True)
  try:
    k, n = matrix.h100(case)
  except Exception as e:  # noqa: BLE001
    return "same error" if case.raises and isinstance(e, case.raises) else _error(e)
  return f"{k} of {n}"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
  ap.add_argument("--no-h100", action="store_true", help="skip the compile-only H100 column")
  ap.add_argument("--write", action="store_true", help="append to benchmarks/RESULTS.md")
  a = ap.parse_args(argv)
  names = a.cases.split(",") if a.cases else list(features.CASES)
  do_h100 = not a.no_h100 and gpu_hlo.unavailable_reason() is None
  cols = list(MODES) + (["H100 dW overlap (real size)"] if do_h100 else [])
  rows = []
  for name in names:
    t0 = time.perf_counter()
    case = features.make(name)
    row = [cell(case, m) for m in MODES]
    if do_h100:
      row.append(h100(name))
    rows.append((name, case.features, row))
    print(f"{name}: {row} ({time.perf_counter() - t0:.0f} s)", flush=True)
  lines = header(
    "Model matrix (benchmarks/matrix.py): gradients vs jax.grad, H100 overlap compile-only"
  )
  lines += [f"| case | features | {' | '.join(cols)} |", "|" + "---|" * (len(cols) + 2)]
  lines += [f"| {n} | {f} | {' | '.join(r)} |" for n, f, r in rows]
  lines += [
    "",
    "Cells at the matrix's test sizes, float32 tolerance (bf16: 2e-2). "
    "in_order / single_gpu: `ooo.grad` (single_gpu with the H100 cost model, so "
    "dW clusters take the pinned stream-1 path on CPU too), under `jax.shard_map` "
    f"over {matrix.DEVICES} devices where the loss names the data axis; dp_*: "
    '`mode="data_parallel"` against `pmean(jax.grad)`; pipeline: '
    f"`ooo.pipeline.value_and_grad` on {matrix.STAGES} stages, 4 microbatches, "
    "1F1B, against the unrolled stack averaged over the microbatches; "
    "pipeline_auto: the same from the unmodified loss (`value_and_grad(loss_fn, "
    "...)`, stages cut by ooojax), against the loss averaged over the microbatches.",
  ]
  emit(lines, a.write)


if __name__ == "__main__":
  main()
