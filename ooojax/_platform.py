"""Pick the CPU platform quietly where a CUDA plugin is installed but no GPU exists.

Runs before jax is imported (from `ooojax/__init__`), so it imports no jax.
With the `gpu-hlo` extra installed on a machine without a GPU, jax would try
the CUDA plugin, print a long "Unable to load CUDA" traceback, fall back to
CPU, and leave the plugin unregistered (so compile-only GPU compiles fail).
Setting `JAX_PLATFORMS=cpu` gives the same CPU backend without the noise and
keeps the plugin usable for compile-only compiles. Nothing changes when jax is
already imported, `JAX_PLATFORMS` is set, or the machine shows an NVIDIA GPU.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys


def gpu_present() -> bool:
  """True when this machine shows an NVIDIA GPU (device nodes or a driver)."""
  return bool(
    glob.glob("/dev/nvidia[0-9]*")
    or os.path.exists("/proc/driver/nvidia/version")
    or os.path.exists("/dev/dxg")
  )


def installed_cuda_plugin() -> str | None:
  """ "cuda13" / "cuda12" for the installed jax CUDA plugin (newest first), or None."""
  for p in ("cuda13", "cuda12"):
    try:
      if importlib.util.find_spec(f"jax_plugins.xla_{p}") is not None:
        return p
    except (ImportError, ValueError):
      continue
  return None


def cuda_plugin_installed() -> bool:
  return installed_cuda_plugin() is not None


def default_to_cpu_without_gpu() -> bool:
  """Sets JAX_PLATFORMS=cpu when it is safe and useful; returns whether it did."""
  if "jax" in sys.modules or "JAX_PLATFORMS" in os.environ or gpu_present():
    return False
  if not cuda_plugin_installed():
    return False
  os.environ["JAX_PLATFORMS"] = "cpu"
  return True
