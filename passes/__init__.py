"""ooojax's compiler passes: split -> cost -> schedule -> emit (one module each)."""
from passes.cost import DEVICE_SPECS, CostModel, DeviceSpec, get_spec
from passes.emit import ORDERINGS, emit
from passes.ir import Action, Cluster, Kind, Schedule, Split, Unit, UnitKind
from passes.schedule import schedule
from passes.simulate import Timeline, simulate
from passes.split import split

__all__ = ["DEVICE_SPECS", "ORDERINGS", "Action", "Cluster", "CostModel",
           "DeviceSpec", "Kind", "Schedule", "Split", "Timeline", "Unit",
           "UnitKind", "emit", "get_spec", "schedule", "simulate", "split"]
