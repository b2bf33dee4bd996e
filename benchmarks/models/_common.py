"""The image-classification loss shared by the CNN workloads."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def image_classifier(model, batch: int, image: int, classes: int, real_init: bool = True):
  """`(loss_fn, args, kw)` for a linen model with BatchNorm on synthetic images.

  `loss_fn(params, batch_stats, x, y)` returns `(loss, updated collections)`.
  `real_init=False` uses zero parameters (shapes only: enough to trace and time).
  """
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, image, image, 3))
  y = jnp.arange(batch) % classes
  if real_init:
    v = model.init(jax.random.PRNGKey(0), x[:1])
  else:
    v = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x[:1]))
    v = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), v)

  def loss_fn(params, batch_stats, x, y):
    logits, upd = model.apply({"params": params, "batch_stats": batch_stats}, x,
                              mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd
  return loss_fn, (v["params"], v["batch_stats"], x, y), {"has_aux": True}
