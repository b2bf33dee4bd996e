"""ooojax's compiler passes, one module each: split -> cost -> schedule -> emit.

Import each pass from its module (`from passes.split import split`); this
package re-exports only the plain data types that flow between them.
"""
from passes.cost import DEVICE_SPECS, CostModel, DeviceSpec
from passes.ir import Action, Call, Cluster, Kind, Schedule, Split, Unit, UnitKind
from passes.simulate import LINKS, Link, Span, Timeline

__all__ = ["DEVICE_SPECS", "Action", "Call", "Cluster", "CostModel", "DeviceSpec", "Kind",
           "LINKS", "Link", "Schedule", "Span", "Split", "Timeline", "Unit",
           "UnitKind"]
