"""flax glue: a linen TrainState step builder and nnx-style grad transforms.

Switching an existing loop is one line each way:

* linen: `make_train_step(loss_fn, mutable=("batch_stats",), rngs=("dropout",))`
  builds a jitted `step(state, batch, rng) -> (state, metrics)` for a
  `flax.training.train_state.TrainState` (or a subclass carrying the mutable
  collections as fields, like `TrainState` below); `use_ooo=False` gives the
  same step with `jax.value_and_grad`.
* nnx: `nnx_grad(f)` / `nnx_value_and_grad(f)` take a module as the first
  argument like `nnx.grad`, differentiate its `nnx.Param`s, write the other
  state it mutated (BatchNorm statistics, RNG counters) back into the module,
  and return grads as an `nnx.State` that `nnx.Optimizer.update` accepts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax.training import train_state

from ooojax._api import _make_options, value_and_grad


class TrainState(train_state.TrainState):
  """`flax.training.train_state.TrainState` with a `batch_stats` field.

  Each collection named in `make_train_step(mutable=...)` must be a field of
  the state; for others, subclass `TrainState` the same way (a field per
  collection, default None) and pass the initial values to `create`.

  >>> import flax.linen as nn, jax, jax.numpy as jnp, optax
  >>> from ooojax.flax import TrainState
  >>> model = nn.BatchNorm(use_running_average=False)
  >>> v = model.init(jax.random.PRNGKey(0), jnp.ones((2, 3)))
  >>> state = TrainState.create(apply_fn=model.apply, params=v["params"],
  ...                           batch_stats=v["batch_stats"], tx=optax.sgd(0.1))
  >>> sorted(state.batch_stats)
  ['mean', 'var']
  """

  batch_stats: Any = None


def make_train_step(
  loss_fn: Callable,
  *,
  mutable: Sequence[str] = (),
  rngs: Sequence[str] = (),
  has_aux: bool = False,
  use_ooo: bool = True,
  jit: bool = True,
  **ooo_options,
) -> Callable:
  """Builds `step(state, batch, rng=None) -> (state, metrics)` for linen models.

  Args:
    loss_fn: `loss_fn(params, batch, apply)` returning a scalar loss (or
      `(loss, aux)` with `has_aux`). `apply(*args, **kwargs)` runs
      `state.apply_fn` with the params being differentiated, the state's
      mutable collections, and per-step rngs, and records the collections'
      updates.
    mutable: collection names the model updates (e.g. `("batch_stats",)`);
      each must be a field of the state (see `TrainState`).
    rngs: rng stream names (e.g. `("dropout",)`); each step folds the step
      count into the `rng` passed to `step`.
    has_aux: `loss_fn` returns `(loss, aux)`; aux lands in `metrics["aux"]`.
    use_ooo: False gives the same step with `jax.value_and_grad` (the baseline).
    jit: wrap the step in `jax.jit`.
    **ooo_options: options of `ooo.grad` (mode, streams, device, ...).

  Example:

  >>> import flax.linen as nn, jax, jax.numpy as jnp, optax
  >>> from ooojax.flax import TrainState, make_train_step
  >>> model = nn.Dense(2)
  >>> state = TrainState.create(apply_fn=model.apply, tx=optax.sgd(0.1),
  ...     params=model.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))["params"])
  >>> loss = lambda params, batch, apply: jnp.mean(apply(params, batch) ** 2)
  >>> state, metrics = make_train_step(loss)(state, jnp.ones((4, 3)))
  >>> int(state.step)
  1
  """
  mutable, rngs = tuple(mutable), tuple(rngs)
  _make_options(ooo_options)  # reject unknown options now, not at the first step

  def differentiable(params, collections, batch, rng, apply_fn):
    updates: dict = {}

    def apply(p, *args, **kwargs):
      variables = {"params": p, **collections}
      if rngs:
        kwargs["rngs"] = {name: jax.random.fold_in(rng, i) for i, name in enumerate(rngs)}
      if not mutable:
        return apply_fn(variables, *args, **kwargs)
      out, upd = apply_fn(variables, *args, mutable=list(mutable), **kwargs)
      updates.update(upd)
      return out

    out = loss_fn(params, batch, apply)
    loss, aux = out if has_aux else (out, None)
    return loss, (aux, {k: updates.get(k, collections[k]) for k in collections})

  vg = (
    value_and_grad(differentiable, has_aux=True, **ooo_options)
    if use_ooo
    else jax.value_and_grad(differentiable, has_aux=True)
  )

  def step(state, batch, rng=None):
    missing = [c for c in mutable if not hasattr(state, c)]
    if missing:
      raise TypeError(
        f"state has no field(s) {missing} for the mutable collections; "
        "use ooojax.flax.TrainState or add the fields to your TrainState"
      )
    if rngs and rng is None:
      raise TypeError(f"this step uses rng streams {list(rngs)}: pass rng=jax.random.key(...)")
    step_rng = jax.random.fold_in(rng, state.step) if rngs else None
    collections = {c: getattr(state, c) for c in mutable}
    (loss, (aux, new)), grads = vg(state.params, collections, batch, step_rng, state.apply_fn)
    state = state.apply_gradients(grads=grads, **new)
    metrics = {"loss": loss}
    if has_aux:
      metrics["aux"] = aux
    return state, metrics

  return jax.jit(step) if jit else step


# --- nnx -----------------------------------------------------------------------
def _in_first_module(path, value) -> bool:
  # nnx filter: the Variables reached through the first argument (a shared
  # Variable is reached there first, as in nnx.grad).
  return path[0] == 0


def nnx_value_and_grad(f: Callable, *, has_aux: bool = False, **ooo_options) -> Callable:
  """Like `nnx.value_and_grad(f)`: gradients w.r.t. the first module's `nnx.Param`s.

  `f(module, *args, **kwargs)` returns a scalar (or `(loss, aux)` with
  `has_aux`). The wrapper splits `module` and every other nnx object in the
  arguments with `nnx.split`, runs `ooo.value_and_grad` on the pure function,
  writes the other Variables the call mutated (BatchNorm statistics, dropout
  RNG counters, in any argument) back into their modules, as `nnx.grad` does,
  and returns the gradients as an `nnx.State` shaped like
  `nnx.state(module, nnx.Param)`, which `nnx.Optimizer.update(module, grads)`
  takes. Works eagerly and inside `nnx.jit`.

  Args:
    f: the function to differentiate; its first argument is an `nnx.Module`.
    has_aux: `f` returns `(loss, aux)`; the result is then `((loss, aux), grads)`.
    **ooo_options: options of `ooo.grad` (mode, streams, device, ...).

  Returns:
    `g(module, *args, **kwargs) -> (value, grads)`.

  >>> from flax import nnx
  >>> import jax.numpy as jnp
  >>> from ooojax.flax import nnx_value_and_grad
  >>> m = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  >>> loss, grads = nnx_value_and_grad(lambda m, x: jnp.sum(m(x) ** 2))(m, jnp.ones((1, 3)))
  >>> grads["kernel"][...].shape
  (3, 2)
  """
  from flax import nnx

  _make_options(ooo_options)
  diff = nnx.All(nnx.Param, _in_first_module)
  written = nnx.All(nnx.Variable, nnx.Not(diff))  # state the call may mutate

  def pure(params, rest, graphdef):
    # Fresh Variables inside the trace, as nnx requires under JAX transforms.
    module, args, kwargs = nnx.merge(graphdef, params, jax.tree.map(jnp.asarray, rest))
    out = f(module, *args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    return loss, (aux, nnx.state((module, args, kwargs), written))

  vg = value_and_grad(pure, has_aux=True, **ooo_options)  # graphdef: a static, keys the trace cache

  @functools.wraps(f)
  def wrapped(module, *args, **kwargs):
    if not isinstance(module, nnx.Module):
      raise TypeError(
        "nnx_grad / nnx_value_and_grad: the first argument must be the "
        f"nnx.Module to differentiate, got {type(module).__name__}"
      )
    tree = (module, args, kwargs)
    graphdef, params, rest = nnx.split(tree, diff, ...)
    (loss, (aux, new_state)), grads = vg(params, rest, graphdef)
    nnx.update(tree, new_state)
    grads = grads[0] if 0 in grads else nnx.State({})
    return ((loss, aux) if has_aux else loss), grads

  return wrapped


def nnx_grad(f: Callable, *, has_aux: bool = False, **ooo_options) -> Callable:
  """Like `nnx.grad(f)`; see `nnx_value_and_grad` for the details.

  Args:
    f: the function to differentiate; its first argument is an `nnx.Module`.
    has_aux: `f` returns `(loss, aux)`; the result is then `(grads, aux)`.
    **ooo_options: options of `ooo.grad` (mode, streams, device, ...).

  Returns:
    `g(module, *args, **kwargs) -> grads` (an `nnx.State` of the module's params).

  >>> import optax
  >>> from flax import nnx
  >>> import jax.numpy as jnp
  >>> from ooojax.flax import nnx_grad
  >>> m = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  >>> opt = nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)
  >>> grads = nnx_grad(lambda m, x: jnp.mean(m(x) ** 2))(m, jnp.ones((4, 3)))
  >>> _ = opt.update(m, grads)
  >>> int(opt.step[...])
  1
  """
  vg = nnx_value_and_grad(f, has_aux=has_aux, **ooo_options)

  @functools.wraps(f)
  def wrapped(module, *args, **kwargs):
    out, grads = vg(module, *args, **kwargs)
    return (grads, out[1]) if has_aux else grads

  return wrapped
