"""ooojax's compiler passes: split -> cost -> schedule -> emit, one module each.

The mode-neutral core is this folder: `ir` (the plain data between passes),
`split` (trace the vjp, classify dX / dW), `cost`, `schedule`, `simulate`,
`emit` and `stage` (the schedule back into the caller's trace),
`fingerprint`, and `_compat` (every private JAX import and primitive-param
read). Each concern is a subpackage: `scan` (layers in one loop),
`collectives` (data parallel), `pipeline` (pipeline tables and their
executor), `hlo` (reading the compiled schedule).

Import each pass from its module (`from ooojax.passes.split import split`); this
package re-exports only the plain data types that flow between them.
"""

from ooojax.passes import scan as _scan  # noqa: F401 - registers the backward-scan split
from ooojax.passes.cost import DEVICE_SPECS, CostModel, DeviceSpec
from ooojax.passes.ir import Action, Call, Cluster, Kind, Schedule, Split, Unit, UnitKind
from ooojax.passes.simulate import LINKS, Link, Span, Timeline

__all__ = [
  "DEVICE_SPECS",
  "Action",
  "Call",
  "Cluster",
  "CostModel",
  "DeviceSpec",
  "Kind",
  "LINKS",
  "Link",
  "Schedule",
  "Span",
  "Split",
  "Timeline",
  "Unit",
  "UnitKind",
]
