"""Weights stay on their device: in the compiled step of every schedule, the only
collectives are the tick loop's activation-sized transfers and, outside it, the
loss's and the tied weights' reductions (2 forced CPU devices, one per stage, as
the 2-process run places them). Interleaved and ZB-V take their stage stacks in
device order (`layout="device"`; `make_train_step` keeps its state so)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ooojax as ooo
from benchmarks.pipeline_bytes import traffic
from ooojax.passes.pipeline.plan import F
from ooojax.passes.pipeline.program import program
from tests.conftest import assert_trees_close
from tests.test_pipeline import Layer, _jit, _mesh, _mlp, _reference, _stack

SCHEDULES = ("gpipe", "1f1b", "ooo", "zb-h1", "zb-h2", "interleaved", "zb-v")
M = 4


def _tied(vstages):
  vocab, dim = 11, 8
  layer = Layer()
  params = _stack(
    [
      layer.init(k, jnp.zeros((1, dim)))["params"]
      for k in jax.random.split(jax.random.key(0), vstages)
    ]
  )
  shared = {"emb": jax.random.normal(jax.random.key(3), (vocab, dim)) * 0.3}
  input_fn = lambda tok, sh: sh["emb"][tok]  # noqa: E731

  def loss_fn(y, labels, sh):  # the output projection reuses the embedding
    return optax.softmax_cross_entropy_with_integer_labels(y @ sh["emb"].T, labels).mean()

  stage_fn = lambda p, x: layer.apply({"params": p}, x)  # noqa: E731
  tokens = jax.random.randint(jax.random.key(4), (8,), 0, vocab)
  labels = jax.random.randint(jax.random.key(5), (8,), 0, vocab)
  return stage_fn, loss_fn, input_fn, params, shared, tokens, labels


def _by_device(sched, tree):
  return jax.tree.map(lambda x: x[ooo.pipeline.device_order(sched)], tree)


def _sharded(mesh, tree, spec):
  return jax.tree.map(lambda x: jax.device_put(x, jax.NamedSharding(mesh, spec)), tree)


def _assert_only_activations(text, plan, act_shape, reduced_shapes):
  """The tick loop moves activations (the plan's transfers, nothing else); outside
  it only all-reduces of `reduced_shapes` (the loss, the tied weights' gradient)."""
  tr = traffic(text, plan)
  loop = [c for c in tr.collectives if c.in_loop]
  assert loop and all(c.op == "collective-permute" for c in loop), loop
  for c in loop:  # on CPU (gloo) each permute is one-way: no device sends and receives
    moved = [(a, b) for a, b in c.pairs if a != b]
    assert not {a for a, _ in moved} & {b for _, b in moved}, c
  assert {s for c in loop for s in c.shapes} == {act_shape}, loop
  out = [c for c in tr.collectives if not c.in_loop]
  assert all(c.op == "all-reduce" for c in out), out  # no weight moves, no gather
  got = {s for c in out for s in c.shapes}
  assert got <= set(reduced_shapes), (got, reduced_shapes)
  if plan is not None:  # each lag-0 transfer runs at its pattern's ticks only
    sends = int(
      sum(
        len(p) * k
        for ring in ("up", "dn")
        for p, k in zip(
          plan.patterns.get(ring, ()),
          np.bincount(
            plan.rows[:, 0, F[f"{ring}_pat"]], minlength=len(plan.patterns.get(ring, ()))
          ),
        )
      )
    )
    act = int(np.prod([int(d) for d in act_shape.split("[")[1][:-1].split(",")])) * 4
    assert tr.loop == sends * act, (tr.loop, sends, act)


@pytest.mark.parametrize("name", SCHEDULES)
def test_compiled_step_moves_only_activations(name):
  # tied embeddings (a shared leaf read by the first and the last stage) included
  sched = ooo.pipeline.schedule(name, stages=2, microbatches=M)
  stage_fn, loss_fn, input_fn, params, shared, tokens, labels = _tied(sched.virtual_stages)
  mesh = _mesh(2)
  stage = _sharded(mesh, _by_device(sched, params), jax.P("stage"))
  rep = _sharded(mesh, (shared, (tokens, labels)), jax.P())
  step = _jit(
    ooo.pipeline.value_and_grad(
      stage_fn,
      loss_fn,
      mesh=mesh,
      axis_name="stage",
      schedule=sched,
      input_fn=input_fn,
      layout="device",
    )
  )
  text = step.lower(stage, rep[1], rep[0]).compile().as_text()
  prog = program(stage_fn, loss_fn, sched, params, (tokens, labels), shared, input_fn)
  _assert_only_activations(text, prog.plan, "f32[2,8]", {"f32[]", "f32[11,8]"})


def test_virtual_layout_moves_weights():
  # what device order avoids: a P(stage)-sharded stack in virtual-stage order puts
  # interleaved's chunks on the wrong devices, so the step moves (and gathers) them
  sched = ooo.pipeline.schedule("interleaved", stages=2, microbatches=M)
  stage_fn, loss_fn, params, x, t = _mlp(sched.virtual_stages)
  mesh = _mesh(2)
  step = _jit(
    ooo.pipeline.value_and_grad(stage_fn, loss_fn, mesh=mesh, axis_name="stage", schedule=sched)
  )
  text = step.lower(_sharded(mesh, params, jax.P("stage")), (x, t)).compile().as_text()
  out = [c for c in traffic(text).collectives if not c.in_loop]
  assert {c.op for c in out} >= {"collective-permute", "all-gather"}


@pytest.mark.parametrize("name", ["interleaved", "zb-v"])
def test_device_layout_grads_equal_jax_grad(name):
  sched = ooo.pipeline.schedule(name, stages=2, microbatches=M)
  stage_fn, loss_fn, input_fn, params, shared, tokens, labels = _tied(sched.virtual_stages)
  mesh = _mesh(2)
  step = ooo.pipeline.value_and_grad(
    stage_fn,
    loss_fn,
    mesh=mesh,
    axis_name="stage",
    schedule=sched,
    input_fn=input_fn,
    layout="device",
  )
  loss, (gp, gsh) = _jit(step)(
    _sharded(mesh, _by_device(sched, params), jax.P("stage")), (tokens, labels), shared
  )
  ref_loss, (rp, rsh) = _reference(stage_fn, loss_fn, params, tokens, labels, input_fn, shared)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(gp, _by_device(sched, rp))  # grads in the same (device) order
  assert_trees_close(gsh, rsh)


@pytest.mark.parametrize("name,steps", [("interleaved", 1), ("zb-v", 2)])
def test_device_layout_train_follows_optax_loop(name, steps):
  opt = optax.adam(1e-2)
  sched = ooo.pipeline.schedule(name, stages=2, microbatches=M, steps=steps)
  stage_fn, loss_fn, params, _, _ = _mlp(sched.virtual_stages)
  k = jax.random.split(jax.random.key(3), 2)
  xs, ts = jax.random.normal(k[0], (steps, 8, 8)), jax.random.normal(k[1], (steps, 8, 8))
  mesh = _mesh(2)
  run = _jit(
    ooo.pipeline.train(
      stage_fn, loss_fn, opt, mesh=mesh, axis_name="stage", schedule=sched, layout="device"
    )
  )
  p0 = _sharded(mesh, _by_device(sched, params), jax.P("stage"))
  o0 = jax.vmap(opt.init)(p0)
  p, _, losses = run(p0, o0, (xs, ts))
  q, qs, ref = params, opt.init(params), []
  for s in range(steps):
    loss, g = _reference(stage_fn, loss_fn, q, xs[s], ts[s])
    u, qs = opt.update(g, qs, q)
    q = optax.apply_updates(q, u)
    ref.append(loss)
  assert_trees_close(losses, jnp.stack(ref))
  assert_trees_close(p, _by_device(sched, q))
  # and its compiled program moves no weight, optimizer state included
  text = run.lower(p0, o0, (xs, ts)).compile().as_text()
  _assert_only_activations(text, None, "f32[2,8]", {"f32[]", f"f32[{steps}]"})


def assert_train_step_moves_only_activations(step, state, *batch):
  """The automatic form's train step (`make_train_step`, device-ordered stacks): its
  compiled program moves activations in the tick loop, and reduces the leaves read
  outside the stack (the tied embedding; the prologue's and epilogue's own leaves,
  replicated in the state) and scalars (the loss, a global norm). No weight of the
  stack crosses, and nothing is gathered. Called by the train-step tests on the
  programs they compile anyway."""
  tr = traffic(step.lower(state, *batch).compile().as_text())
  acts = {s for c in tr.collectives if c.in_loop and c.op == "collective-permute" for s in c.shapes}
  assert len(acts) == 1, acts  # one activation shape, whatever the tick
  assert {c.op for c in tr.collectives} <= {"collective-permute", "all-reduce"}, tr
  assert not [c for c in tr.collectives if c.op == "collective-permute" and not c.in_loop]
  shared = {
    f"{np.dtype(x.dtype).name.replace('float', 'f')}[{','.join(map(str, x.shape))}]"
    for x in state.params.shared
  }
  steps = getattr(step, "steps", 1)  # a tiled step's losses: (steps,)
  reduced = {s for c in tr.collectives if c.op == "all-reduce" for s in c.shapes}
  assert reduced <= shared | {"f32[]", f"f32[{steps}]"}, (reduced, shared)


def test_train_step_value_and_grad_keeps_the_state_layout():
  # the automatic form's gradient without the update: in the state's layout (device
  # order, sharded by stage), equal to jax.value_and_grad of the microbatch mean
  from tests.test_pipeline_auto import _gpt

  loss, params, (tokens,) = _gpt()
  step = ooo.pipeline.make_train_step(
    loss,
    optax.sgd(0.1),
    mesh=_mesh(2),
    axis_name="stage",
    schedule="zb-v",
    microbatches=2,
    compiler_options={"xla_backend_optimization_level": 0},
  )
  state = step.init(params, tokens)
  l, g = step.value_and_grad(state, tokens)
  for a, b in zip(g.stacked, state.params.stacked):
    assert a.shape == b.shape and a.sharding.is_equivalent_to(b.sharding, a.ndim)

  def mean(p, tok):
    return sum(loss(p, t) for t in tok.reshape(2, -1, *tok.shape[1:])) / 2

  ref_l, ref_g = _jit(jax.value_and_grad(mean))(params, tokens)
  assert_trees_close(l, ref_l)
  assert_trees_close(step.params(g), ref_g)
  tr = traffic(step._grad.lower(state, tokens).compile().as_text())
  assert {c.op for c in tr.collectives} <= {"collective-permute", "all-reduce"}
  assert all(c.in_loop for c in tr.collectives if c.op == "collective-permute")
  with pytest.raises(TypeError, match="steps=1"):
    ooo.pipeline.make_train_step(
      loss,
      optax.sgd(0.1),
      mesh=_mesh(2),
      axis_name="stage",
      schedule="zb-v",
      microbatches=2,
      steps=2,
    ).value_and_grad(state, tokens)


def test_layout_errors():
  stage_fn, loss_fn, _, _, _ = _mlp(2)
  with pytest.raises(ValueError, match="layout must be 'virtual'.*or 'device'"):
    ooo.pipeline.value_and_grad(stage_fn, loss_fn, mesh=_mesh(2), axis_name="stage", layout="stage")
  with pytest.raises(TypeError, match="layout belongs to the explicit form"):
    ooo.pipeline.value_and_grad(lambda p, x: 0.0, mesh=_mesh(2), axis_name="stage", layout="device")
  with pytest.raises(ValueError, match="layout must be"):
    ooo.pipeline.train(
      stage_fn, loss_fn, optax.sgd(0.1), mesh=_mesh(2), axis_name="stage", layout="devices"
    )


def test_two_way_cpu_exchange_sends_both_directions_in_one_permute(monkeypatch):
  """`OOOJAX_CPU_EXCHANGE=two_way` (a full-duplex link, `benchmarks.pipeline_mp
  --exchange two_way`): a tick whose activation goes up while a gradient comes
  down runs one permute with both pairs, and the step is unchanged."""
  sched = ooo.pipeline.schedule("1f1b", stages=2, microbatches=M)
  stage_fn, loss_fn, input_fn, params, shared, tokens, labels = _tied(2)
  mesh = _mesh(2)
  stage = _sharded(mesh, params, jax.P("stage"))
  rep = _sharded(mesh, (shared, (tokens, labels)), jax.P())

  def run():
    step = _jit(
      ooo.pipeline.value_and_grad(
        stage_fn, loss_fn, mesh=mesh, axis_name="stage", schedule=sched, input_fn=input_fn
      )
    )
    text = step.lower(stage, rep[1], rep[0]).compile().as_text()
    pairs = [set(c.pairs) for c in traffic(text, None).collectives if c.in_loop]
    return step(stage, rep[1], rep[0]), pairs

  one, one_pairs = run()
  assert {(0, 1), (1, 0)} not in one_pairs
  monkeypatch.setenv("OOOJAX_CPU_EXCHANGE", "two_way")
  two, two_pairs = run()
  assert {(0, 1), (1, 0)} in two_pairs, two_pairs
  assert_trees_close(two, one)
  monkeypatch.setenv("OOOJAX_CPU_EXCHANGE", "both")
  with pytest.raises(ValueError, match="OOOJAX_CPU_EXCHANGE"):
    run()
