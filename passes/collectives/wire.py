"""collectives.wire: the dtype a gradient crosses the link in (`reduce_dtype`).

Opt-in lower-precision gradient reduction, as PyTorch DDP's `bf16_compress_hook`
and FSDP's `MixedPrecision(reduce_dtype=...)` do: a float gradient leaf wider
than `reduce_dtype` is cast to it (after the mean's 1/n prescale, so float16
does not overflow), summed over the devices in that dtype, and cast back, so
the gradient keeps its own dtype. Leaves at or below that width, and
non-float leaves, cross as they are. `reduce_dtype=None` (the default) is
exact: every leaf in its own dtype.

`wire_dtype` is the rule `emit` applies; `link_bytes` is what the planner and
its pricer count for the same leaf (one place, so both agree).
"""

from __future__ import annotations

import numpy as np

# the dtypes a reduction may run in: 16- and 32-bit floats (NCCL's float reductions;
# narrower floats have no all-reduce, wider ones would grow the bytes)
REDUCE_DTYPES = ("bfloat16", "float16", "float32")


def _dtype(x) -> np.dtype:
  import jax.numpy as jnp

  return jnp.dtype(x)


def normalize(reduce_dtype):
  """`reduce_dtype` as a numpy dtype (None stays None); raises as `validate` does."""
  if reduce_dtype is None:
    return None
  import jax.numpy as jnp

  try:
    dt = jnp.dtype(reduce_dtype)
  except TypeError as e:
    raise TypeError(
      f"reduce_dtype={reduce_dtype!r} is not a dtype: pass a float dtype such as "
      "jnp.bfloat16 or jnp.float16, or None to reduce each gradient in its own dtype"
    ) from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(
      f"reduce_dtype={dt.name} is not a float dtype: gradients are reduced in a float "
      f"dtype; use one of {REDUCE_DTYPES}, or None for each gradient's own dtype"
    )
  if dt.name not in REDUCE_DTYPES:
    raise ValueError(
      f"reduce_dtype={dt.name} is not supported: use one of {REDUCE_DTYPES} (16- and "
      "32-bit floats; a wider dtype would put more bytes on the link, and the collective "
      "libraries have no all-reduce narrower than 16 bits), or None"
    )
  return dt


def validate(mode: str, reduce_dtype) -> None:
  """TypeError for a non-float `reduce_dtype`, ValueError for an unsupported one or
  for one given outside mode="data_parallel"."""
  if reduce_dtype is None:
    return
  normalize(reduce_dtype)
  if mode != "data_parallel":
    raise ValueError(
      f"reduce_dtype={reduce_dtype!r} applies to mode='data_parallel' only (got "
      f"mode={mode!r}): it sets the dtype the gradients' all-reduces run in"
    )


def wire_dtype(dtype, reduce_dtype):
  """The dtype a leaf of `dtype` is reduced in under `reduce_dtype`."""
  dtype = _dtype(dtype)
  if reduce_dtype is None:
    return dtype
  import jax.numpy as jnp

  rd = _dtype(reduce_dtype)
  if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize <= rd.itemsize:
    return dtype
  return rd


def link_bytes(aval, reduce_dtype=None) -> int:
  """Bytes a gradient leaf of `aval` (shape, dtype) puts on the link when reduced."""
  from ooojax.passes.cost import _nbytes

  n = _nbytes(aval)
  if reduce_dtype is None:
    return n
  try:
    dtype = _dtype(aval.dtype)
  except TypeError:  # an extended dtype (float0, a key): not a float, crosses as it is
    return n
  wire = wire_dtype(dtype, reduce_dtype)
  return n if wire == dtype else n // dtype.itemsize * wire.itemsize
