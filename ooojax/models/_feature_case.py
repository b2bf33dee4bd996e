"""The data types of the model matrix (`ooojax.models.features`) and helpers its cases share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ooojax.models._common import init_params

AXIS = "batch"  # the data axis a case's collectives (sync BatchNorm, axis_index) name


@dataclasses.dataclass(frozen=True)
class Stack:
  """The model as a pipeline: `loss_fn(stage_fn(p[L-1], ... stage_fn(p[0], input_fn(x))), t)`."""

  stage_fn: Callable
  loss_fn: Callable
  params: Any  # leaves stacked on a leading axis of blocks
  inputs: Any
  targets: Any
  input_fn: Callable | None = None
  shared: Any = None  # tied weights read by input_fn and loss_fn


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  features: str  # what real training code it stands for
  loss: Callable  # (params, *batch) -> (scalar, aux)
  params: Any
  batch: tuple
  split: tuple  # per batch argument: True if it splits over the data axis
  axis: str | None = None  # the loss names this mapped axis (needs one bound)
  rtol: float = 1e-5
  stack: Stack | None = None
  # jax.grad raises this (and ooo.grad must raise the same type): an error cell
  raises: type[Exception] | None = None

  @property
  def args(self) -> tuple:
    return (self.params, *self.batch)


def _stacked(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _ce(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _mlp_stack_case(name, features, block, dim, layers, batch, real, **kw):
  x = jax.random.normal(jax.random.key(0), (batch, dim))
  t = jax.random.normal(jax.random.key(1), (batch, dim))
  keys = jax.random.split(jax.random.key(2), layers)
  stacked = init_params(jax.vmap(block.init, in_axes=(0, None)), keys, x[:1])["params"]
  per = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(layers)]
  stage_fn = lambda p, h: block.apply({"params": p}, h)  # noqa: E731
  loss_fn = lambda h, t: jnp.mean((h - t) ** 2)  # noqa: E731

  def loss(params, x, t):
    h = x
    for p in params:
      h = stage_fn(p, h)
    mse = loss_fn(h, t)
    return mse, {"mse": mse}

  return Case(
    name,
    features,
    loss,
    per,
    (x, t),
    (True, True),
    stack=Stack(stage_fn, loss_fn, stacked, x, t),
    **kw,
  )
