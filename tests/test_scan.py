"""Control flow: loop costs, the B/W scan split, the skewed scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ooojax.passes import _compat, cost


def _scanned(w, x):
  return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]


def _unrolled(w, x):
  for i in range(w.shape[0]):
    x = jnp.tanh(x @ w[i])
  return x


def _jaxpr(f, *args):
  return jax.make_jaxpr(f)(*args).jaxpr


def test_scan_costs_body_times_length():
  w, x = jnp.ones((6, 256, 256)), jnp.ones((128, 256))
  cm = cost.CostModel("H100")
  scanned, unrolled = _jaxpr(_scanned, w, x), _jaxpr(_unrolled, w, x)
  one = _jaxpr(lambda w, x: jnp.tanh(x @ w), w[0], x)
  f_scan = sum(cost.estimate(e).flops for e in scanned.eqns)
  f_one = sum(cost.estimate(e).flops for e in one.eqns)
  assert f_scan == pytest.approx(6 * f_one, rel=1e-6)
  t_scan = cm.unit_cost(scanned.eqns).seconds
  t_unrolled = cm.unit_cost(unrolled.eqns).seconds
  assert t_scan == pytest.approx(6 * cm.unit_cost(one.eqns).seconds, rel=0.02)
  assert t_scan == pytest.approx(t_unrolled, rel=0.05)
  assert cm.unit_cost(scanned.eqns).kernels == 6


def test_nested_scan_cost_multiplies():
  w, x = jnp.ones((3, 4, 64, 64)), jnp.ones((8, 64))
  nested = _jaxpr(lambda w, x: jax.lax.scan(lambda h, w: (_scanned(w, h), None), x, w)[0], w, x)
  flat = _jaxpr(_scanned, w.reshape(12, 64, 64), x)
  f = lambda j: sum(cost.estimate(e).flops for e in j.eqns)
  assert f(nested) == pytest.approx(f(flat), rel=1e-6)


def test_while_with_trip_count_and_cond():
  x = jnp.ones((64, 64))
  one = sum(cost.estimate(e).flops for e in _jaxpr(lambda x: jnp.tanh(x @ x), x).eqns)
  loop = _jaxpr(
    lambda x: jax.lax.while_loop(
      lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.tanh(c[1] @ c[1])), (0, x)
    )[1],
    x,
  )
  eqn = [e for e in loop.eqns if e.primitive.name == "while"][0]
  assert cost.while_trips(eqn) == 5
  assert cost.estimate(eqn).flops == pytest.approx(5 * one, rel=0.01)
  # An unknown bound: one trip, never a crash.
  unknown = _jaxpr(
    lambda x, n: jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ c[1]), (0, x))[
      1
    ],
    x,
    3,
  )
  eqn = [e for e in unknown.eqns if e.primitive.name == "while"][0]
  assert cost.while_trips(eqn) is None
  branchy = _jaxpr(lambda x, p: jax.lax.cond(p > 0, lambda x: x @ x @ x, lambda x: x + 1, x), x, 1)
  eqn = [e for e in branchy.eqns if e.primitive.name == "cond"][0]
  assert cost.estimate(eqn).flops == pytest.approx(2 * 2 * 64**3)


# --- scan split ----------------------------------------------------------------
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import ooojax as ooo  # noqa: E402
from ooojax.passes.hlo import schedule as hlo_schedule  # noqa: E402
from ooojax.passes.scan import split as scan_split  # noqa: E402
from tests import models  # noqa: E402
from tests.conftest import assert_trees_close  # noqa: E402


def _scan_prims(fn, *args):
  split = fn._ooo.plan(args, {})[0].split if hasattr(fn, "_ooo") else fn
  eqns = split.jaxpr.jaxpr.eqns
  return split, [
    (split.kinds[k].name, _compat.scan_info(e).num_carry)
    for k, e in enumerate(eqns)
    if e.primitive.name == "scan"
  ]


def _check(loss, *args, n_w=1, hlo=False):
  g = ooo.grad(loss)
  split, scans = _scan_prims(g, *args)
  assert split.loops_split >= 1, scans
  assert sum(k == "DW" for k, _ in scans) >= n_w, scans
  ours = jax.jit(g).lower(*args).compile()
  ref = jax.jit(jax.grad(loss)).lower(*args).compile()
  assert_trees_close(ours(*args), ref(*args))
  if hlo:
    return split, scans, ours.as_text(), ref.as_text()
  return split, scans


def _mlp_layer(h, p):
  return jnp.tanh(h @ p["w"] + p["b"]), None


def _stack(n=4, d=8, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  p = {
    "w": jax.random.normal(k[0], (n, d, d)) / np.sqrt(d),
    "b": jax.random.normal(k[1], (n, d)) * 0.1,
    "out": jax.random.normal(k[2], (d, 3)),
  }
  return p, jax.random.normal(jax.random.PRNGKey(9), (5, d))


@pytest.mark.parametrize("reverse,unroll", [(False, 1), (True, 1), (False, 2)])
def test_lax_scan_stack_splits(reverse, unroll):
  p, x = _stack()

  def loss(p, x):
    h, _ = jax.lax.scan(_mlp_layer, x, {"w": p["w"], "b": p["b"]}, reverse=reverse, unroll=unroll)
    return jnp.sum((h @ p["out"]) ** 2)

  split, scans = _check(loss, p, x, n_w=2)
  # One forward scan, one B-scan carrying dX, one carry-free W-scan per stacked leaf.
  assert scans == [("FORWARD", 1), ("DX", 1), ("DW", 0), ("DW", 0)]


def test_split_composes_with_vmap_and_grad():
  p, x = _stack(n=3, d=4)

  def loss(p, x):
    h, _ = jax.lax.scan(_mlp_layer, x, {"w": p["w"], "b": p["b"]})
    return jnp.sum(jnp.sin(h @ p["out"]))

  xs = jnp.stack([x, 2 * x])
  per_ex = jax.jit(jax.vmap(ooo.grad(loss), in_axes=(None, 0)))(p, xs)
  assert_trees_close(per_ex, jax.vmap(jax.grad(loss), in_axes=(None, 0))(p, xs))
  # grad of a function of ooo.grad's output (second order through both scans).
  outer = lambda p: jnp.sum(ooo.grad(loss)(p, x)["w"] ** 2)
  ref = lambda p: jnp.sum(jax.grad(loss)(p, x)["w"] ** 2)
  assert_trees_close(jax.jit(jax.grad(outer))(p), jax.jit(jax.grad(ref))(p), rtol=1e-4)


def _lstm():
  return models.lstm_case()


def test_lstm_shared_weights_accumulate_in_w_scan():
  loss, p, xs = _lstm()
  _, scans = _check(loss, p, xs, n_w=3)
  # The shared weights' gradients stay accumulators, in W-scans off the chain.
  assert [c for k, c in scans if k == "DW"] == [1, 1, 1]


def test_custom_vjp_inside_scanned_body():
  @jax.custom_vjp
  def act(x):
    return jnp.tanh(x)

  act.defvjp(lambda x: (jnp.tanh(x), x), lambda x, ct: (ct * (1 - jnp.tanh(x) ** 2),))
  p, x = _stack(n=3, d=4)

  def loss(p, x):
    h, _ = jax.lax.scan(
      lambda h, p: (act(h @ p["w"] + p["b"]), None), x, {"w": p["w"], "b": p["b"]}
    )
    return jnp.sum(h @ p["out"])

  _check(loss, p, x, n_w=2)


class _FlaxLayer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(16)(nn.LayerNorm()(x))
    return x + nn.Dense(x.shape[-1])(nn.gelu(h)), None


def _flax_stack(remat):
  layer = _FlaxLayer
  if remat is not None:
    policy = None if remat == "full" else getattr(jax.checkpoint_policies, remat)
    layer = nn.remat(_FlaxLayer, policy=policy, prevent_cse=False)

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(8)(x)
      x, _ = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()(
        x, None
      )
      return nn.Dense(2)(x)

  return Stack()


@pytest.mark.parametrize("remat", [None, "full", "dots_saveable"])
def test_flax_nn_scan_with_remat_policies(remat):
  m = _flax_stack(remat)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 5))
  params = m.init(jax.random.PRNGKey(0), x)
  loss = lambda params, x: jnp.mean(m.apply(params, x) ** 2)
  _, _, ours, ref = _check(loss, params, x, n_w=6, hlo=True)
  # remat: the recomputed forward sits in the B-scan once; the compiled step
  # runs exactly as many dots as jax.grad's (nothing recomputed twice).
  assert _executed_dots(ours) == _executed_dots(ref)


def _executed_dots(txt: str) -> int:
  """Dots a compiled module runs: while bodies count x their known trip count."""
  import re

  s = hlo_schedule.parse(txt)
  trips = {
    m.group(1): int(m.group(2))
    for m in re.finditer(r"%([\w.\-]+) = .*? while\(.*?\"known_trip_count\":\{\"n\":\"(\d+)\"", txt)
  }
  memo: dict = {}

  def count(comp):
    if comp not in memo:
      memo[comp] = 0
      n = 0
      for i in s.computations.get(comp, ()):
        n += i.op in ("dot", "convolution")
        for c in i.calls:
          body = i.op == "while" and c == i.calls[-1]
          n += (trips.get(i.name, 1) if body else 1) * count(c)
      memo[comp] = n
    return memo[comp]

  return count(s.entry_name)


def test_nnx_scan_stack():
  class Layer(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(6, 6, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.lin(x))

  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(rngs):
    return Layer(rngs)

  layers = make(nnx.Rngs(0))
  graphdef, state = nnx.split(layers)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6))

  def loss(state, x):
    model = nnx.merge(graphdef, state)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, layer):
      return layer(x)

    return jnp.sum(run(x, model) ** 2)

  _check(loss, state, x, n_w=2)


def test_split_scan_is_exposed_for_other_modes():
  p, x = _stack(n=3, d=4)
  f = lambda w, x: jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0])
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(p["w"], x).jaxpr
  bwd = [e for e in jaxpr.eqns if e.primitive.name == "scan"][-1]
  s = scan_split.split_scan(bwd)
  assert _compat.scan_info(s.b_eqn).num_carry == 1 and len(s.residuals) >= 1
  assert all(_compat.scan_info(e).num_carry == 0 for e in s.w_eqns)
  # Not a scan, or a map with nothing to split: None.
  fwd = jax.make_jaxpr(lambda xs: jax.lax.map(jnp.sin, xs))(x).jaxpr.eqns[0]
  assert scan_split.split_scan(fwd) is None


def test_explain_reports_per_layer_loop_rows():
  p, x = _stack(n=6, d=16)

  def loss(p, x):
    h, _ = jax.lax.scan(_mlp_layer, x, {"w": p["w"], "b": p["b"]})
    return jnp.sum(h @ p["out"])

  r = ooo.explain(loss, p, x, device="H100")
  kinds = sorted(row.kind for row in r.loops)
  assert kinds == ["DW", "DW", "DX", "FORWARD"]
  assert all(row.trips == 6 for row in r.loops)
  w = [row for row in r.loops if row.kind == "DW" and row.param == "['w']"][0]
  assert w.flops == pytest.approx(6 * 2 * 5 * 16 * 16, rel=0.15)  # + the transpose
  assert "per trip (per layer)" in r.summary() and "split into B-scan" in r.summary()


# --- skewed scan -----------------------------------------------------------------


def _skew_loss(reverse=False):
  def loss(p, x):
    h, _ = jax.lax.scan(_mlp_layer, x, {"w": p["w"], "b": p["b"]}, reverse=reverse)
    return jnp.sum((h @ p["out"]) ** 2)

  return loss


def _single_gpu(loss, ordering="auto"):
  return ooo.grad(loss, mode="single_gpu", ordering=ordering, device="H100")


@pytest.mark.parametrize("reverse,n", [(False, 4), (True, 4), (False, 1)])
def test_skewed_scan_matches_grad(reverse, n):
  p, x = _stack(n=n)
  loss = _skew_loss(reverse)
  assert_trees_close(jax.jit(_single_gpu(loss))(p, x), jax.grad(loss)(p, x))


def test_skewed_lstm_matches_grad():
  loss, p, xs = _lstm()  # W-scans with accumulator carries
  assert_trees_close(jax.jit(_single_gpu(loss))(p, xs), jax.grad(loss)(p, xs))


def test_skewed_scan_hlo_cpu_has_stream_call_beside_dx_in_loop_body():
  p, x = _stack(n=4)
  txt = jax.jit(_single_gpu(_skew_loss())).lower(p, x).compile().as_text()
  s = hlo_schedule.parse(txt)
  bodies = [
    instrs
    for name, instrs in s.computations.items()
    if any(i.stream == "1" and i.op == "call" for i in instrs)
    and any(
      i.op in ("dot", "fusion") and "dot_general" in i.op_name and i.stream is None for i in instrs
    )
  ]
  assert bodies, "no loop body holds both a stream-1 call and dX work"
  whiles = [i for i in s.computations.values() for i in i if i.op == "while"]
  assert any(set(i.calls) & {n for n, c in s.computations.items() if c in bodies} for i in whiles)


def _loop_windows(s):
  """(W call pair, main-stream heavy kernels of its body) per stream-1 call in a while body."""
  bodies = {c for comp in s.computations.values() for i in comp if i.op == "while" for c in i.calls}
  return [
    (q, [i for i in s.computations[q.computation] if i.is_heavy and i.stream is None])
    for q in s.pairs_of("call")
    if q.computation in bodies and q.heavy_callee and q.start.stream == "1"
  ]


def test_skewed_scan_compile_only_h100():
  from ooojax import gpu_hlo

  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    pytest.skip(f"compile-only GPU unavailable: {reason}")
  n, d, rows = 4, 256, 64  # the dX GEMM: 2 * 64 * 256 * 256 = 2^23 flops
  S = jax.ShapeDtypeStruct
  p = {"w": S((n, d, d), jnp.float32), "b": S((n, d), jnp.float32), "out": S((d, 3), jnp.float32)}
  s = gpu_hlo.schedule(_single_gpu(_skew_loss()), p, S((rows, d), jnp.float32))
  # Inside the loop body, W(i-1)'s call-start .. call-done window holds B(i)'s
  # dX GEMM. (It did not while the new residual was written into its carry
  # slot before the GEMM: XLA's loop-schedule-linearizer then orders every
  # reader of the old slot value, the call's done included, before that
  # write. scan_skew writes the carry after the dX anchor instead.)
  windows = _loop_windows(s)
  assert windows, "no stream-1 call with a GEMM inside a while body"
  for q, heavy in windows:
    assert heavy, "no dX GEMM beside the W call"
    assert q.overlapped_heavy, f"W call's done is scheduled before the dX GEMM: {q.between}"
    assert not [i for i in s.computations[q.computation] if i.kind == "copy"]


def test_skewed_transformer_stack_compile_only_h100():
  from ooojax import gpu_hlo

  reason = gpu_hlo.unavailable_reason()
  if reason is not None:
    pytest.skip(f"compile-only GPU unavailable: {reason}")
  from ooojax.models import scanned

  loss, args, _ = scanned.make(layers=3, batch=2, seq=64, dim=128, heads=4, vocab=128)
  s = gpu_hlo.schedule(_single_gpu(loss), *args)
  ((q, heavy),) = _loop_windows(s)
  # Every main-stream GEMM of layer i's backward runs inside the window of
  # layer i-1's dW call (10 of 10 on jaxlib 0.10.2).
  assert len(q.overlapped_heavy) >= len(heavy) - 1 >= 4, (len(q.overlapped_heavy), len(heavy))


def test_scanned_stack_costs_like_unrolled_in_explain():
  from ooojax.models import scanned

  rep = {}
  for scan in (True, False):
    loss, args, _ = scanned.make(layers=4, batch=2, seq=16, dim=64, heads=4, vocab=64, scan=scan)
    rep[scan] = ooo.explain(loss, *args, device="H100")
  ratio = rep[True].schedule.in_order_makespan / rep[False].schedule.in_order_makespan
  assert 0.9 < ratio < 1.1, ratio
  dw = [r for r in rep[True].loops if r.kind == "DW"]
  assert len(dw) == 16 and all(r.trips == 4 for r in dw)  # per-layer dW of every stacked leaf
  assert "skewed scan" in rep[True].summary()


def test_custom_vjp_bwd_is_looked_into():
  @jax.custom_vjp
  def mul(w, x):
    return x @ w

  mul.defvjp(lambda w, x: (x @ w, (w, x)), lambda r, ct: (r[1].T @ ct, ct @ r[0].T))
  w1, w2, x = jnp.ones((4, 4)), jnp.ones((4, 2)), jnp.ones((3, 4))
  loss = lambda p, x: jnp.sum(jnp.tanh(mul(p[1], jnp.tanh(mul(p[0], x)))))
  r = ooo.explain(loss, (w1, w2), x)
  assert not r.split.opaque  # the bwd rule's equations are split like any others
  assert len(r.split.clusters) == 2
  assert_trees_close(ooo.grad(loss)((w1, w2), x), jax.grad(loss)((w1, w2), x))


def test_scan_split_docstring_examples():
  import doctest

  result = doctest.testmod(scan_split, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0
