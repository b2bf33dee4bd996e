"""The examples in public docstrings run."""

import doctest
import importlib

import pytest

MODULES = [
  "ooojax._api",
  "ooojax._calibrate",
  "ooojax._explain",
  "ooojax.flax",
  "ooojax.equinox",
  "ooojax.passes.split",
  "ooojax.passes.cost",
  "ooojax.passes.simulate",
  "ooojax.passes.hlo.schedule",
  "ooojax.passes.hlo.text",
  "ooojax.passes.hlo.compare",
  "ooojax.passes.hlo.windows",
  "ooojax.passes.hlo.replay",
  "ooojax.passes.hlo.pgle",
  "ooojax.passes.hlo.kernels",
  "ooojax.passes.calibration",
  "ooojax.passes.stream_cost",
  "ooojax.gpu_hlo",
  "ooojax.passes.collectives.plan",
  "ooojax.data_parallel",
  "ooojax.pipeline._explain",
  "ooojax.models.mlp_stack",
  "ooojax.passes.pipeline.steps",
  "ooojax.passes.pipeline.simulate",
  "ooojax.passes.pipeline.lowering",
  "ooojax.single_gpu",
  "ooojax.passes.fingerprint",
  "ooojax.pipeline._automatic",
  "ooojax.passes.pipeline.balance",
  "ooojax.passes.pipeline.eqns",
  "ooojax.pipeline._tiled",
  "ooojax.passes.pipeline.link",
  "ooojax.passes.pipeline.depth",
  "ooojax.pipeline._tune",
  "ooojax.pipeline._tables",
  "ooojax.pipeline._grad",
  "ooojax.pipeline._make",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  if name == "ooojax.equinox":
    pytest.importorskip("equinox")
  mod = importlib.import_module(name)
  result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0, f"{name} has no examples"
  assert result.failed == 0
