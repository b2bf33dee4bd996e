"""Every benchmark model's ooo.grad equals jax.grad at a tiny size."""

import jax
import pytest

import ooojax as ooo
from ooojax.models import ZOO

# correctness at XLA O0, as the model matrix: less compile time on 2 cores
O0 = {"xla_backend_optimization_level": 0}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_matches_jax_grad(name, close):
  make, _, tiny = ZOO[name]
  loss_fn, args, kw = make(**tiny)
  want = jax.jit(jax.grad(loss_fn, **kw), compiler_options=O0)(*args)
  got = jax.jit(ooo.grad(loss_fn, mode="single_gpu", device="H100", **kw), compiler_options=O0)(
    *args
  )
  close(got, want, rtol=2e-5, atol_scale=2e-5)
