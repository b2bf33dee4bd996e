"""The image-classification loss shared by the CNN workloads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def init_params(init, *args):
  """`init(*args)` (a flax `model.init` closure) compiled once at low XLA optimisation.

  Eager flax init dispatches op by op (20 s for MobileNetV3 on 2 CPU cores);
  a default-optimised jit spends most of its time compiling code that runs once.
  """
  # not `.lower().compile(options)()`: jax 0.11.2's AOT call drops the
  # constants it hoists out of control flow ("compiled for 4 inputs but called with 2")
  try:
    return jax.jit(init, compiler_options={"xla_backend_optimization_level": 0})(*args)
  except jax.errors.JaxRuntimeError:  # a backend without the option: default compile
    return jax.jit(init)(*args)


def image_classifier(model, batch: int, image: int, classes: int, real_init: bool = True):
  """`(loss_fn, args, kw)` for a linen model with BatchNorm on synthetic images.

  `loss_fn(params, batch_stats, x, y)` returns `(loss, updated collections)`.
  `real_init=False` uses zero parameters (shapes only: enough to trace and time).
  """
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, image, image, 3))
  y = jnp.arange(batch) % classes
  init = lambda: model.init(jax.random.PRNGKey(0), x[:1])
  if real_init:
    v = init_params(init)
  else:
    v = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(init))

  def loss_fn(params, batch_stats, x, y):
    logits, upd = model.apply(
      {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd

  return loss_fn, (v["params"], v["batch_stats"], x, y), {"has_aux": True}
