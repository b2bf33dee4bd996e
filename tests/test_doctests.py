"""The examples in public docstrings run."""
import doctest
import importlib

import pytest

MODULES = ["ooojax._api", "ooojax._calibrate", "ooojax._explain", "ooojax.flax", "passes.split", "passes.cost",
           "passes.simulate", "passes.hlo.schedule", "passes.hlo.compare", "passes.hlo.windows",
           "ooojax.gpu_hlo", "passes.collectives.plan", "ooojax.data_parallel",
           "ooojax._explain_pipeline", "ooojax.models.mlp_stack", "passes.pipeline.steps",
           "ooojax.single_gpu", "passes.fingerprint",
           "ooojax._pipeline_train", "passes.pipeline.balance", "passes.pipeline.eqns",
           "ooojax._pipeline_tiled", "passes.pipeline.link", "passes.pipeline.depth"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  mod = importlib.import_module(name)
  result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0, f"{name} has no examples"
  assert result.failed == 0
