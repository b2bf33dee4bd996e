"""ooojax.data_parallel: cross-step overlap keeps the plain loop's trajectory and checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ooojax import data_parallel as dp
from tests.models import tanh_mlp

N = 8


def make_problem(n_devices=N):
  """Params, loss and 4 global batches (also used by the 2-process worker)."""
  return tanh_mlp(4)


def _setup():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("batch",))
  return (mesh, *make_problem())


def _plain(loss, tx, params, xs):
  step = jax.jit(
    lambda p, o, x: (lambda l, g: (l, *_upd(tx, g, o, p)))(*jax.value_and_grad(loss)(p, x))
  )
  o, losses = tx.init(params), []
  for x in xs:
    l, params, o = step(params, o, x)
    losses.append(float(l))
  return params, losses


def _upd(tx, g, o, p):
  u, o = tx.update(g, o, p)
  return optax.apply_updates(p, u), o


def test_cross_step_matches_plain_loop(close):
  mesh, params, loss, xs = _setup()
  tx = optax.adam(1e-2)
  ref, ref_losses = _plain(loss, tx, params, xs)
  step = dp.make_train_step(loss, tx, mesh, first_k=2, bucket_bytes=1)
  state = step.init(params, xs[0])
  assert len(state.pending.local) == 4  # kernel + bias of the first 2 layers are deferred
  losses = []
  for x in xs:
    state, l = step(state, x)
    losses.append(float(l))
  assert int(state.step) == len(xs) - 1 and bool(state.pending.valid)  # one update pending
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  state = step.flush(state)
  close(state.params, ref)
  assert int(state.step) == len(xs) and not bool(state.pending.valid)
  close(step.flush(state).params, ref)  # flushing twice applies nothing more
  plain = dp.make_train_step(loss, tx, mesh, cross_step=False)
  state = plain.init(params, xs[0])
  assert state.pending.local == ()
  for x in xs:
    state, _ = plain(state, x)
  close(state.params, ref)  # applied at the end of each step: nothing lags


def test_cross_step_carried_buckets_match_plain_loop(close):
  """The carried leaves reduced in one bucket next step (adamw behind a per-leaf clip, a
  chained transform): the plain loop's trajectory, after several steps and after flush."""
  mesh, params, loss, xs = _setup()
  tx = optax.chain(optax.clip(0.5), optax.adamw(1e-2, weight_decay=0.1))
  ref, ref_losses = _plain(loss, tx, params, xs)
  step = dp.make_train_step(loss, tx, mesh, first_k=3, bucket_bytes=1 << 20)
  state = step.init(params, xs[0])
  assert step._layout.carried == ((0, 1, 2, 3, 4, 5),)  # 3 layers' leaves, one all-reduce
  losses = []
  for x in xs:
    state, l = step(state, x)
    losses.append(float(l))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  close(step.flush(state).params, ref)
  # chosen by the planner on a slow link: the last layers the forward reads (here all)
  step = dp.make_train_step(loss, tx, mesh, link="10GbE", device="H100")
  state = step.init(params, xs[0])
  assert step.plan.first_k == 0 and step.plan.carried
  for x in xs:
    state, _ = step(state, x)
  close(step.flush(state).params, ref)


def test_global_transforms_carry_nothing_unless_asked(close):
  """clip_by_global_norm reads every gradient: no update could run before every carried
  reduction, so the planner carries nothing; an explicit first_k is kept (and exact)."""
  mesh, params, loss, xs = _setup()
  tx = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.1))
  assert not dp.leafwise(tx, params) and dp.leafwise(optax.adamw(1e-2), params)
  step = dp.make_train_step(loss, tx, mesh, link="10GbE")
  assert step.init(params, xs[0]).pending.local == ()
  step = dp.make_train_step(loss, tx, mesh, first_k=1, bucket_bytes=1)
  state = step.init(params, xs[0])
  assert len(state.pending.local) == 2
  for x in xs:
    state, _ = step(state, x)
  close(step.flush(state).params, _plain(loss, tx, params, xs)[0])


def test_checkpoint_between_steps_restores_training(tmp_path, close):
  import orbax.checkpoint as ocp

  mesh, params, loss, xs = _setup()
  tx = optax.sgd(0.1, momentum=0.9)
  step = dp.make_train_step(loss, tx, mesh, first_k=1)
  state = step.init(params, xs[0])
  for x in xs[:2]:
    state, _ = step(state, x)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "s", state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "s", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  assert bool(restored.pending.valid)
  a, b = state, restored
  for x in xs[2:]:
    a, _ = step(a, x)
    b, _ = step(b, x)
  close(step.flush(b).params, step.flush(a).params)
  close(step.flush(b).params, _plain(loss, tx, params, xs)[0])


def test_errors():
  mesh, params, loss, xs = _setup()
  with pytest.raises(NameError, match="unbound axis name: data"):
    dp.make_train_step(loss, optax.sgd(0.1), mesh, axis_name="data")
  with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
    dp.make_train_step(loss, optax.sgd(0.1), mesh, bucket_bytes=0)
  step = dp.make_train_step(loss, optax.sgd(0.1), mesh, first_k=9)
  with pytest.raises(ValueError, match="first_k=9 is larger than the number of layers"):
    step.init(params, xs[0])


def test_two_processes_match_single_process(tmp_path, close):
  """2 processes on localhost (jax.distributed + gloo CPU collectives), 1 device each."""
  from tests.conftest import run_workers

  run_workers("_dp_worker.py", [tmp_path / f"{i}.npz" for i in range(2)])
  params, loss, xs = make_problem()
  ref, _ = _plain(loss, optax.adam(1e-2), params, xs)
  ref = {
    jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(ref)[0]
  }
  for i in range(2):
    got = dict(np.load(tmp_path / f"{i}.npz"))
    close(got, ref)


def test_compiled_step_reduces_pending_first_k_before_the_forward():
  mesh, params, loss, xs = _setup()
  step = dp.make_train_step(loss, optax.sgd(0.1), mesh, first_k=2, bucket_bytes=1)
  state = step.init(params, xs[0])
  step(state, xs[0])
  hlo = step._step.lower(state, xs[0]).compile().as_text()
  entry = hlo[hlo.index("\nENTRY") :].splitlines()
  # 'A': an all-reduce; 'F': a forward matmul; 'B': a backward one (emit names each unit's
  # ops ooo_<unit> in their metadata)
  kinds = [
    "A" if " all-reduce(" in l else ("F" if "/ooo_F0/" in l else "B")
    for l in entry
    if " all-reduce(" in l or "dot_general" in l
  ]
  order = "".join(kinds)
  # 4 pending leaves (layers 0-1, reduced one by one at the start) + 4 buckets of this backward
  assert order.count("A") == 8, order
  assert order.index("A") < order.index("F"), order  # layer 0's reduction before any forward
  assert "A" in order[order.index("B") :], order  # this step's buckets during its backward


def test_h100_cross_step_overlaps_pending_reductions_with_the_forward():
  import re

  from ooojax import gpu_hlo

  if gpu_hlo.unavailable_reason() is not None:
    pytest.skip(f"compile-only H100 unavailable: {gpu_hlo.unavailable_reason()}")
  from jax.sharding import NamedSharding, PartitionSpec as P

  L, D = 6, 1024
  mesh = gpu_hlo.mesh("H100", N, ("batch",))
  params = {f"l{i}": {"w": jax.ShapeDtypeStruct((D, D), jnp.float32)} for i in range(L)}

  def loss(p, x):
    for i in range(L):
      x = jnp.tanh(x @ p[f"l{i}"]["w"])
    return jnp.mean(x**2)

  x = jax.ShapeDtypeStruct((256 * N, D), jnp.float32, sharding=NamedSharding(mesh, P("batch")))

  def order(k):
    step = dp.make_train_step(
      loss, optax.sgd(0.1), mesh, first_k=k, bucket_bytes=1, device="H100", ordering="none"
    )
    txt = step.lower(step.abstract_state(params, x), x).compile().as_text()
    out = []
    for l in txt[txt.index("\nENTRY") :].splitlines():
      if re.search(r"\sall-reduce-start\(", l):
        out.append("S")
      elif re.search(r"\sall-reduce-done\(", l):
        out.append("D")
      elif re.search(r"\sall-reduce\(", l):  # a pair with nothing inside becomes synchronous
        out.append("A")
      elif "__cublas" in l or '"gemm' in l:
        out.append("F" if "/ooo_F0/" in l else "B")
    return "".join(out)

  # k=0: the last bucket (layer 0) has no backward left to hide under
  assert order(0).endswith("SD")
  # k=3: layers 0-2 are reduced at the start of the next step, a later one under the
  # forward of the earlier ones; every bucket of this backward has GEMMs in its window
  o = order(3)
  # (XLA >= 0.11 makes a pair with nothing inside one synchronous all-reduce: "A")
  assert o.count("S") + o.count("A") == L and re.search(r"SF+D", o), o
  assert not re.search(r"SD", o[o.index("B") :]), o


def test_h100_carried_last_layer_plan_agrees_with_the_compiled_step():
  """On a link-bound 100GbE step the planner carries the last layer the forward reads
  (its all-reduce runs under the next forward's earlier layers); the compiled H100 x8
  program, replayed, is faster than the in-step one and within 15% of the plan."""
  from ooojax import gpu_hlo
  from ooojax.passes.hlo.replay import replay
  from tests.models import tanh_mlp_structs

  if gpu_hlo.unavailable_reason() is not None:
    pytest.skip(f"compile-only H100 unavailable: {gpu_hlo.unavailable_reason()}")
  from jax.sharding import NamedSharding, PartitionSpec as P

  params, loss = tanh_mlp_structs(8, 1024)
  mesh = gpu_hlo.mesh("H100", N, ("batch",))
  x = jax.ShapeDtypeStruct((16384 * N, 1024), jnp.float32, sharding=NamedSharding(mesh, P("batch")))
  steps = {}
  for cross in (False, True):
    step = dp.make_train_step(
      loss, optax.adamw(1e-3), mesh, cross_step=cross, device="H100", link="100GbE"
    )
    text = step.lower(step.abstract_state(params, x), x).compile().as_text()
    steps[cross] = (step, replay(text, N, step.plan.link, "H100").step)
  (step, carried), (_, in_step) = steps[True], steps[False]
  assert step.plan.first_k == 0 and step.plan.carried == {14, 15}  # l7's b and w
  assert step._layout.deferred == (15, 14)  # as the forward reads them: w, then b
  assert carried < in_step
  assert carried == pytest.approx(step.plan.cross_step, rel=0.15)
