"""Compile for a GPU that is not there: XLA:GPU schedules on any CPU machine.

The CUDA PJRT plugin can compile for a *compile-only* GPU described by an XLA
`GpuTargetConfigProto` (text), with no driver and no device. This module
builds such devices for named GPUs, compiles any function for them and parses
the scheduled HLO (`passes.hlo.schedule`): which async calls and collectives
XLA made, and what it put between each start and done.

Needs the `gpu-hlo` extra (`pip install -e ".[gpu-hlo]"`: `jax-cuda13-plugin`
and `jax-cuda13-pjrt` at jaxlib's version, as on the GPU machine) and, on a machine without a GPU,
`JAX_PLATFORMS=cpu` in the environment before jax is imported (otherwise the
plugin fails its CUDA check and never registers). `unavailable_reason()` says
what is missing.

>>> import jax.numpy as jnp
>>> from ooojax import gpu_hlo
>>> if gpu_hlo.unavailable_reason() is None:
...   s = gpu_hlo.schedule(lambda a, b: a @ b, jnp.ones((64, 64)), jnp.ones((64, 64)))
...   assert any(i.kind == "gemm" for i in s.entry)

Limits: no autotuning (cuDNN algorithms print as -1, GEMM tilings come from
heuristics); every instruction prints `operation_queue_id: 0` (streams are
assigned from `_xla_stream_annotation` when kernels are emitted); nothing
runs, so no timings and no numerics.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ooojax import _platform
from ooojax.passes.hlo import schedule as hlo_schedule

# Device numbers from XLA's xla/tools/hlo_opt/gpu_specs/*.txtpb (h100_sxm,
# a100_40); H200 = H100 SXM with H200's memory (143771 MiB) and bandwidth
# (4.8 TB/s). The cuDNN / CUDA versions are added from the installed plugin.
_H100_SXM = {
  "threads_per_block_limit": 1024,
  "threads_per_warp": 32,
  "shared_memory_per_block": 49152,
  "shared_memory_per_core": 233472,
  "threads_per_core_limit": 2048,
  "core_count": 132,
  "fpus_per_core": 128,
  "block_dim_limit_x": 2147483647,
  "block_dim_limit_y": 65535,
  "block_dim_limit_z": 65535,
  "memory_bandwidth": 3352320000000,
  "l2_cache_size": 52428800,
  "clock_rate_ghz": 1.98,
  "device_memory_size": 84978434048,
  "shared_memory_per_block_optin": 232448,
  "cuda_compute_capability": (9, 0),
  "registers_per_core_limit": 65536,
  "registers_per_block_limit": 65536,
}
GPUS: dict[str, tuple[dict[str, Any], str]] = {
  "H100": (_H100_SXM, "NVIDIA H100 80GB HBM3"),
  "H200": (
    {**_H100_SXM, "device_memory_size": 150754820096, "memory_bandwidth": 4800000000000},
    "NVIDIA H200",
  ),
  "A100": (
    {
      "threads_per_block_limit": 1024,
      "threads_per_warp": 32,
      "shared_memory_per_block": 49152,
      "shared_memory_per_core": 167936,
      "threads_per_core_limit": 2048,
      "core_count": 108,
      "fpus_per_core": 64,
      "block_dim_limit_x": 2147483647,
      "block_dim_limit_y": 65535,
      "block_dim_limit_z": 65535,
      "memory_bandwidth": 1555200000000,
      "l2_cache_size": 41943040,
      "clock_rate_ghz": 1.41,
      "device_memory_size": 42331013120,
      "shared_memory_per_block_optin": 166912,
      "cuda_compute_capability": (8, 0),
    },
    "NVIDIA A100-SXM4-40GB",
  ),
}

# cuDNN / CUDA runtime versions each plugin release was built with, used only
# when the plugin's own build info cannot be read. (plugin version) -> versions.
_KNOWN_BUILDS = {
  "0.11.2": {"cudnn": (9, 12), "cuda": (13, 0)},  # jax-cuda13-plugin, the GPU image's
}
_DEFAULT_BUILD = {"cudnn": (9, 12), "cuda": (13, 0)}


def _installed_plugin() -> str | None:
  """ "cuda12" / "cuda13" for the installed jax CUDA plugin, or None."""
  return _platform.installed_cuda_plugin()


def _dist_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


@functools.lru_cache(maxsize=None)
def plugin_versions() -> dict[str, Any]:
  """The installed plugin and the cuDNN / CUDA versions it was built with.

  >>> sorted(plugin_versions())
  ['cuda', 'cudnn', 'plugin', 'source', 'version']
  """
  p = _installed_plugin()
  version = _dist_version(f"jax-{p}-plugin") if p else None
  try:
    v = importlib.import_module(f"jax_{p}_plugin._versions")
    dnn, rt = int(v.cudnn_build_version()), int(v.cuda_runtime_build_version())
    return {
      "plugin": p,
      "version": version,
      "source": "plugin build info",
      "cudnn": (dnn // 10000, dnn % 10000 // 100),
      "cuda": (rt // 1000, rt % 1000 // 10),
    }
  except Exception:  # no plugin, or a build whose version helpers moved
    if version in _KNOWN_BUILDS:
      return {"plugin": p, "version": version, "source": "table", **_KNOWN_BUILDS[version]}
    # A guess: the plugin's CUDA major, and the cuDNN of the last known build.
    return {
      "plugin": p,
      "version": version,
      "source": "default (guessed)",
      **_DEFAULT_BUILD,
      **({"cuda": (12, 9)} if p == "cuda12" else {}),
    }


def target_config(gpu: str = "H100", driver: str | None = None) -> str:
  """The `GpuTargetConfigProto` text for a named GPU (see `GPUS`), with the
  installed plugin's cuDNN and CUDA versions. A text proto passes through.
  `driver` ("13.0.0"): the CUDA driver version the device claims; without one
  XLA drops the command types that need CUDA >= 12.3 (CUDA-graph conditionals
  and loops, traced cuBLAS / cuDNN / collectives) from its command buffers.

  >>> "core_count: 132" in target_config("H100")
  True
  """
  if "gpu_device_info" in gpu:
    return gpu
  if gpu.upper() not in GPUS:
    raise ValueError(
      f"unknown gpu {gpu!r}; known: {sorted(GPUS)} (or pass a "
      "GpuTargetConfigProto text containing 'gpu_device_info')"
    )
  info, desc = GPUS[gpu.upper()]
  lines = ["gpu_device_info {"] + ([f'  driver_version: "{driver}"'] if driver else [])
  for k, val in info.items():
    if k == "cuda_compute_capability":
      lines.append(f"  cuda_compute_capability {{ major: {val[0]} minor: {val[1]} }}")
    else:
      lines.append(f"  {k}: {val}")
  lines.append("}")
  ver = plugin_versions()
  lines += [
    'platform_name: "CUDA"',
    f"dnn_version_info {{ major: {ver['cudnn'][0]} minor: {ver['cudnn'][1]} }}",
    f"runtime_version {{ major: {ver['cuda'][0]} minor: {ver['cuda'][1]} }}",
    f'device_description_str: "{desc}"',
  ]
  return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def _topology(gpu: str, n: int):
  from jax.experimental import topologies

  return topologies.get_topology_desc(
    platform="cuda", target_config=target_config(gpu), topology=f"1x1x{n}"
  )


def _probe() -> Exception | None:
  try:
    _topology("H100", 1)
  except Exception as e:  # any failure means: cannot compile here
    return e
  return None


def unavailable_reason() -> str | None:
  """None when compile-only GPU compiles work in this process, else what to do.

  >>> r = unavailable_reason()
  >>> r is None or "gpu-hlo" in r or "JAX_PLATFORMS" in r
  True
  """
  import jaxlib

  jl = jaxlib.__version__
  plugin = _installed_plugin()
  install = (
    f'pip install "ooojax[gpu-hlo]" jax-cuda13-plugin=={jl} '
    f"jax-cuda13-pjrt=={jl} (the plugin must match jaxlib {jl})"
  )
  if plugin is None:
    return f"no CUDA PJRT plugin is installed: {install}"
  pv = _dist_version(f"jax-{plugin}-plugin")
  if pv is not None and pv != jl:
    return (
      f"jax-{plugin}-plugin {pv} does not match jaxlib {jl}: "
      f"pip install jax-{plugin}-plugin=={jl} jax-{plugin}-pjrt=={jl}"
    )
  err = _probe()
  if err is None:
    return None
  first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
  if isinstance(err, NotImplementedError) or "not implemented" in first.lower():
    return (
      "the CUDA plugin did not register in this process (it fails its CUDA check "
      "when no GPU or CUDA libraries are present): set JAX_PLATFORMS=cpu in the "
      "environment before jax is imported, e.g. `JAX_PLATFORMS=cpu python ...` "
      "(or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 to keep the default platforms) "
      f"({type(err).__name__}: {first})"
    )
  return f"compile-only CUDA topology failed: {type(err).__name__}: {first}"


def _mesh_shape(devices: int | Sequence[int], axis_names: Sequence[str]) -> tuple[int, ...]:
  shape = (devices,) if isinstance(devices, (int, np.integer)) else tuple(devices)
  if len(shape) != len(axis_names):
    if len(shape) == 1 and len(axis_names) > 1:
      raise ValueError(
        f"devices={devices!r} is one number but axis_names={tuple(axis_names)} "
        "names several axes: pass the mesh shape, e.g. devices=(2, 4)"
      )
    raise ValueError(f"mesh shape {shape} and axis_names {tuple(axis_names)} differ in length")
  if any(int(d) < 1 for d in shape):
    raise ValueError(f"devices must be positive, got {devices!r}")
  return tuple(int(d) for d in shape)


@functools.lru_cache(maxsize=None)
def _mesh(gpu: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.sharding.Mesh:
  from jax.experimental import topologies

  return topologies.make_mesh(_topology(gpu, math.prod(shape)), shape, axes)


def mesh(
  gpu: str = "H100", devices: int | Sequence[int] = 1, axis_names: Sequence[str] = ("d",)
) -> jax.sharding.Mesh:
  """A `jax.sharding.Mesh` of compile-only devices (cached per gpu, shape, axes).

  Args:
    gpu: a name in `GPUS` ("H100", "H200", "A100") or a target config text.
    devices: the number of devices, or the mesh shape for several axes.
    axis_names: one name per mesh axis.

  >>> if unavailable_reason() is None:
  ...   assert mesh("H100", (2, 4), ("dp", "pp")).devices.size == 8
  """
  return _mesh(gpu, _mesh_shape(devices, axis_names), tuple(axis_names))


def _default_mesh(gpu: str, devices: int | Sequence[int]) -> jax.sharding.Mesh:
  if isinstance(devices, (int, np.integer)):
    return mesh(gpu, devices, ("d",))
  return mesh(gpu, devices, tuple(f"d{i}" for i in range(len(devices))))


def _place(args, m: jax.sharding.Mesh):
  """Every leaf as a ShapeDtypeStruct on `m`: replicated unless it already
  carries a sharding on `m`'s devices."""
  rep = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec())
  devs = set(m.devices.flat)

  def one(a):
    if isinstance(a, (bool, int, float, complex)):
      return jax.ShapeDtypeStruct((), jax.numpy.result_type(a), sharding=rep, weak_type=True)
    s = getattr(a, "sharding", None)
    if isinstance(a, jax.ShapeDtypeStruct) and s is not None:
      abstract = isinstance(getattr(s, "mesh", None), jax.sharding.AbstractMesh)
      if not abstract and set(s.device_set) <= devs:
        return a
      if abstract and tuple(s.mesh.shape.items()) == tuple(m.shape.items()):
        # traced under `jax.set_mesh` (an abstract mesh of `m`'s shape): placed on `m`
        return jax.ShapeDtypeStruct(
          a.shape, a.dtype, sharding=jax.sharding.NamedSharding(m, s.spec)
        )
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
      raise TypeError(
        f"gpu_hlo: argument leaf {a!r} is not an array or ShapeDtypeStruct; "
        "close over static values with functools.partial"
      )
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)

  return jax.tree.map(one, args)


def compiled(
  fn,
  *args,
  gpu: str = "H100",
  devices: int | Sequence[int] = 1,
  mesh: jax.sharding.Mesh | None = None,
  compiler_options: Mapping[str, Any] | None = None,
):
  """`jax.jit(fn).lower(*args).compile(...)` for compile-only `gpu` devices.

  The `jax.stages.Compiled` (for `memory_analysis()`, `as_text()`); see
  `compile_text` for the arguments.
  """
  reason = unavailable_reason()
  if reason is not None:
    raise RuntimeError(f"cannot compile for a GPU here: {reason}")
  m = mesh if mesh is not None else _default_mesh(gpu, devices)
  f = fn if hasattr(fn, "lower") else jax.jit(fn)
  return f.lower(*_place(args, m)).compile(compiler_options=dict(compiler_options or {}))


def compile_text(
  fn,
  *args,
  gpu: str = "H100",
  devices: int | Sequence[int] = 1,
  mesh: jax.sharding.Mesh | None = None,
  compiler_options: Mapping[str, Any] | None = None,
) -> str:
  """The optimized, scheduled HLO of `fn(*args)` compiled for `gpu`.

  Args:
    fn: a function or a jitted function.
    *args: arrays or `jax.ShapeDtypeStruct`s (pytrees of them); replicated on
      the mesh unless a ShapeDtypeStruct already carries a sharding on it.
    gpu: a name in `GPUS` or a `GpuTargetConfigProto` text.
    devices: compile-only devices (`1x1xN` topology) when `mesh` is None.
    mesh: a mesh from `mesh(...)`, for sharded arguments (`shard_map`).
    compiler_options: XLA debug options, e.g.
      `{"xla_gpu_all_reduce_combine_threshold_bytes": 0}`.

  >>> import jax.numpy as jnp
  >>> if unavailable_reason() is None:
  ...   assert "is_scheduled=true" in compile_text(jnp.sin, jnp.ones(8))
  """
  return compiled(
    fn, *args, gpu=gpu, devices=devices, mesh=mesh, compiler_options=compiler_options
  ).as_text()


def schedule(
  fn,
  *args,
  gpu: str = "H100",
  devices: int | Sequence[int] = 1,
  mesh: jax.sharding.Mesh | None = None,
  compiler_options: Mapping[str, Any] | None = None,
) -> hlo_schedule.HloSchedule:
  """`passes.hlo.schedule.parse(compile_text(...))`: the compiled schedule as data.

  >>> import jax.numpy as jnp
  >>> if unavailable_reason() is None:
  ...   assert schedule(jnp.sin, jnp.ones(8)).pairs == ()
  """
  return hlo_schedule.parse(
    compile_text(fn, *args, gpu=gpu, devices=devices, mesh=mesh, compiler_options=compiler_options)
  )


def pgle_options(compiled_or_text, n_devices: int, link, path: str | None = None) -> dict[str, str]:
  """XLA compiler options that hand XLA:GPU's scheduler each collective's cost on `link`.

  Compile a step once (compile-only here, or on the GPUs it will run on), pass the
  result (a `jax.stages.Compiled` or its `as_text()`) and the link
  ("IB400", "IB100", "25GbE", ... or a `passes.simulate.Link`), and compile the
  same jitted step again with `compiler_options=` these: the profile-guided
  latency estimator then opens each collective's window for the link's transfer
  time instead of XLA's NVLink-fast estimate (`passes.hlo.pgle`). The profile is
  written to `path` (default: a temporary file, left for the compile to read).

  >>> if unavailable_reason() is None:
  ...   import jax.numpy as jnp
  ...   opts = pgle_options(compile_text(jnp.sin, jnp.ones(8)), 1, "IB400")
  ...   assert list(opts) == ["xla_gpu_pgle_profile_file_or_directory_path"]
  """
  from ooojax.passes.hlo import pgle

  text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
  return pgle.compiler_options(text, n_devices, link, path)
