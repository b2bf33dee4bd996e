"""Cost-model balancing of the automatic pipeline's layers over its (virtual) stages:
`passes.pipeline.balance` on synthetic costs, and uneven splits whose gradients and
training trajectory equal the plain loss's."""

import jax
import jax.numpy as jnp
import optax
import pytest

import ooojax as ooo
from ooojax.passes.pipeline.balance import Phases, StackCosts, balance, even
from ooojax.passes.pipeline.generate import generate
from tests.test_pipeline_auto import _check, _mesh
from tests.test_pipeline_train_step import O0, _follow, _reference

LAYER = Phases(1.0, 1.0, 1.0)


def _costs(pro=0.0, epi=0.0):
  return StackCosts(LAYER, Phases(pro, 0.0, pro), Phases(epi, epi, epi))


# --- the pure function ------------------------------------------------------------------
@pytest.mark.parametrize(
  "name,stages", [("1f1b", 2), ("1f1b", 4), ("zb-h1", 4), ("interleaved", 2), ("zb-v", 2)]
)
def test_even_costs_keep_the_even_split(name, stages):
  sched = generate(name, stages, 2 * stages)
  V = sched.virtual_stages
  b = balance(3 * V, _costs(), sched)
  assert b.counts == (3,) * V and b.how == "balanced"
  assert b.step_seconds == pytest.approx(b.even_step_seconds)


@pytest.mark.parametrize("name,stages", [("1f1b", 2), ("1f1b", 4), ("interleaved", 2), ("zb-v", 2)])
def test_heavy_head_and_heavy_embedding(name, stages):
  sched = generate(name, stages, 2 * stages)
  L = 3 * sched.virtual_stages
  head = balance(L, _costs(epi=3.0), sched)
  assert head.counts[-1] < head.counts[0] and sum(head.counts) == L
  assert head.step_seconds < head.even_step_seconds
  emb = balance(L, _costs(pro=4.0), sched)
  assert emb.counts[0] < emb.counts[-1] and sum(emb.counts) == L
  assert emb.step_seconds < emb.even_step_seconds


def test_balance_per_device():
  # zb-v puts the first and the last virtual stage on device 0: with a heavy head
  # and a heavy embedding both ends shrink, and the devices come out even
  b = balance(8, _costs(pro=1.5, epi=1.5), generate("zb-v", 2, 4))
  assert b.counts[0] + b.counts[-1] < b.counts[1] + b.counts[2]
  assert max(b.device_seconds) - min(b.device_seconds) <= LAYER.total
  assert "layers per virtual stage" in b.summary()


def test_even_and_given_counts():
  sched = generate("1f1b", 4, 8)
  assert even(7, 4) == (2, 2, 2, 1) and even(5, 2) == (3, 2)
  assert balance(7, _costs(epi=9.0), sched, "even").counts == (2, 2, 2, 1)
  got = balance(7, _costs(), sched, (1, 1, 2, 3))
  assert got.counts == (1, 1, 2, 3) and got.how == "given"
  for bad in [(1, 2, 4), (0, 2, 2, 3), (2, 2, 2, 2)]:
    with pytest.raises(ValueError, match="at least one layer and sum to the stack's 7"):
      balance(7, _costs(), sched, bad)
  with pytest.raises(ValueError, match="pass 'balanced', 'even' or a tuple"):
    balance(7, _costs(), sched, "fast")
  with pytest.raises(ValueError, match="fewer than the 4 virtual stages"):
    balance(3, _costs(), sched)


# --- uneven splits run and equal jax.value_and_grad -----------------------------------
def _lm(layers, vocab=512, scan=False, dim=8):
  """A tiny LM whose head (vocab x dim) outweighs a layer (dim x dim) many times."""
  ks = iter(jax.random.split(jax.random.key(0), 8))
  params = {
    "embed": jax.random.normal(next(ks), (vocab, dim)) * 0.5,
    "w": jax.random.normal(next(ks), (layers, dim, dim)) / dim**0.5,
    "head": jax.random.normal(next(ks), (dim, vocab)) * 0.3,
  }
  if not scan:
    params["w"] = list(params["w"])

  def loss(params, tokens):
    h = params["embed"][tokens[:, :-1]]
    if scan:
      h = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), h, params["w"])[0]
    else:
      for w in params["w"]:
        h = h + jnp.tanh(h @ w)
    logits = h @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  tokens = jax.random.randint(next(ks), (8, 5), 0, vocab)
  return loss, params, (tokens,)


def _split(loss, params, batch, stages, schedule, **kw):
  step = ooo.pipeline.value_and_grad(
    loss, mesh=_mesh(stages), axis_name="stage", schedule=schedule, microbatches=4, **kw
  )
  return step.balance(params, *batch)


@pytest.mark.parametrize(
  "layers,stages,schedule,scan",
  [
    (4, 2, "1f1b", True),
    (7, 2, "interleaved", False),
    (8, 4, "1f1b", False),
    (10, 4, "interleaved", True),
    (8, 2, "zb-v", True),
  ],
)
def test_heavy_head_lm(layers, stages, schedule, scan):
  loss, params, batch = _lm(layers, scan=scan)
  b = _split(loss, params, batch, stages, schedule)
  assert b.counts[-1] < max(b.counts), b  # fewer layers beside the head
  assert b.step_seconds < b.even_step_seconds, b
  _check(loss, params, batch, stages, schedule)


@pytest.mark.parametrize("layers,stages,schedule", [(5, 2, "1f1b"), (7, 4, "zb-h1")])
def test_layer_count_that_does_not_divide(layers, stages, schedule):
  loss, params, batch = _lm(layers, vocab=16)
  b = _split(loss, params, batch, stages, schedule)
  assert sum(b.counts) == layers and len(set(b.counts)) > 1
  _check(loss, params, batch, stages, schedule)


def test_given_counts_and_errors():
  loss, params, batch = _lm(5, vocab=16, scan=True)
  _check(loss, params, batch, 2, "1f1b", layers=(1, 4))
  assert _split(loss, params, batch, 2, "1f1b", layers=(1, 4)).counts == (1, 4)
  with pytest.raises(ValueError, match="sum to the stack's 5 layers"):
    _split(loss, params, batch, 2, "1f1b", layers=(2, 2))
  with pytest.raises(TypeError, match="layers belongs to the automatic form"):
    ooo.pipeline.value_and_grad(loss, loss, mesh=_mesh(2), axis_name="stage", layers=(1, 4))


def test_train_step_with_an_uneven_split():
  loss, params, batch = _lm(5, scan=True)
  opt = optax.adam(1e-2)
  batches = [(jnp.roll(batch[0], t, axis=0),) for t in range(2)]
  step = ooo.pipeline.make_train_step(
    loss,
    opt,
    mesh=_mesh(2),
    axis_name="stage",
    schedule="1f1b",
    microbatches=2,
    compiler_options=O0,
  )
  state = step.init(params, *batches[0])
  assert len(set(step.balance.counts)) > 1
  assert state.params.stacked[0].shape[:2] == (2, max(step.balance.counts))
  _follow(step, state, batches, _reference(loss, opt, params, batches, 2))
