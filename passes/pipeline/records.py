"""pipeline.records: a phase's residuals packed into one flat record per dtype.

Contract: `layout(var_lists) -> Records`; `Records.pack(i, values)`,
`Records.unpack(i, rows)` and `Records.read(i, stacks, slot)`, read by
`passes.pipeline.ticks`.

The executor's switch returns what an action produces instead of the buffers
it updates (a buffer updated inside a branch and read in another is copied
whole by XLA every tick). One record shape for every branch makes that cheap:
F of every stage kind returns a record of the same per-dtype widths (the max
over kinds, zero-padded), written into one slot stack per dtype outside the
switch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Records:
  widths: dict  # dtype -> elements per record (max over the lists)
  places: tuple  # per list: ((dtype, offset, shape), ...) per var

  def empty(self) -> dict:
    return {dt: jnp.zeros((w,), dt) for dt, w in self.widths.items()}

  def pack(self, i: int, values) -> dict:
    """The record of list `i` holding `values` (one per var), per dtype."""
    parts: dict = {dt: [] for dt in self.widths}
    for (dt, _, shape), x in zip(self.places[i], values):
      parts[dt].append(jnp.reshape(jnp.asarray(x, dt), (math.prod(shape),)))
    out = {}
    for dt, w in self.widths.items():
      used = sum(p.shape[0] for p in parts[dt])
      if used < w:
        parts[dt].append(jnp.zeros((w - used,), dt))
      out[dt] = jnp.concatenate(parts[dt]) if len(parts[dt]) > 1 else parts[dt][0]
    return out

  def read(self, i: int, stacks: dict, slot) -> list:
    """The values of list `i` from row `slot` of `stacks` (dtype -> (slots, width)),
    each a dynamic slice of its stack: XLA:GPU copies sibling dynamic slices of
    one operand in one kernel, where `unpack` of a dynamically indexed row gave
    each static slice a copy kernel of its own on jax 0.12 (30 a W tick)."""
    return [
      jnp.reshape(jax.lax.dynamic_slice(stacks[dt], (slot, off), (1, math.prod(shape))), shape)
      for dt, off, shape in self.places[i]
    ]

  def unpack(self, i: int, rows: dict) -> list:
    """The values of list `i` from `rows` (dtype -> one record)."""
    return [
      jnp.reshape(rows[dt][off : off + math.prod(shape)], shape)
      for dt, off, shape in self.places[i]
    ]


def _dtype(var):
  dt = var.aval.dtype
  if jax.dtypes.issubdtype(dt, jax.dtypes.extended):
    raise NotImplementedError(
      f"a pipeline stage keeps a value of dtype {dt} (e.g. a PRNG key) between its "
      "forward and backward; pass raw key data (jax.random.key_data) through the stage "
      "and wrap it (jax.random.wrap_key_data) where it is used"
    )
  return np.dtype(dt)


def layout(var_lists) -> Records:
  """Places every var of every list in a per-dtype record; widths are the max over lists."""
  widths: dict = {}
  places = []
  for vars_ in var_lists:
    used: dict = {}
    pl = []
    for v in vars_:
      dt = _dtype(v)
      shape = tuple(v.aval.shape)
      pl.append((dt, used.get(dt, 0), shape))
      used[dt] = used.get(dt, 0) + math.prod(shape)
    places.append(tuple(pl))
    for dt, n in used.items():
      widths[dt] = max(widths.get(dt, 0), n)
  return Records(widths, tuple(places))
