"""The XLA options tests compile under leave what they read unchanged.

tests/conftest.py turns XLA:GPU's fusion autotuner off for the compile-only
GPU compiles of the tests it lists (this one too): with no device it cannot
time a candidate, yet it compiles every fusion's candidate emitters before
keeping the default (about half of each compile). Here one gradient with stream calls compiles both
ways and its scheduled HLO is the same but for the defaults the autotuner
writes out.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import ooojax as ooo
from ooojax import demo, gpu_hlo

REASON = gpu_hlo.unavailable_reason()

# What the autotuner adds when it keeps the default: the default config spelled
# out in each fusion's backend_config, and the fingerprint of the module so annotated.
_DEFAULTS = (
  re.compile(r',"device_type":"DEVICE_TYPE_INVALID","native_emitter_backend_config":\{[^{}]*\}'),
  re.compile(
    r', backend_config=\{"operation_queue_id":"0","force_earliest_schedule":false,'
    r'"reification_cost":\[\]\}'
  ),
  re.compile(r'fingerprint_before_lhs="[0-9a-f]*"'),
)


def _without_defaults(text: str) -> str:
  for pattern in _DEFAULTS:
    text = pattern.sub("", text)
  return text


@pytest.mark.skipif(REASON is not None, reason=f"compile-only GPU: {REASON}")
def test_fusion_autotuner_off_keeps_the_compile_only_schedule():
  m = demo.SmallCNN()
  x = jax.ShapeDtypeStruct((4, 32, 32, 3), jnp.float32)
  v = jax.eval_shape(m.init, jax.random.PRNGKey(0), x)
  _, loss = demo.make_step(jax.grad, m, optax.sgd(0.1))
  shapes = (v["params"], v["batch_stats"], x, jax.ShapeDtypeStruct((4,), jnp.int32))
  g = jax.jit(ooo.grad(loss, has_aux=True, mode="single_gpu", device="H100"))
  off = gpu_hlo.compile_text(g, *shapes, gpu="H100")  # as the listed tests compile
  on = gpu_hlo.compile_text(
    g, *shapes, gpu="H100", compiler_options={"xla_gpu_experimental_enable_fusion_autotuner": True}
  )
  assert "call-start" in off  # stream calls, the schedule the tests read
  assert on != off  # the option took effect: the autotuner wrote its defaults out
  assert _without_defaults(on) == _without_defaults(off)
