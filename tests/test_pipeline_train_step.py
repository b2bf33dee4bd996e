"""`ooo.pipeline.make_train_step`: a plain loss's pipelined train step follows the
synchronous `jax.value_and_grad` + optax loop, keeps the stages sharded, and
checkpoints with orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ooojax as ooo
from tests.conftest import assert_trees_close
from tests.test_pipeline_auto import _gpt

O0 = {"xla_backend_optimization_level": 0}  # correctness at O0: less compile time
STEPS = 3
# The attention's key bias has a zero gradient (softmax ignores a per-query constant):
# only float noise, which Adam's default eps=1e-8 would blow up to lr-sized steps.
ADAM = optax.adam(1e-2, eps=1e-4)


def _mesh(data=1, stages=2):
  if data == 1:
    return jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])
  return jax.make_mesh((data, stages), ("data", "stage"), devices=jax.devices()[: data * stages])


def _batches(tokens, steps=STEPS):
  # a different batch each step (rolled tokens), so a stale gradient would show
  return [(jnp.roll(tokens, t, axis=0),) for t in range(steps)]


def _reference(loss, opt, params, batches, microbatches):
  """The synchronous loop: jax.value_and_grad of the mean over microbatches, then optax."""

  def mean_over_microbatches(p, *batch):
    parts = [
      jax.tree.map(lambda a, i=i: a.reshape(microbatches, -1, *a.shape[1:])[i], batch)
      for i in range(microbatches)
    ]
    return sum(loss(p, *b) for b in parts) / microbatches

  def step(p, o, *batch):
    l, g = jax.value_and_grad(mean_over_microbatches)(p, *batch)
    u, o = opt.update(g, o, p)
    return optax.apply_updates(p, u), o, l

  step = jax.jit(step, compiler_options=O0)

  o, out = opt.init(params), []
  for b in batches:
    params, o, l = step(params, o, *b)
    out.append((l, params))
  return out


def _make(loss, opt, mesh, **kw):
  return ooo.pipeline.make_train_step(
    loss, opt, mesh=mesh, axis_name="stage", microbatches=2, compiler_options=O0, **kw
  )


def _follow(step, state, batches, ref, start=0):
  for t, b in enumerate(batches[start:], start):
    state, l = step(state, *b)
    assert_trees_close(l, ref[t][0])
    assert_trees_close(step.params(state), ref[t][1])
  return state


@pytest.mark.parametrize(
  "opt,schedule",
  [
    (optax.sgd(0.1, momentum=0.9), "zb-h1"),
    # a reduction over every leaf (the global norm sums over the stages), on
    # chunks stored device-major (interleaved: device s holds stages s and s + 2)
    (optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.3)), "interleaved"),
  ],
)
def test_trajectory_matches_synchronous_loop(opt, schedule):
  loss, params, (tokens,) = _gpt()
  batches = _batches(tokens)
  step = _make(loss, opt, _mesh(), schedule=schedule)
  state = step.init(params, *batches[0])
  _follow(step, state, batches, _reference(loss, opt, params, batches, 2))
  _assert_no_gather(step, state, batches[0])


def _assert_no_gather(step, state, batch):
  # no device ever receives another stage's weights: activations and reductions only
  from tests.test_pipeline_layout import assert_train_step_moves_only_activations

  assert_train_step_moves_only_activations(step, state, *batch)


def test_lag_one_on_four_stages_compiles_with_the_tables_options():
  # A lag-1 table on 4 stages sends on two rings: the step compiles with
  # ooo.pipeline.compiler_options(table) (both beside the action on a GPU; other
  # backends ignore it), merged with the user's options, the user's winning.
  loss, params, (tokens,) = _gpt()
  sched = ooo.pipeline.schedule("1f1b", stages=4, microbatches=2, lag=1)
  table_opts = ooo.pipeline.compiler_options(sched)
  assert table_opts
  with pytest.raises(TypeError, match="takes a PipelineSchedule"):
    ooo.pipeline.compiler_options("ooo")
  step = _make(loss, optax.sgd(0.1), _mesh(stages=4), schedule=sched)
  assert step._jit_options() == {"compiler_options": {**table_opts, **O0}}
  mine = {k: 1 for k in table_opts}
  overridden = ooo.pipeline.make_train_step(
    loss,
    optax.sgd(0.1),
    mesh=_mesh(stages=4),
    axis_name="stage",
    schedule=sched,
    compiler_options=mine,
  )
  assert overridden._jit_options() == {"compiler_options": mine}
  lag0 = ooo.pipeline.schedule("1f1b", stages=4, microbatches=2)
  assert _make(loss, optax.sgd(0.1), _mesh(stages=4), schedule=lag0)._jit_options() == {
    "compiler_options": O0
  }
  batches = _batches(tokens, steps=2)
  _follow(
    step,
    step.init(params, *batches[0]),
    batches,
    _reference(loss, optax.sgd(0.1), params, batches, 2),
  )


def test_adam_sharded_by_stage_checkpoint_restores_training(tmp_path):
  import orbax.checkpoint as ocp

  loss, params, (tokens,) = _gpt()
  batches = _batches(tokens)
  ref = _reference(loss, ADAM, params, batches, 2)
  mesh = _mesh()
  step = _make(loss, ADAM, mesh, schedule="1f1b")
  state = _follow(step, step.init(params, *batches[0]), batches[:1], ref)

  stage_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("stage"))
  for x in state.params.stacked + tuple(jax.tree.leaves(state.opt_state[0].mu.stacked)):
    assert x.sharding.is_equivalent_to(stage_sh, x.ndim)
    for shard in x.addressable_shards:  # each device holds one stage's layers
      assert shard.data.shape[0] == 1 and x.shape[0] == 2
  # tied embeddings (read by the first and the last stage) and the final norm:
  # replicated, and updated identically on every device
  assert len(state.params.shared) >= 3
  for x in state.params.shared:
    assert x.sharding.is_fully_replicated
    first, *others = [np.asarray(s.data) for s in x.addressable_shards]
    for o in others:
      np.testing.assert_array_equal(first, o)
  _assert_no_gather(step, state, batches[1])

  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "s", state)
  ckpt.wait_until_finished()
  # as in a fresh process: a new step, the restore target from shapes alone
  step = _make(loss, ADAM, mesh, schedule="1f1b")
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batches[0]))
  target = step.abstract_state(shapes[0], *shapes[1])
  restored = ckpt.restore(tmp_path / "s", target)
  assert restored.params.stacked[0].sharding == state.params.stacked[0].sharding
  assert int(restored.step) == 1
  _follow(step, restored, batches, ref, start=1)


def test_a_python_loops_layers_stay_arrays_of_their_own():
  """A loop's leaf is one `(stages, ...)` array per row of the stage (each stage's
  j-th layer), not a `(stages, rows, ...)` stack a stage would slice each layer
  out of (a copy before every GEMM on XLA:CPU and before Triton's on GPU)."""
  loss, params, (tokens,) = _gpt(scan=False)
  batches = _batches(tokens, 2)
  step = _make(loss, ADAM, _mesh(), schedule="1f1b")
  state = step.init(params, *batches[0])
  block = [jnp.shape(x) for x in jax.tree.leaves(params["_GPTBlock_0"])]
  rows = max(step.balance.counts)
  assert rows == 2
  got = sorted(x.shape for x in state.params.stacked)
  assert got == sorted((2, *b) for b in block for _ in range(rows))
  _follow(step, state, batches, _reference(loss, ADAM, params, batches, 2))


def test_data_by_stage_mesh():
  mean, params, (tokens,) = _gpt()
  # an integer aux: one count per (microbatch, data replica) piece, microbatch-major
  loss = lambda p, tok: (mean(p, tok), {"n": jnp.sum(tok[:, 0] > 6)})  # noqa: E731
  batches = _batches(tokens)
  step = _make(loss, ADAM, _mesh(data=2), schedule="1f1b", data_axis="data", has_aux=True)
  state = step.init(params, *batches[0])
  ref = _reference(mean, ADAM, params, batches, 2)
  for t, (tok,) in enumerate(batches):
    state, (l, aux) = step(state, tok)
    assert_trees_close(l, ref[t][0])
    assert_trees_close(aux["n"], jnp.sum(tok[:, 0].reshape(4, -1) > 6, 1))
  assert_trees_close(step.params(state), ref[-1][1])


def test_errors():
  loss, params, (tokens,) = _gpt()
  step = _make(loss, optax.sgd(0.1), _mesh(), schedule="1f1b")
  with pytest.raises(ValueError, match="call step.init\\(params, \\*batch\\) first"):
    step(None, tokens)
  with pytest.raises(ValueError, match="must be a mesh axis other than the stage axis"):
    _make(loss, optax.sgd(0.1), _mesh(), data_axis="stage")
