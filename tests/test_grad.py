"""ooo.grad against jax.grad on real flax models, eager, jit, vmap and scan."""

import jax
import jax.numpy as jnp
import optax
import pytest

import ooojax as ooo
from tests import models

CASES = {
  "mlp": (models.mlp_case, {}),
  "cnn_batchnorm": (models.cnn_case, {"has_aux": True}),
  "transformer_block": (models.block_case, {}),
  "tied_lm": (models.tied_lm_case, {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mode", ["single_gpu", "in_order"])
def test_matches_jax_grad(name, mode, close):
  make, kw = CASES[name]
  loss, args = make()
  want = jax.grad(loss, **kw)(*args)
  got = ooo.grad(loss, mode=mode, device="H100", **kw)(*args)
  close(got, want)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_under_jit(name, close):
  make, kw = CASES[name]
  loss, args = make()
  want = jax.jit(jax.value_and_grad(loss, **kw))(*args)
  got = jax.jit(ooo.value_and_grad(loss, device="H100", mode="single_gpu", **kw))(*args)
  close(got, want)


def test_argnums_tuple(close):
  loss, (params, batch_stats, x, y) = models.cnn_case()
  want = jax.grad(loss, argnums=(0, 2), has_aux=True)(params, batch_stats, x, y)
  got = ooo.grad(loss, argnums=(0, 2), has_aux=True)(params, batch_stats, x, y)
  close(got, want)


def test_vmap_per_example_grads(close):
  loss, (params, x, y) = models.mlp_case()
  per_ex = lambda p, xi, yi: loss(p, xi[None], yi[None])
  want = jax.vmap(jax.grad(per_ex), in_axes=(None, 0, 0))(params, x, y)
  got = jax.vmap(ooo.grad(per_ex, device="H100", mode="single_gpu"), in_axes=(None, 0, 0))(
    params, x, y
  )
  got_jit = jax.jit(
    jax.vmap(ooo.grad(per_ex, device="H100", mode="single_gpu"), in_axes=(None, 0, 0))
  )(params, x, y)
  close(got, want)
  close(got_jit, want)


def test_inside_scan_and_closure(close):
  loss, (params, x, y) = models.mlp_case()

  def run(grad_fn):
    def body(p, xy):
      xi, yi = xy
      g = grad_fn(lambda p: loss(p, xi, yi))(p)  # closes over traced xi, yi
      return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), None

    xs = (jnp.stack([x, 2 * x]), jnp.stack([y, y]))
    return jax.jit(lambda p: jax.lax.scan(body, p, xs)[0])(params)

  close(run(lambda f: ooo.grad(f, device="H100", mode="single_gpu")), run(jax.grad))


def test_decorator_forms(close):
  @ooo.grad
  def g1(w):
    return jnp.sum(jnp.sin(w))

  @ooo.grad(mode="single_gpu", streams=2)
  def g2(w):
    return jnp.sum(jnp.sin(w))

  w = jnp.linspace(0, 1, 5)
  close(g1(w), jnp.cos(w))
  close(g2(w), jnp.cos(w))


def test_has_aux_value_and_grad(close):
  loss, args = models.cnn_case()
  want = jax.value_and_grad(loss, has_aux=True)(*args)
  got = ooo.value_and_grad(loss, has_aux=True)(*args)
  close(got, want)


def test_python_scalar_and_kwargs(close):
  def f(w, scale, *, offset):
    return jnp.sum((w * scale + offset) ** 2)

  w = jnp.arange(3.0)
  close(ooo.grad(f)(w, 3.0, offset=1.0), jax.grad(f)(w, 3.0, offset=1.0))
  close(ooo.grad(lambda x: x * x)(3.0), jax.grad(lambda x: x * x)(3.0))


def test_remat_and_custom_vjp(close):
  @jax.custom_vjp
  def clip_grad(x):
    return x

  clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))

  def f(p, x):
    h = jax.checkpoint(lambda h: jnp.tanh(h @ p["a"]))(x)
    h = clip_grad(h)
    return jnp.sum(jax.nn.softplus(h @ p["b"]))

  p = {"a": jnp.ones((4, 4)) * 0.3, "b": jnp.ones((4, 2))}
  x = jnp.ones((3, 4))
  close(ooo.grad(f, device="H100", mode="single_gpu")(p, x), jax.grad(f)(p, x))
  close(jax.jit(ooo.grad(f, device="H100", mode="single_gpu"))(p, x), jax.jit(jax.grad(f))(p, x))


def test_training_trajectory_matches(close):
  loss, (params, x, y) = models.mlp_case()
  opt = optax.adam(1e-2)

  def train(grad_fn):
    @jax.jit
    def step(p, s):
      g = grad_fn(loss)(p, x, y)
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s

    p, s = params, opt.init(params)
    for _ in range(10):
      p, s = step(p, s)
    return p

  close(train(lambda f: ooo.grad(f, device="H100", mode="single_gpu")), train(jax.grad), rtol=1e-4)


def test_retraced_every_call_plan_reused():
  calls = []

  def f(w):
    calls.append(1)
    return jnp.sum(w**2)

  g = ooo.grad(f)
  vg = g._ooo
  p1, _ = vg.plan((jnp.ones(3),), {})
  p2, _ = vg.plan((jnp.ones(3) * 2,), {})
  assert len(calls) == 2  # re-traced, as eager jax.grad re-runs f
  assert p2.schedule is p1.schedule  # the same program: split and schedule reused
  p3, _ = vg.plan((jnp.ones(4),), {})
  assert p3.schedule is not p1.schedule


def test_flax_nnx_model_with_batchnorm_and_dropout(close):
  from flax import nnx

  model = models.NnxNet(nnx.Rngs(0, dropout=1))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  x = jax.random.normal(jax.random.PRNGKey(2), (6, 8))

  def loss(params, rest, x):
    # fresh Variables inside the trace, as nnx requires under jax transforms
    m = nnx.merge(graphdef, params, jax.tree.map(jnp.asarray, rest))
    out = jnp.mean(m(x) ** 2)
    return out, nnx.state(m, nnx.Not(nnx.Param))  # BatchNorm stats, rng counts

  want = jax.grad(loss, has_aux=True)(params, rest, x)
  got = ooo.grad(loss, has_aux=True, mode="single_gpu", device="H100")(params, rest, x)
  close(got, want)


@pytest.mark.parametrize("mode", ["single_gpu", "in_order"])
def test_higher_order_derivatives(mode, close):
  def f(p, x):
    for w in p:
      x = jnp.tanh(x @ w)
    return jnp.sum(x**2)

  p = [jnp.eye(4) * 0.5 + 0.1 * i for i in range(3)]
  x = jnp.ones((2, 4))
  g = ooo.grad(f, mode=mode, device="H100", ordering="control_deps")
  close(jax.jacfwd(g)(p, x), jax.jacfwd(jax.grad(f))(p, x))
  gg = lambda grad: jax.grad(lambda p: jnp.sum(grad(f)(p, x)[0] ** 2))(p)
  close(gg(lambda f: ooo.grad(f, mode=mode, device="H100")), gg(jax.grad))


def test_cache_tells_equal_statics_of_other_types_apart():
  def f(w, flag):
    return jnp.sum(w * 2.5) if flag is True else jnp.sum(w)

  g = ooo.grad(f)
  w = jnp.ones(2)
  assert g(w, True).tolist() == [2.5, 2.5]
  assert g(w, 1.0).tolist() == [1.0, 1.0]  # 1.0 == True, yet a different trace


def test_no_stale_gradients_from_mutable_arguments_or_globals():
  class Holder:
    def __init__(self, a):
      self.a = a

  f = lambda w, h: jnp.sum(w * h.a)
  g = ooo.grad(f)
  h = Holder(jnp.ones(2))
  assert g(jnp.ones(2), h).tolist() == [1.0, 1.0]
  h.a = jnp.full(2, 5.0)  # same object, new array inside
  assert g(jnp.ones(2), h).tolist() == [5.0, 5.0]
  scale = {"v": jnp.ones(2)}
  g2 = ooo.grad(lambda w: jnp.sum(w * scale["v"]))  # a captured global array
  g2(jnp.ones(2))
  scale["v"] = jnp.full(2, 3.0)
  assert g2(jnp.ones(2)).tolist() == [3.0, 3.0]
