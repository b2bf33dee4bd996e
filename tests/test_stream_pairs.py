"""benchmarks/stream_pairs.py times what it means to: on a compile-only H100 its
pinned calls hold the main-stream work they are pinned around (one GEMM/conv per
call, four in the four-pair call), its serial variants have no stream call, and
its unpinned calls are left to XLA. The CPU dry run is gpu.sh's (test_gpu_sh)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import stream_pairs as sp
from ooojax import gpu_hlo

REASON = gpu_hlo.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"compile-only GPU: {REASON}")


def _calls(f, *args):
  s = gpu_hlo.schedule(f, *args)
  return [len(p.overlapped_heavy) for p in s.pairs if p.kind == "call"]


def test_the_per_call_chain():
  chain = sp.call_chain(4, 256, 32)
  h, ws = jnp.ones((32, 256)), [jnp.ones((256, 256))] * 4
  assert _calls(chain["serial"], h, ws) == []
  assert len(_calls(chain["unpinned"], h, ws)) == 4
  assert _calls(chain["pinned"], h, ws) == [1, 1, 1, 1]


@pytest.mark.parametrize("pair", ["resnet50_stage4_3x3", "dense_2048x1000"])
def test_each_pinned_pair_holds_its_dx(pair):
  kind, xs, ws, groups = sp.PAIRS[pair]
  args = sp.pair_args(kind, xs, ws, groups, 4, 4, jax.random.key(0))
  v = sp.pair_variants(kind, groups, 4)
  assert _calls(v["serial"], *args) == []
  assert _calls(v["two streams"], *args) == [1, 1, 1, 1]
  assert _calls(v["4 in one call"], *args) == [4]
