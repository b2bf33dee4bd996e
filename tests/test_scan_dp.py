"""mode="data_parallel" on scanned layers: each layer's dW is all-reduced inside the loop."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ooojax as ooo
from ooojax.passes.hlo import schedule as hlo_schedule
from tests import models

N = 8
AX = "batch"


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:N]), (AX,))


def _run(grad_of, loss, args, in_specs, wrap, reduce="mean"):
  """`grad_of(loss)` per device, under shard_map (check_vma True/False) or pmap."""
  f = lambda *a: grad_of(loss)(*a)  # noqa: E731
  if wrap == "pmap":
    axes = tuple(0 if s == P(AX) else None for s in in_specs)
    sharded = [
      a.reshape(N, a.shape[0] // N, *a.shape[1:]) if s == P(AX) else a
      for a, s in zip(args, in_specs)
    ]
    g = jax.pmap(f, axis_name=AX, in_axes=axes)(*sharded)
    return jax.tree.map(lambda x: x[0], g)
  return jax.jit(
    jax.shard_map(f, mesh=_mesh(), in_specs=in_specs, out_specs=P(), check_vma=wrap == "vma")
  )(*args)


def _ours(reduce, **opts):
  return lambda loss: ooo.grad(loss, mode="data_parallel", axis_name=AX, reduce=reduce, **opts)


_REFS: dict = {}


def _reference(model, reduce):
  """`pmean(jax.grad)` (`psum` for "sum"), without vma types (no double reduction).

  One compile per model: the sum is the mean times N (exact for N = 8).
  """
  if model not in _REFS:
    loss, args, specs = _MODELS[model]()
    _REFS[model] = _run(
      lambda l: lambda *a: jax.lax.pmean(jax.grad(l)(*a), AX), loss, args, specs, "novma"
    )
  scale = 1.0 if reduce == "mean" else float(N)
  return jax.tree.map(lambda g: g * scale, _REFS[model])


# --- models ----------------------------------------------------------------------
def _lax_mlp(L=4, D=16):
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  p = {
    "w": jax.random.normal(k[0], (L, D, D)) / np.sqrt(D),
    "b": jax.random.normal(k[1], (L, D)) * 0.1,
    "out": jax.random.normal(k[2], (D, 3)),
  }
  x = jax.random.normal(jax.random.PRNGKey(9), (2 * N, D))

  def loss(p, x):
    h, _ = jax.lax.scan(
      lambda h, l: (jnp.tanh(h @ l["w"] + l["b"]), None), x, {"w": p["w"], "b": p["b"]}
    )
    return jnp.mean((h @ p["out"]) ** 2)

  return loss, (p, x), (P(), P(AX))


class _Step(nn.Module):
  """A pre-LayerNorm transformer layer (one-head self-attention, GELU MLP), kept small."""

  @nn.compact
  def __call__(self, x, _):
    d = x.shape[-1]
    q, k, v = jnp.split(nn.Dense(3 * d)(nn.LayerNorm()(x)), 3, axis=-1)
    a = jax.nn.softmax(q @ k.swapaxes(-1, -2) / np.sqrt(d), axis=-1) @ v
    x = x + nn.Dense(d)(a)
    return x + nn.Dense(d)(nn.gelu(nn.Dense(2 * d)(nn.LayerNorm()(x)))), None


class _ScanStack(nn.Module):
  """Embedding Dense, an `nn.scan` of transformer blocks, a head: a tiny scanned encoder."""

  layers: int = 3
  dim: int = 16

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.dim)(x)
    x, _ = nn.scan(
      _Step, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers
    )()(x, None)
    return nn.Dense(4)(nn.LayerNorm()(x))


def _flax_scan():
  m = _ScanStack()
  x = jax.random.normal(jax.random.PRNGKey(1), (N, 5, 6))
  params = m.init(jax.random.PRNGKey(0), x)
  loss = lambda params, x: jnp.mean(m.apply(params, x) ** 2)  # noqa: E731
  return loss, (params, x), (P(), P(AX))


def _lstm():
  loss, p, xs = models.lstm_case(batch=N, time_major=False)
  return loss, (p, xs), (P(), P(AX))


_MODELS = {"lax": _lax_mlp, "flax": _flax_scan, "lstm": _lstm}


# --- gradients -------------------------------------------------------------------
@pytest.mark.parametrize("wrap", ["vma", "novma", "pmap"])
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_lax_scan_stack_matches_pmean_of_grad(wrap, reduce, close):
  loss, args, specs = _lax_mlp()
  close(_run(_ours(reduce), loss, args, specs, wrap), _reference("lax", reduce))


@pytest.mark.parametrize("wrap,reduce", [("vma", "mean"), ("pmap", "sum")])
def test_flax_nn_scan_transformer_matches_pmean_of_grad(wrap, reduce, close):
  loss, args, specs = _flax_scan()
  close(_run(_ours(reduce), loss, args, specs, wrap), _reference("flax", reduce))


def test_accumulator_carries_are_reduced_once(close):
  # An LSTM's shared weights are W-scan carries (partial sums until the last
  # step): reduced after the loop by the bucket path, whose unit the fusion
  # removed (before: returned unreduced).
  loss, args, specs = _lstm()
  close(_run(_ours("mean"), loss, args, specs, "vma"), _reference("lstm", "mean"))


def test_cross_step_train_step_defers_the_scanned_leaves(close):
  # first_k=2 defers the stack (w, b: the first two layers in forward order):
  # they leave the loop unreduced and are reduced at the next step's start.
  import optax

  from ooojax import data_parallel as dp

  loss, (p, x), _ = _lax_mlp()
  step = dp.make_train_step(loss, optax.sgd(0.1), _mesh(), axis_name=AX, first_k=2, bucket_bytes=1)
  state = step.init(p, x)
  for _ in range(2):
    state, _ = step(state, x)
  q = p
  for _ in range(2):
    q = jax.tree.map(lambda a, g: a - 0.1 * g, q, jax.grad(loss)(q, x))
  close(step.flush(state).params, q)


# --- the plan --------------------------------------------------------------------
def _plan(loss, args, specs, **opts):
  box = {}

  def grad_of(l):
    def f(*a):
      g = ooo.grad(l, mode="data_parallel", axis_name=AX, **opts)
      box["plan"], _ = g._ooo.plan(a, {})
      return g(*a)

    return f

  _run(grad_of, loss, args, specs, "pmap")
  return box["plan"].collectives


def test_plan_names_the_in_loop_leaves():
  loss, args, specs = _lax_mlp()
  p = _plan(loss, args, specs, bucket_bytes=1, first_k=0)
  # leaves in key order: b, out, w; the stacked b and w reduce in the loop
  assert [(l.grads, l.trips, l.nbytes) for l in p.loops] == [((0, 2), 4, 4 * (16 + 16 * 16) * 4)]
  assert p.in_loop == {0, 2}
  assert [b.grads for b in p.buckets] == [(1,)]  # only the head is bucketed
  assert sorted(u.label for u in p.units if u.kind.value == "S") == [
    "bucket0",
    "loop0",
    "loop0.last",
  ]
  assert p.loops[0].after == "X1" and p.loops[0].w_units == ("W1", "W2")
  # reverse first-k over the stack: its leaves go back to the buckets
  p = _plan(loss, args, specs, bucket_bytes=1, first_k=2)
  assert not p.loops and sorted(i for b in p.buckets for i in b.grads) == [0, 1, 2]


# --- compiled HLO ----------------------------------------------------------------
def _all_reduced_elements(instrs) -> list[int]:
  """Elements each all-reduce in `instrs` reduces (one entry per all-reduce)."""
  out = []
  for i in instrs:
    if i.op in ("all-reduce", "all-reduce-start"):
      shapes = re.findall(r"f32\[([\d,]*)\]", i.shape)
      out.append(sum(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes))
  return out


def _loop_body(s):
  """(name, instrs) of the while bodies reachable from the entry computation."""
  names = [i.calls[-1] for i in s.entry if i.op == "while"]
  return [(n, s.computations[n]) for n in names]


def test_cpu_hlo_all_reduce_inside_the_while_body_and_not_again_outside():
  loss, args, specs = _lax_mlp(L=4, D=16)
  f = jax.jit(
    jax.shard_map(
      lambda *a: _ours("mean", bucket_bytes=1, first_k=0)(loss)(*a),
      mesh=_mesh(),
      in_specs=specs,
      out_specs=P(),
      check_vma=False,
    )
  )
  s = hlo_schedule.parse(f.lower(*args).compile().as_text())
  layer = 16 * 16 + 16  # one layer's w and b slices
  in_body = [n for _, body in _loop_body(s) for n in _all_reduced_elements(_body_instrs(s, body))]
  assert in_body == [layer], in_body  # one all-reduce per trip: this layer's dW
  outside = sorted(_all_reduced_elements(s.entry))
  # the head's bucket and the epilogue's (last) layer; never the stacked 4 * layer
  assert outside == sorted([16 * 3, layer]), outside


def _body_instrs(s, body):
  """A while body's instructions, with those of the computations it calls (fusions aside)."""
  out, seen, stack = [], set(), [body]
  while stack:
    instrs = stack.pop()
    for i in instrs:
      out.append(i)
      for c in i.calls:
        if c in s.computations and c not in seen and i.op in ("call", "conditional", "while"):
          seen.add(c)
          stack.append(s.computations[c])
  return out


def test_h100_loop_body_all_reduce_overlaps_compute():
  from ooojax import gpu_hlo

  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    pytest.skip(f"compile-only H100 unavailable: {reason}")
  from jax.sharding import NamedSharding

  mesh = gpu_hlo.mesh("H100", N, (AX,))
  L, D = 4, 512
  loss, _, specs = _lax_mlp(L, 8)
  p = {
    "w": jax.ShapeDtypeStruct((L, D, D), jnp.float32),
    "b": jax.ShapeDtypeStruct((L, D), jnp.float32),
    "out": jax.ShapeDtypeStruct((D, 3), jnp.float32),
  }
  x = jax.ShapeDtypeStruct((64 * N, D), jnp.float32, sharding=NamedSharding(mesh, P(AX)))
  f = jax.jit(
    jax.shard_map(
      lambda *a: _ours("mean", ordering="none", device="H100", bucket_bytes=1, first_k=0)(loss)(*a),
      mesh=mesh,
      in_specs=specs,
      out_specs=P(),
      check_vma=False,
    )
  )
  s = gpu_hlo.schedule(f, p, x, mesh=mesh)
  bodies = {n for n, _ in _loop_body(s)}
  pairs = [q for q in s.pairs_of("all-reduce") if q.computation in bodies]
  print(
    "in-loop all-reduce windows:",
    [
      (q.start.name, [i.op for i in q.between], [i.name for i in q.overlapped_heavy]) for q in pairs
    ],
  )
  assert len(pairs) == 1, [q.computation for q in s.pairs_of("all-reduce")]
  # W(i-1)'s dW GEMM, its all-reduce-start, then B(i)'s dX GEMM before the done
  assert pairs[0].overlapped_heavy, "no GEMM between the in-loop all-reduce's start and done"
  layer = D * D + D
  outside = _all_reduced_elements(s.entry)
  assert layer in outside and L * layer not in outside, outside  # the stack is not reduced again


def test_scan_collectives_docstring_examples():
  import doctest

  from ooojax.passes.collectives import loops as scan_collectives

  result = doctest.testmod(scan_collectives, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0
