"""Tables tiled over steps, executed: per-stage optimizer updates inside the tick loop
give the synchronous loop's trajectory (forced CPU devices)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import ooojax as ooo
from tests.conftest import assert_trees_close
from tests.test_pipeline import _jit, _mesh, _mlp, _reference


def _batches(steps, key=3):
  k = jax.random.split(jax.random.key(key), 2)
  return jax.random.normal(k[0], (steps, 8, 8)), jax.random.normal(k[1], (steps, 8, 8))


def check_tiled_train(sched, opt, steps, stages=2):
  """`ooo.pipeline.train` over `steps` equals the synchronous loop (a whole step's
  gradient, then the update) in losses and weights; returns (run, weights, opt
  state, batches)."""
  stage_fn, loss_fn, params, _, _ = _mlp(sched.virtual_stages)
  xs, ts = _batches(steps)
  run = ooo.pipeline.train(
    stage_fn, loss_fn, opt, mesh=_mesh(stages), axis_name="stage", schedule=sched
  )
  p, state, losses = _jit(run)(params, jax.vmap(opt.init)(params), (xs, ts))
  q, qs, ref = params, opt.init(params), []
  for t in range(steps):
    loss, g = _reference(stage_fn, loss_fn, q, xs[t], ts[t])
    updates, qs = opt.update(g, qs, q)
    q = optax.apply_updates(q, updates)
    ref.append(loss)
  assert_trees_close(losses, jnp.stack(ref))
  assert_trees_close(p, q)
  return run, p, state, (xs, ts)


@pytest.mark.parametrize(
  "stages,name,lag,opt",
  [
    (2, "zb-h2", 0, "momentum"),
    (2, "1f1b", 0, "adam"),
    (2, "zb-h1", 1, "adam"),
    (4, "interleaved", 0, "adam"),
    (4, "zb-v", 1, "momentum"),
  ],
)
def test_tiled_train_matches_synchronous_loop(stages, name, lag, opt):
  steps = 3
  opt = optax.sgd(0.1, momentum=0.9) if opt == "momentum" else optax.adam(1e-2)
  sched = ooo.pipeline.schedule(name, stages=stages, microbatches=4, lag=lag, steps=steps)
  run, p, state, (xs, ts) = check_tiled_train(sched, opt, steps, stages)
  # A further call continues from the returned state (a checkpoint between calls).
  p2, _, l2 = _jit(run)(p, state, (xs, ts))
  assert l2.shape == (steps,) and bool(jnp.all(jnp.isfinite(l2)))


def test_one_step_train_program():
  # steps=1: the one-step table with its updates (what the tiled program is timed against)
  opt = optax.adam(1e-2)
  stage_fn, loss_fn, params, _, _ = _mlp(2)
  xs, ts = _batches(2)
  run = _jit(
    ooo.pipeline.train(
      stage_fn,
      loss_fn,
      opt,
      mesh=_mesh(2),
      axis_name="stage",
      schedule="zb-h2",
      microbatches=4,
      steps=1,
    )
  )
  p, o = params, jax.vmap(opt.init)(params)
  q, qs = params, opt.init(params)
  for t in range(2):
    p, o, losses = run(p, o, (xs[t : t + 1], ts[t : t + 1]))
    loss, g = _reference(stage_fn, loss_fn, q, xs[t], ts[t])
    updates, qs = opt.update(g, qs, q)
    q = optax.apply_updates(q, updates)
    assert_trees_close(losses, loss[None])
  assert_trees_close(p, q)


@pytest.mark.parametrize("name,opt", [("zb-h2", "adam"), ("1f1b", "momentum")])
def test_checkpoint_restore_between_tiled_calls(tmp_path, name, opt):
  # 2 calls of 2 tiled steps, an orbax save / restore into fresh arrays between them:
  # the trajectory of 4 steps of the plain optax loop.
  import orbax.checkpoint as ocp

  opt = optax.sgd(0.1, momentum=0.9) if opt == "momentum" else optax.adam(1e-2)
  mesh = _mesh(2)
  stage_fn, loss_fn, params, _, _ = _mlp(2)
  xs, ts = _batches(4)
  run = _jit(
    ooo.pipeline.train(
      stage_fn, loss_fn, opt, mesh=mesh, axis_name="stage", schedule=name, microbatches=4, steps=2
    )
  )
  stage = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("stage"))
  state = jax.device_put((params, jax.vmap(opt.init)(params)), stage)
  p, o, l01 = run(*state, (xs[:2], ts[:2]))

  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "c", (p, o))
  ckpt.wait_until_finished()
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=stage), (p, o))
  p2, o2 = ckpt.restore(tmp_path / "c", target)
  assert p2["Dense_0"]["kernel"].sharding == stage
  del p, o
  p2, o2, l23 = run(p2, o2, (xs[2:], ts[2:]))

  q, qs, ref = params, opt.init(params), []
  for t in range(4):
    loss, g = _reference(stage_fn, loss_fn, q, xs[t], ts[t])
    updates, qs = opt.update(g, qs, q)
    q = optax.apply_updates(q, updates)
    ref.append(loss)
  assert_trees_close(jnp.concatenate([l01, l23]), jnp.stack(ref))
  assert_trees_close(p2, q)
  # the optimizer state too (one per virtual stage): Adam's count and moments, the trace
  assert_trees_close(o2, jax.tree.map(lambda a, b: jnp.broadcast_to(b, a.shape), o2, qs))


def test_shared_weights_need_a_synced_table():
  # zb-h2 (2 stages, 4 microbatches) starts stage 0's next step before the last
  # stage's update: weights both read would be stale, unless tiled with shared=True
  from ooojax.passes.pipeline.generate import synced
  from ooojax.passes.pipeline.train import Updater, lower_updates

  one = ooo.pipeline.schedule("zb-h2", stages=2, microbatches=4)
  loose, tight = ooo.pipeline.tile(one, 2), ooo.pipeline.tile(one, 2, shared=True)
  assert not synced(loose) and synced(tight) and tight.ticks > loose.ticks
  stage_fn, _, params, _, _ = _mlp(2)
  upd = Updater(lambda c, w, g, o, r: (w, o, r), lambda key, js, sh, g, r: (sh, r))
  xs, ts = _batches(2)
  for sched, ok in ((loose, False), (tight, True)):
    run = lower_updates(
      stage_fn,
      lambda y, t, s: jnp.mean((y * s - t) ** 2),
      sched,
      _mesh(2),
      "stage",
      upd,
      lambda x, s: x * s,
    )
    call = lambda: jax.eval_shape(run, params, jnp.ones(()), (), (), (xs, ts))  # noqa: E731
    if ok:
      call()
    else:
      with pytest.raises(ValueError, match=r"tile\(sched, steps, shared=True\)"):
        call()
