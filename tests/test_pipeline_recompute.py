"""What B and W recompute of F's values instead of reading them from the records
(`passes.pipeline.recompute`): shapes only, no compile. The gradients under
the GPU's choice are checked in `tests/test_pipeline_weight_slices.py` (GPU
ticks on CPU), its kernels on the compile-only H100 there too."""

import jax
import jax.numpy as jnp
import pytest

import ooojax as ooo
from ooojax.models import mlp_stack
from ooojax.passes.pipeline import recompute
from ooojax.passes.pipeline.program import memory_of, program
from ooojax.passes.pipeline.tick_options import RECOMPUTE, recompute_costs

ROWS = 8  # a microbatch's rows: 32 / 4 microbatches


def _prog(monkeypatch, mode):
  monkeypatch.setenv(RECOMPUTE, mode)
  stage_fn, loss_fn, params, batch = mlp_stack.make(vstages=2, layers=4, dim=64, hidden=256)
  sched = ooo.pipeline.schedule("1f1b", stages=2, microbatches=4)
  return program(stage_fn, loss_fn, sched, params, batch), sched, params


def _shapes(res):
  return sorted(tuple(v.aval.shape) for v in res)


def test_layernorm_statistics_are_recomputed_not_saved(monkeypatch):
  """`off`: F saves the LayerNorm's centred input (twice), variance, rsqrt and
  output and GELU's tanh and factors of each block. `fused` (a GPU's): only each
  block's input, its GEMMs' outputs and the GEMM operands W reads (recomputed
  there, each would be a kernel before a GEMM); `arith` (CPU's): also tanh."""
  got = {}
  for mode in ("off", "arith", "fused"):
    prog, sched, params = _prog(monkeypatch, mode)
    got[mode] = (prog.flavors, memory_of(prog, sched, params).fres)
  d, h = (ROWS, 64), (ROWS, 256)
  # the first stage's F (its 2 blocks)
  first_off, first_fused = got["off"][0][0], got["fused"][0][0]
  assert (ROWS, 1) in _shapes(first_off.fres)  # rsqrt, variance
  assert (ROWS, 1) not in _shapes(first_fused.fres)
  # fused, a stage of 2 blocks whose first input is the stage's: block 1 saves
  # its LN output and GELU output (W's GEMM operands) and hidden pre-activation,
  # block 2 also its input
  assert _shapes(first_fused.fres) == sorted([d, h, h, d, d, h, h]), _shapes(first_fused.fres)
  # the record (the widest flavor's): 80000 bytes off, 43008 arith and fused
  assert got["fused"][1] <= got["arith"][1] < 0.6 * got["off"][1], {k: v[1] for k, v in got.items()}
  # B recomputes the statistics from the block's input
  fl = first_fused
  again = {fl.jaxpr.eqns[k].primitive.name for k in set(fl.f_eqns) & set(fl.b_eqns)}
  assert {"reduce_sum", "rsqrt"} <= again, again


def test_choose_saves_one_value_and_recomputes_the_cheap_chains():
  """B reads two cheap values of one GEMM's output: F saves one value, tanh's
  (of equal costs, the cut saves nearest B; the GEMM is never recomputed) and B
  reruns the rest; where GEMMs read the two, each recomputed would be a kernel
  of its own, so F saves them."""

  def f(x, w):
    t = jnp.tanh(x @ w)
    return t * 2.0, t + 1.0

  jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((8, 8))).jaxpr
  ids, free, sinks = range(len(jaxpr.eqns)), set(jaxpr.invars), set(jaxpr.outvars)
  rc = recompute.choose(jaxpr, ids, free, sinks, set(), recompute.GPU)
  names = sorted(jaxpr.eqns[k].primitive.name for k in rc.recomputed)
  assert names == ["add", "mul"] and rc.saved == (jaxpr.eqns[1].outvars[0],), rc  # tanh's
  rc = recompute.choose(jaxpr, ids, free, sinks, sinks, recompute.GPU)
  assert not rc.recomputed and set(rc.saved) == sinks, rc
  # one value read: saving it or tanh's is one value either way
  rc = recompute.choose(jaxpr, ids, free, {jaxpr.outvars[0]}, set(), recompute.GPU)
  assert not rc.recomputed and rc.saved == (jaxpr.outvars[0],), rc


def test_recompute_default_and_bad_value(monkeypatch):
  monkeypatch.delenv(RECOMPUTE, raising=False)
  assert recompute_costs("cpu") is recompute.CPU
  assert recompute_costs("cuda") is recompute.GPU
  monkeypatch.setenv(RECOMPUTE, "off")
  assert recompute_costs("cuda") is None
  monkeypatch.setenv(RECOMPUTE, "always")
  with pytest.raises(ValueError, match="use auto"):
    recompute_costs("cpu")


def test_small_layernorm_statistics_are_saved_on_a_gpu(monkeypatch):
  """dim 16 (8 x 16 elements a statistic): under `fused` F saves the statistics,
  which XLA:GPU would not fuse into B's kernels at this size
  (`recompute.SMALL_REDUCE`); B still recomputes the rest (rsqrt and the centred
  input from them), so the record stays below `off`'s."""
  monkeypatch.setenv(RECOMPUTE, "fused")
  stage_fn, loss_fn, params, batch = mlp_stack.make(vstages=2, layers=4, dim=16, hidden=64)
  sched = ooo.pipeline.schedule("1f1b", stages=2, microbatches=4)
  prog = program(stage_fn, loss_fn, sched, params, batch)
  fl = prog.flavors[0]
  again = {fl.jaxpr.eqns[k].primitive.name for k in set(fl.f_eqns) & set(fl.b_eqns)}
  assert (ROWS, 1) in _shapes(fl.fres) and "reduce_sum" not in again, again
  fused = memory_of(prog, sched, params).fres
  monkeypatch.setenv(RECOMPUTE, "off")
  off = memory_of(program(stage_fn, loss_fn, sched, params, batch), sched, params).fres
  assert fused < off, (fused, off)
