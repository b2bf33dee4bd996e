"""The model matrix: models with the features real training code has
(`ooojax.models.features`) in every mode, against `jax.grad`.

Each cell: gradients and aux outputs equal `jax.grad`'s to float32 tolerance
(bf16: to bf16's), or, where `jax.grad` refuses the model, the same error
type. `single_gpu` runs with the H100 cost model, so dW clusters go to stream
1 (pinned calls) on CPU too, and is compiled for a compile-only H100, where
the heavy dW calls overlapped are counted. The ResNet-18 with synchronized
BatchNorm (issue 22's crash) also runs at a realistic size and as an SGD
train step.
"""

import functools

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

from ooojax import gpu_hlo
from ooojax.models import features, matrix
from ooojax.passes.pipeline.cut import CutError
from tests.conftest import assert_trees_close

NAMES = sorted(features.CASES)
no_gpu_hlo = pytest.mark.skipif(
  gpu_hlo.unavailable_reason() is not None,
  reason=f"compile-only GPU: {gpu_hlo.unavailable_reason()}",
)


@functools.lru_cache(maxsize=None)
def _case(name):
  return features.make(name)


def _check(case, mode, **kw):
  if case.raises is not None:
    with pytest.raises(case.raises):
      jax.grad(case.loss, has_aux=True)(*case.args)
    with pytest.raises(case.raises):
      matrix.cell(case, mode, **kw)
    return
  got, want = matrix.cell(case, mode, **kw)
  assert_trees_close(got, want, rtol=case.rtol, atol_scale=case.rtol)


@pytest.mark.parametrize("mode", ["in_order", "single_gpu", "dp_shard_map", "dp_pmap"])
@pytest.mark.parametrize("name", NAMES)
def test_cell(name, mode):
  case = _case(name)
  assert (case.stack is not None) == (name in features.STACKED)
  _check(case, mode)


@pytest.mark.parametrize("name", features.STACKED)
def test_pipeline_cell(name):
  _check(_case(name), "pipeline")


@pytest.mark.parametrize(
  "name,schedule",
  [
    ("attention_masked", "zb-h1"),
    ("linen_scan", "interleaved"),
    ("remat_save_only_these_names", "zb-v"),
  ],
)
def test_pipeline_cell_other_schedules(name, schedule):
  _check(_case(name), "pipeline", schedule=schedule)


# What automatic stage cutting cannot take, and the error it raises instead
AUTO_REFUSED = {
  "while_differentiated": CutError,  # no stack
}


# ResNet-18 per microbatch: at the case's 8 rows each BatchNorm of microbatch m
# normalises 2 rows (1 per data replica), 1x1 pixels in the last stage, so float32
# noise grows to 4e-3 (the reference alone, XLA O0 against O2); at 32 rows both
# agree to 1e-6.
_AUTO_CASE = {"resnet18_sync_bn": lambda: features.resnet18_sync_bn(batch=32)}


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_auto_cell(name):
  case = _AUTO_CASE[name]() if name in _AUTO_CASE else _case(name)
  if name in AUTO_REFUSED:
    with pytest.raises(
      AUTO_REFUSED[name], match=None if name == "dropout_rng" else "stage_fn|leading size"
    ):
      matrix.cell(case, "pipeline_auto")
    return
  got, want = matrix.cell(case, "pipeline_auto")
  assert_trees_close(got, want, rtol=case.rtol, atol_scale=case.rtol)


# heavy dW calls overlapped on the compile-only H100 at the matrix's sizes
# (measured with jax 0.11.2); a case not listed puts nothing on stream 1 there.
H100_OVERLAP = {
  "bf16_loss_scaling": 4,
  "attention_masked": 7,
  "attention_custom_vjp": 7,
  "moe_top_k": 5,
  "cond_while": 2,
  "linen_scan": 1,
  "nnx_scan": 1,
  **{f"remat_{p}": 7 for p in features.REMAT_POLICIES},
}
# The same counts on the newest jax: its latency-hiding scheduler places the
# calls, within the two-in-flight plan of passes.slots.


@no_gpu_hlo
@pytest.mark.parametrize("name", [n for n in NAMES if n != "resnet18_sync_bn"])  # below
def test_single_gpu_compiles_for_h100(name):
  case = _case(name)
  if case.raises is not None:
    with pytest.raises(case.raises):
      matrix.h100(case)
    return
  k, n = matrix.h100(case)
  assert k >= H100_OVERLAP.get(name, 0), (k, n)


# ResNet-18 with synchronized BatchNorm big enough that the H100 cost model
# puts conv dW clusters on stream 1 (pinned calls; at the real size of
# benchmarks/matrix.py, 16 of 20 overlap). Issue 22's crash: a pinned call's
# buffers dropped when an equation the stager cannot hold (the BatchNorm
# pmean) flushed the pending run before the call's anchor.
@functools.lru_cache(maxsize=None)
def _resnet_pinned():
  return features.resnet18_sync_bn(batch=8 * matrix.DEVICES, hw=16, width=16)


def test_resnet18_sync_batchnorm_pinned_calls_on_cpu():
  _check(_resnet_pinned(), "single_gpu")


@no_gpu_hlo
def test_resnet18_sync_batchnorm_compiles_for_h100():
  k, n = matrix.h100(_resnet_pinned())
  assert n >= 10 and k >= n // 2  # dW convs on stream 1 beside dX convs (11 / 20)


OPT = optax.sgd(0.1, momentum=0.9)


def _train_step(case, mode, mesh):
  """shard_map'd SGD step: ((params, stats, opt_state), x, y) -> (state, ce)."""
  g = matrix._per_device(case, mode)

  def step(state, x, y):
    params, stats, opt_state = state
    grads, aux = g(params, stats, x, y)
    upd, opt_state = OPT.update(grads, opt_state, params)
    return (optax.apply_updates(params, upd), aux["batch_stats"], opt_state), aux["ce"]

  ax = features.AXIS
  return jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(P(), P(ax), P(ax)), out_specs=(P(), P()), check_vma=False
    )
  )


@functools.lru_cache(maxsize=None)  # the "jax" reference, trained once for both modes
def _sgd_two_steps(mode):
  case = _case("resnet18_sync_bn")
  stats, x, y = case.batch
  mesh = jax.sharding.Mesh(jax.devices()[: matrix.DEVICES], (features.AXIS,))
  state, step = (case.params, stats, OPT.init(case.params)), _train_step(case, mode, mesh)
  losses = []
  for _ in range(2):
    state, ce = step(state, x, y)
    losses.append(ce)
  return state[:2], losses


@pytest.mark.parametrize("mode", ["single_gpu", "dp_shard_map"])
def test_resnet18_sync_batchnorm_sgd_train_step(mode):
  assert_trees_close(_sgd_two_steps(mode), _sgd_two_steps("jax"))


@no_gpu_hlo
def test_resnet18_sync_batchnorm_train_step_compiles_for_h100():
  case = _resnet_pinned()
  mesh = gpu_hlo.mesh("H100", matrix.DEVICES, (features.AXIS,))
  sd = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
  state = (case.params, case.batch[0], OPT.init(case.params))
  s = gpu_hlo.schedule(
    _train_step(case, "single_gpu", mesh), *jax.tree.map(sd, (state, *case.batch[1:])), mesh=mesh
  )
  k, n = s.heavy_overlap()
  assert n >= 10 and k >= n // 2
  assert s.pairs_of("all-reduce")  # the synchronized batch statistics
