"""benchmarks/executor_cost.py counts the weight-slice copies of a compiled step."""

import jax
import numpy as np
import pytest

from benchmarks import _mlp_model as model, executor_cost
from ooojax import gpu_hlo

L, D, H = 2, 16, 32


def _hlo(name, mesh, compile_text):
  params, batch = model.make_params(1, L, D, H), model.make_batch(16, D)
  f, args = executor_cost.steps(4, mesh, params, batch)[name]
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  return compile_text(f, *jax.tree.map(sds, args))


def _cpu_text(f, *a):
  return jax.jit(f).lower(*a).compile().as_text()


def test_the_executor_slices_each_layer_in_f_and_again_in_b_on_cpu():
  """XLA:CPU copies a layer's weights out of the stack before each dot: the
  accumulated scan once per layer (its forward and backward share the slice),
  the executor in F and again in B (separate branches of its tick switch)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("stage",))
  acc = executor_cost.weight_slice_copies(_hlo("accumulated/4", mesh, _cpu_text), D, H)
  ex = executor_cost.weight_slice_copies(_hlo("executor/4", mesh, _cpu_text), D, H)
  assert acc == 2 * L and acc < ex <= 2 * acc, (acc, ex)


def test_a_flax_loop_pipelined_automatically_copies_no_weights():
  """Automatic cutting keeps each layer of a Python loop in arrays of its own
  (`passes.pipeline.state.columns`), so no stage slices weights out of a stack:
  no copy, where the stacked form copies each layer in F and again in B."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("stage",))
  for name in ("loop accumulated/4", "loop automatic/4"):
    assert executor_cost.weight_slice_copies(_hlo(name, mesh, _cpu_text), D, H) == 0, name


@pytest.mark.skipif(gpu_hlo.unavailable_reason() is not None, reason="no compile-only GPU")
def test_cublas_gemms_read_the_slices_in_place_on_h100():
  mesh = gpu_hlo.mesh("H100", 1, ("stage",))
  opts = {"xla_gpu_enable_triton_gemm": False}
  text = lambda f, *a: gpu_hlo.compile_text(f, *a, mesh=mesh, compiler_options=opts)  # noqa: E731
  for name in ("accumulated/4", "executor/4"):
    assert executor_cost.weight_slice_copies(_hlo(name, mesh, text), D, H) == 0, name


@pytest.mark.skipif(gpu_hlo.unavailable_reason() is not None, reason="no compile-only GPU")
def test_a_flax_loop_pipelined_automatically_copies_no_weights_before_triton_gemms(monkeypatch):
  # static slices (a GPU's default reads them as dynamic ones: tests/test_pipeline_weight_slices.py)
  monkeypatch.setenv("OOOJAX_WEIGHT_SLICES", "static")
  mesh = gpu_hlo.mesh("H100", 1, ("stage",))
  text = lambda f, *a: gpu_hlo.compile_text(f, *a, mesh=mesh)  # noqa: E731
  assert executor_cost.weight_slice_copies(_hlo("executor/4", mesh, text), D, H) > 0
  assert executor_cost.weight_slice_copies(_hlo("loop automatic/4", mesh, text), D, H) == 0
