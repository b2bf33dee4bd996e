"""ooojax.single_gpu: dW left to the next step keeps the plain loop's trajectory.

Each test trains a few steps with `single_gpu.make_train_step` and compares
losses (every step) and the flushed parameters with `jax.value_and_grad` +
optax, the synchronous loop.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ooojax import gpu_hlo, single_gpu
from ooojax.passes import defer as defer_pass
from ooojax.passes.cost import CostModel
from tests.conftest import cpu_backend_only
from tests.models import tanh_mlp


def _mlp():
  return tanh_mlp(5)


class _Flax(nn.Module):
  @nn.compact
  def __call__(self, x):
    for w in (32, 32, 32):
      x = nn.relu(nn.Dense(w)(x))
    return nn.Dense(4)(x)


def _flax():
  m = _Flax()
  xs = [
    (
      jax.random.normal(jax.random.PRNGKey(t), (16, 8)),
      jax.random.randint(jax.random.PRNGKey(100 + t), (16,), 0, 4),
    )
    for t in range(5)
  ]
  params = m.init(jax.random.PRNGKey(1), xs[0][0])["params"]

  def loss(p, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(m.apply({"params": p}, x), y).mean()

  return params, loss, xs


def _plain(loss, tx, params, xs):
  @jax.jit
  def step(p, o, x):
    l, g = jax.value_and_grad(loss)(p, x)
    u, o = tx.update(g, o, p)
    return l, optax.apply_updates(p, u), o

  o, losses = tx.init(params), []
  for x in xs:
    l, params, o = step(params, o, x)
    losses.append(float(l))
  return params, losses


def _run(step, state, xs):
  losses = []
  for x in xs:
    state, l = step(state, x)
    losses.append(float(l))
  return state, losses


OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-2),
  "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["in_order", "single_gpu"])
def test_trajectory_with_checkpoint_restore_matches_plain_loop(opt, mode, tmp_path, close):
  import orbax.checkpoint as ocp

  params, loss, xs = _mlp()
  tx = OPTIMIZERS[opt]()
  ref, ref_losses = _plain(loss, tx, params, xs)
  # the last two layers' dW run in the next step; in single_gpu mode on a stream-1 call
  step = single_gpu.make_train_step(loss, tx, defer=("l2", "l3"), mode=mode, device="H100")
  state = step.init(params, xs[0])
  assert step.plan.deferred_paths == ("['l2']['b']", "['l2']['w']", "['l3']['b']", "['l3']['w']")
  assert step.plan.anchor >= 0  # layer 1's forward matmul: the deferred dW run beside it
  state, losses = _run(step, state, xs[:2])
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "s", state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "s", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  assert bool(restored.pending.valid) and int(restored.step) == 1  # one update pending
  a, more = _run(step, state, xs[2:])
  b, more_b = _run(step, restored, xs[2:])
  np.testing.assert_allclose(losses + more, ref_losses, rtol=1e-5)
  np.testing.assert_allclose(more_b, more, rtol=1e-6)
  close(step.flush(a).params, ref)
  close(step.flush(b).params, ref)
  done = step.flush(b)
  assert int(done.step) == len(xs) and not bool(done.pending.valid)
  close(step.flush(done).params, ref)  # flushing twice applies nothing more


def test_flax_model_adam(close):
  params, loss, xs = _flax()
  tx = optax.adam(3e-3)
  ref, ref_losses = _plain(loss, tx, params, xs)
  step = single_gpu.make_train_step(loss, tx, defer=("Dense_2", "Dense_3"))
  state, losses = _run(step, step.init(params, xs[0]), xs)
  assert len(step.plan.deferred) == 4 and len(step.plan.carried) >= 2
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  close(step.flush(state).params, ref)


class _BN(nn.Module):
  @nn.compact
  def __call__(self, x):
    for w in (16, 16):
      x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(w)(x)))
    return nn.Dense(4)(x)


@pytest.mark.parametrize("mode", ["in_order", "single_gpu"])
def test_has_aux_with_batch_stats_matches_plain_loop(mode, close):
  """BatchNorm's batch_stats go in with the batch and come back in aux, as with
  `jax.value_and_grad(has_aux=True)`; 3 Adam steps, the last Dense deferred."""
  m = _BN()
  xs = [
    (
      jax.random.normal(jax.random.PRNGKey(t), (8, 6)),
      jax.random.randint(jax.random.PRNGKey(50 + t), (8,), 0, 4),
    )
    for t in range(3)
  ]
  v = m.init(jax.random.PRNGKey(1), xs[0][0])

  def loss(p, batch):
    stats, x, y = batch
    logits, upd = m.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
    l = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return l, {"batch_stats": upd["batch_stats"], "n": 3}

  tx = optax.adam(1e-2)

  @jax.jit
  def plain(p, o, stats, x, y):
    (l, aux), g = jax.value_and_grad(loss, has_aux=True)(p, (stats, x, y))
    u, o = tx.update(g, o, p)
    return (l, aux), optax.apply_updates(p, u), o

  p, o, stats, want = v["params"], tx.init(v["params"]), v["batch_stats"], []
  for x, y in xs:
    out, p, o = plain(p, o, stats, x, y)
    stats = out[1]["batch_stats"]
    want.append(out)
  step = single_gpu.make_train_step(loss, tx, defer=("Dense_2",), has_aux=True, mode=mode)
  state = step.init(v["params"], (v["batch_stats"], *xs[0]))
  assert step.plan.deferred_paths == ("['Dense_2']['bias']", "['Dense_2']['kernel']")
  stats = v["batch_stats"]
  for (x, y), (l_ref, aux_ref) in zip(xs, want):
    state, (l, aux) = step(state, (stats, x, y))
    stats = aux["batch_stats"]
    assert aux["n"] == 3  # a Python aux leaf comes back as the trace made it
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    close(aux["batch_stats"], aux_ref["batch_stats"])
  close(step.flush(state).params, p)


def test_nothing_deferred_and_a_predicate(close):
  params, loss, xs = _mlp()
  tx = optax.adam(1e-2)
  ref, _ = _plain(loss, tx, params, xs[:3])
  for d in ((), lambda path: path.startswith("['l3']")):
    step = single_gpu.make_train_step(loss, tx, defer=d)
    state, _ = _run(step, step.init(params, xs[0]), xs[:3])
    close(step.flush(state).params, ref)
  assert step.plan.deferred_paths == ("['l3']['b']", "['l3']['w']")


def test_global_norm_clipping_is_refused_or_waits(close):
  params, loss, xs = _mlp()
  tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
  with pytest.raises(
    ValueError,
    match=r"optax\.clip_by_global_norm.*the update of \['l0'\]"
    r"\['b'\] reads the gradient of \['l3'\]",
  ):
    single_gpu.make_train_step(loss, tx, defer=("l3",)).init(params, xs[0])
  # exact when every update waits for the deferred dW
  ref, ref_losses = _plain(loss, tx, params, xs[:3])
  step = single_gpu.make_train_step(loss, tx, defer=("l3",), coupled="wait")
  state, losses = _run(step, step.init(params, xs[0]), xs[:3])
  assert step.plan.coupled
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  close(step.flush(state).params, ref)
  # element-wise transforms pass the check (per-leaf clipping, weight decay, schedules)
  ok = optax.chain(optax.clip(1.0), optax.adamw(optax.cosine_decay_schedule(1e-2, 10)))
  single_gpu.make_train_step(loss, ok, defer=("l3",)).init(params, xs[0])


def test_errors():
  params, loss, xs = _mlp()
  with pytest.raises(ValueError, match="defer='l9' names no parameter"):
    single_gpu.make_train_step(loss, optax.sgd(0.1), defer="l9").init(params, xs[0])
  with pytest.raises(TypeError, match="has_aux must be a bool"):
    single_gpu.make_train_step(loss, optax.sgd(0.1), has_aux="yes")
  with pytest.raises(ValueError, match="coupled must be"):
    single_gpu.make_train_step(loss, optax.sgd(0.1), coupled="maybe")
  with pytest.raises(ValueError, match="data_parallel"):
    single_gpu.make_train_step(loss, optax.sgd(0.1), mode="data_parallel", axis_name="b")
  step = single_gpu.make_train_step(loss, optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"call step.init\(params, batch\) first"):
    step.flush(None)


def test_cost_model_defers_late_used_clusters_only():
  """`choose` keeps a cluster only if the simulated steady-state step gets faster."""
  import ooojax as ooo

  d, n = 1024, 8
  params = {f"l{i}": jnp.zeros((d, d)) for i in range(n)}

  def loss(p, x):
    for i in range(n):
      x = jnp.tanh(x @ p[f"l{i}"])
    return jnp.mean(x**2)

  vg = ooo.value_and_grad(loss, mode="single_gpu", device="H100")
  plan, _ = vg.plan((params, jnp.zeros((64, d))), {})
  cm = CostModel("H100")
  chosen = defer_pass.choose(plan.split, plan.schedule, cm)
  none = defer_pass.steady_state(plan.split, plan.schedule, cm, ())
  got = defer_pass.steady_state(plan.split, plan.schedule, cm, chosen)
  assert got.makespan <= none.makespan
  uses = defer_pass.first_uses(plan.split)
  # the first layer's dW has no forward before its parameter's use: never deferred
  assert 0 not in chosen and all(uses[i] > uses[0] for i in chosen)
  # deferring the first layer is never faster than not deferring
  assert defer_pass.steady_state(plan.split, plan.schedule, cm, (0,)).makespan >= none.makespan


_REASON = gpu_hlo.unavailable_reason()


@cpu_backend_only
@pytest.mark.skipif(_REASON is not None, reason=f"compile-only GPU: {_REASON}")
def test_h100_deferred_dw_overlaps_the_next_forward():
  """Compile-only H100: the deferred dW call's window holds the next forward's GEMMs."""
  d, n, b = 1024, 6, 256
  params = {f"l{i}": jax.ShapeDtypeStruct((d, d), jnp.float32) for i in range(n)}
  x = jax.ShapeDtypeStruct((b, d), jnp.float32)

  def loss(p, x):
    for i in range(n):
      x = jnp.tanh(x @ p[f"l{i}"])
    return jnp.mean(x**2)

  step = single_gpu.make_train_step(
    loss, optax.sgd(0.1, momentum=0.9), defer=("l5",), mode="single_gpu", device="H100"
  )
  state = step.abstract_state(params, x)
  sched = gpu_hlo.schedule(step.jitted, state, x, gpu="H100")
  deferred = [p for p in sched.stream_calls() if "ooo_deferred" in p.start.op_name]
  assert len(deferred) == 1, sched.summary()
  fwd = [i for i in deferred[0].overlapped_heavy if "/ooo_F0/" in i.op_name]
  assert len(fwd) == n - 1, sched.summary()  # layers 0-4's forward GEMMs, before l5's update
  k, total = sched.heavy_overlap()
  assert k == total, sched.summary()
