"""Where a data-parallel plan is link-bound, and what `reduce_dtype=jnp.bfloat16` predicts.

A gradient exists only once the backward runs, so a step that reduces within itself
exposes at least the reductions' link time minus the backward's compute, whatever
its buckets (the floor; `benchmarks.dp_exposed.floors` reads the same from the replay
of compiled programs). Where that floor is a share of the step, no schedule helps:
fewer bytes on the link do. `explain` then shows the same plan priced with the
gradients reduced in bfloat16 (`Options.reduce_dtype`, opt-in: it changes the numbers).
All figures are cost- and link-model estimates.
"""

from __future__ import annotations

import jax

# Link-bound: the floor is at least this share of the step.
LINK_BOUND = 0.1


def _compute(plan) -> tuple[float, float]:
  """(the compute stream's seconds, the backward's alone)."""
  spans = [s for s in plan.timeline().spans if s.stream == 0]
  return (
    sum(s.end - s.start for s in spans),
    sum(s.end - s.start for s in spans if s.unit[0] != "F"),
  )


def exposed(plan) -> float:
  """A plan's communication left after its compute (`DataParallelReport.exposed_seconds`)."""
  return max(plan.makespan - _compute(plan)[0], 0.0)


def floor(plan) -> float:
  """The link's busy time - the backward's compute (0 when the backward covers it)."""
  from ooojax.passes.collectives import plan as collectives

  link = sum(s.end - s.start for s in plan.timeline().spans if s.stream == collectives.LINK_STREAM)
  return max(link - _compute(plan)[1], 0.0)


def bound(plan) -> bool:
  return plan.n_devices > 1 and floor(plan) > LINK_BOUND * plan.makespan


def bf16_cuts_bytes(reduce_dtype, split) -> bool:
  """Whether some gradient leaf crosses the link wider than bfloat16 under `reduce_dtype`."""
  from ooojax.passes.collectives import buckets

  return buckets._grad_bytes(split, jax.numpy.bfloat16) != buckets._grad_bytes(split, reduce_dtype)


def line(report) -> str:
  """The report's link-bound line (`bound`), with the bf16 plan's prediction."""
  p, low = report.plan, report.bf16_plan
  text = (
    f"  link-bound (simulated): the reductions keep {p.link.name} busy "
    f"{report.comm_seconds * 1e3:.3f} ms, more than the backward's compute covers: any "
    f"schedule reducing within the step exposes at least {report.link_floor * 1e3:.3f} ms. "
  )
  if low is None:
    return text + "Fewer bytes on the link or a faster link are what is left."
  low_exposed = exposed(low)
  return text + (
    "The lever is fewer bytes: reduce_dtype=jnp.bfloat16 (opt-in, as DDP's "
    "bf16_compress_hook; it changes the numbers: the gradient is summed in bfloat16, "
    f"then cast back) predicts step {low.makespan * 1e3:.3f} ms, {low_exposed * 1e3:.3f} ms "
    f"exposed (against {p.makespan * 1e3:.3f} / {report.exposed_seconds * 1e3:.3f})"
  )
