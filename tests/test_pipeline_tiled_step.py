"""`ooo.pipeline.make_train_step(..., steps=n)`: a plain loss's train step tiled over
steps (per-stage updates inside the tick loop, tied embeddings reduced and updated
once per step) follows the synchronous `jax.value_and_grad` + optax loop."""

import jax
import jax.numpy as jnp
import optax
import pytest

import ooojax as ooo
from ooojax.passes.pipeline.generate import synced
from tests.conftest import assert_trees_close
from tests.test_pipeline_auto import _gpt, _mlp
from tests.test_pipeline_train_step import ADAM, O0, _mesh, _reference


def _stacked(batches):
  return tuple(jnp.stack(xs) for xs in zip(*batches))


def _make(loss, opt, schedule, steps=2, **kw):
  return ooo.pipeline.make_train_step(
    loss,
    opt,
    mesh=_mesh(),
    axis_name="stage",
    schedule=schedule,
    microbatches=4,
    steps=steps,
    compiler_options=O0,
    **kw,
  )


@pytest.mark.parametrize("schedule", ["zb-h2", "1f1b"])
def test_gpt_four_steps_in_two_calls(tmp_path, schedule):
  # nn.scan layers, tied embeddings (shared by the first and the last stage), Adam;
  # a checkpoint restore into a fresh step between the two calls
  import orbax.checkpoint as ocp

  loss, params, (tokens,) = _gpt()
  batches = [(jnp.roll(tokens, t, axis=0),) for t in range(4)]
  ref = _reference(loss, ADAM, params, batches, 4)
  step = _make(loss, ADAM, schedule)
  first, second = _stacked(batches[:2]), _stacked(batches[2:])
  state = step.init(params, *first)
  state, l01 = step(state, *first)
  assert l01.shape == (2,) and int(state.step) == 2
  assert_trees_close(l01, jnp.stack([ref[0][0], ref[1][0]]))
  assert_trees_close(step.params(state), ref[1][1])
  # the tied embedding is read by both ends: step t + 1 waits for the last stage's update
  assert synced(step.table)

  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "s", state)
  ckpt.wait_until_finished()
  step = _make(loss, ADAM, schedule)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, first))
  state = ckpt.restore(tmp_path / "s", step.abstract_state(shapes[0], *shapes[1]))
  state, l23 = step(state, *second)
  assert_trees_close(l23, jnp.stack([ref[2][0], ref[3][0]]))
  assert_trees_close(step.params(state), ref[3][1])
  assert int(state.step) == 4


def test_unrolled_mlp_unused_leaf_and_one_step_state_compatible():
  # a Python loop of blocks, an embedding and a head read by one stage each, and a
  # leaf the loss never reads (AdamW's weight decay still moves it, once per step);
  # the tiled step's state continues with make_train_step's one-step step
  mlp, params, batch = _mlp()
  params = {**params, "unused": jnp.ones((3,))}
  loss = lambda p, x, y: mlp({k: v for k, v in p.items() if k != "unused"}, x, y)  # noqa: E731
  opt = optax.adamw(1e-2, eps=1e-4, weight_decay=0.5)
  batches = [tuple(jnp.roll(x, t, axis=0) for x in batch) for t in range(3)]
  ref = _reference(loss, opt, params, batches, 4)
  tiled = _make(loss, opt, "zb-h2")
  state = tiled.init(params, *_stacked(batches[:2]))
  state, losses = tiled(state, *_stacked(batches[:2]))
  assert_trees_close(losses, jnp.stack([ref[0][0], ref[1][0]]))
  assert_trees_close(tiled.params(state), ref[1][1])
  # untied: the embedding and the head are each updated by their one stage, no barrier
  assert tiled.table.ticks == ooo.pipeline.schedule("zb-h2", 2, 4, steps=2).ticks
  one = _make(loss, opt, "zb-h2", steps=1)
  one.init(params, *batches[0])
  state, l2 = one(state, *batches[2])
  assert_trees_close(l2, ref[2][0])
  assert_trees_close(one.params(state), ref[2][1])
  assert float(one.params(state)["unused"][0]) < 1.0


def test_global_norm_clipping_is_refused():
  loss, params, (tokens,) = _gpt()
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  step = _make(loss, opt, "zb-h2")
  with pytest.raises(ValueError, match=r"optax\.clip_by_global_norm.*Use steps=1"):
    step.init(params, *_stacked([(tokens,), (tokens,)]))
  with pytest.raises(ValueError, match="leading axis of steps=2"):
    _make(loss, ADAM, "zb-h2").init(params, tokens)


def test_gpt_zb_v_chunks_device_major():
  # two chunks per device in a V (device 0 holds the first and the last block, so
  # both halves of the tied embedding's gradient): one call of 2 steps
  loss, params, (tokens,) = _gpt()
  batches = [(jnp.roll(tokens, t, axis=0),) for t in range(2)]
  ref = _reference(loss, ADAM, params, batches, 4)
  step = _make(loss, ADAM, "zb-v")
  state = step.init(params, *_stacked(batches))
  state, losses = step(state, *_stacked(batches))
  assert_trees_close(losses, jnp.stack([ref[0][0], ref[1][0]]))
  assert_trees_close(step.params(state), ref[1][1])
