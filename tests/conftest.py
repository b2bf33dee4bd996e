import os
import shutil
import tempfile

# One XLA compile per distinct program in a run: the xdist workers and the
# processes tests start (notebook kernels, gpu.sh's dry run, multi-process
# workers) inherit this environment and share a persistent compilation cache,
# new and empty for each run (on 2 cores most of a test's time is XLA compiling
# the same reference or stage program another test compiled already). Op names
# and source locations are part of the key: tests read them from compiled HLO.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="ooojax-tests-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY", "true")

# Fake CPU devices for the multi-device modes; must precede the jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("MPLBACKEND", "Agg")
# The planner's tests plan with the uncalibrated device presets (a stream call at
# 2 us): the mechanism (windows XLA holds, gradients) needs windows planned. The
# shipped GPU calibrations (ooojax/calibration/, issue 50) price a pinned call at
# 77-105 us and plan none on these models; tests/test_stream_cost.py reads them.
os.environ.setdefault("OOOJAX_CALIBRATION", "none")
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


# A compile-only GPU has no device to time candidates on, yet XLA:GPU's fusion
# autotuner compiles every fusion's candidate emitters and then keeps the
# default: about half of each compile-only compile (MobileNetV3-small's
# single_gpu gradient: 165 s -> 63 s), for the same scheduled HLO
# (tests/test_xla_flags.py). Not for every program: without it a Triton GEMM
# fusion cuBLAS cannot take (the batched dots of tests/test_scan.py's skewed
# transformer) finds no config and the compile fails. So only the tests below,
# each run both ways, compile without it (their `ooojax.gpu_hlo` compiles); a
# test whose program changes and then fails to compile leaves the list.
NO_FUSION_AUTOTUNER = {"xla_gpu_experimental_enable_fusion_autotuner": False}
_WITHOUT_FUSION_AUTOTUNER = (
  "tests/test_overlap.py::",
  "tests/test_matrix.py::test_single_gpu_compiles_for_h100",
  "tests/test_matrix.py::test_resnet18_sync_batchnorm_compiles_for_h100",
  "tests/test_matrix.py::test_resnet18_sync_batchnorm_train_step_compiles_for_h100",
  "tests/test_data_parallel_gspmd_hlo.py::test_data_parallel_reductions_overlap_backward_gemms",
  "tests/test_pipeline_graphs.py::test_h100_tick_loop_is_one_cuda_graph_under_graphs",
  "tests/test_pipeline_weight_slices.py::test_h100_tick_loop_launches_fewer_slice_kernels",
  "tests/test_pipeline_select.py::test_h100_tick_loop_has_no_conditional",
  "tests/test_pipeline_train_step.py::test_lag_one_on_four_stages_compiles_with_the_tables_options",
  "tests/test_pipeline_data_stage.py::test_train_step_and_explain_on_compile_only_gpus",
  "tests/test_pipeline_memory.py::test_h100_ticks_that_write_every_record_leave_out_their_conds",
  "tests/test_data_parallel_gspmd_hlo.py::test_fsdp_reduce_scatters_start_before_the_backward_ends",
  "tests/test_data_parallel_gspmd_hlo.py::test_fsdp_gathers_each_layer_in_the_forward_and_again",
  "tests/test_explain_modes.py::test_pipeline_compiled_",
  "tests/test_explain_modes.py::test_cli_",
  "tests/test_scan_dp.py::test_h100_loop_body_all_reduce_overlaps_compute",
  "tests/test_bench_pipeline_windows.py::",
  "tests/test_bench_executor_cost.py::",
  "tests/test_stream_pairs.py::",
  "tests/test_hlo_replay.py::",
  "tests/test_pipeline_hlo.py::",
  "tests/test_gpu_hlo.py::",
  "tests/test_xla_flags.py::",
)


@pytest.fixture(autouse=True)
def _no_fusion_autotuner(request, monkeypatch):
  """The listed tests' `ooojax.gpu_hlo` compiles without the fusion autotuner."""
  if not request.node.nodeid.startswith(_WITHOUT_FUSION_AUTOTUNER):
    return
  from ooojax import gpu_hlo

  compiled = gpu_hlo.compiled

  def without(fn, *args, compiler_options=None, **kw):
    return compiled(
      fn, *args, compiler_options={**NO_FUSION_AUTOTUNER, **(compiler_options or {})}, **kw
    )

  monkeypatch.setattr(gpu_hlo, "compiled", without)


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


def run_workers(worker: str, outs, *extra) -> None:
  """`python tests/WORKER PROCESS_ID N PORT OUT *extra` for each of the N `outs`:
  processes on localhost (jax.distributed + gloo, one CPU device each). A
  failed worker ends its peers at once; no time limit decides the verdict,
  only a hang's (`benchmarks.pipeline_mp.wait_workers`)."""
  import socket
  import subprocess
  import sys

  from benchmarks.pipeline_mp import wait_workers

  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = str(s.getsockname()[1])
  script = os.path.join(os.path.dirname(__file__), worker)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  procs = [
    subprocess.Popen(
      [sys.executable, script, str(i), str(len(outs)), port, str(out), *extra],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i, out in enumerate(outs)
  ]
  wait_workers(procs)


def pytest_unconfigure(config):
  # the process that made the run's cache removes it (xdist: the controller)
  if _OWN_CACHE and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# The suite's longest tests (tens of seconds each: compile-only GPU schedules of
# whole models, notebooks, gpu.sh's dry run, the zoo's big models) run first, so
# xdist's work stealing ends on short ones instead of one worker finishing a long
# test alone.
_LONG_FIRST = (
  "tests/test_overlap.py::test_every_heavy_dw_call_has_dx_work_inside_its_window",
  "tests/test_gpu_sh.py::test_dry_run_writes_every_steps_file",
  "tests/test_notebooks.py::",
  "tests/test_zoo.py::",
  "tests/test_pipeline_mp.py::test_two_stage_processes_match_jax_grad",
)


def pytest_collection_modifyitems(config, items):
  rank = lambda it: next(  # noqa: E731
    (i for i, p in enumerate(_LONG_FIRST) if it.nodeid.startswith(p)), len(_LONG_FIRST)
  )
  items.sort(key=rank)  # stable: the rest keep their order
