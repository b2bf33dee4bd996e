"""ooojax: Out-Of-Order BackProp for JAX.

`ooo.grad` is a drop-in for `jax.grad` that splits the backward pass into the
critical dX chain and out-of-order dW work, schedules it with a cost model and
emits XLA that carries the schedule.
"""

from ooojax import _platform

_platform.default_to_cpu_without_gpu()  # before jax is imported: see _platform

from ooojax import pipeline  # noqa: E402
from ooojax._api import MODES, Options, grad, value_and_grad
from ooojax._calibrate import calibrate
from ooojax._explain import Report, explain
from ooojax.data_parallel._explain import DataParallelReport

__all__ = [
  "MODES",
  "DataParallelReport",
  "Options",
  "Report",
  "calibrate",
  "explain",
  "grad",
  "pipeline",
  "value_and_grad",
]
__version__ = "0.1.0"
