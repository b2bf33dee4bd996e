import os

# Fake CPU devices for the multi-device modes; must precede the jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("MPLBACKEND", "Agg")
# CPU tests; the CUDA plugin then registers for compile-only GPU compiles
# (ooojax.gpu_hlo). A machine with a GPU keeps it.
if not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Tests that read XLA:CPU's compiled HLO (control-predecessors, `call(` rather
# than `call-start(`) or compile for a compile-only GPU beside a CPU host hold
# on the CPU backend only; on a GPU machine (benchmarks/gpu.sh) they skip.
cpu_backend_only = pytest.mark.skipif(
  jax.default_backend() != "cpu",
  reason=f"reads XLA:CPU's compiled HLO; the default backend here is {jax.default_backend()}",
)


def assert_trees_close(a, b, rtol=1e-5, atol_scale=1e-5):
  """float32 comparison scaled by each leaf's magnitude."""
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb, f"tree mismatch: {ta} vs {tb}"
  for x, y in zip(la, lb):
    if jax.dtypes.issubdtype(getattr(y, "dtype", np.float32), jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
    scale = max(float(np.max(np.abs(y))) if y.size else 0.0, 1.0)
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol_scale * scale)


@pytest.fixture
def close():
  return assert_trees_close
