"""The emitter's staging fast paths and what emission frees.

Under a staging trace, emission puts the scheduled program in one nested
`jit` equation holding the equations as they are (`_compat.CallStager`), and
copies the rest (`_compat.emit_eqns`). Inlined, that must be the program
`bind` gives: same equations, params, name stacks and user source lines, so
HLO metadata and errors are unchanged; emission may consume the split it
was handed.
"""

import gc
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ooojax as ooo
from ooojax.passes import _compat
from ooojax.passes.emit import emit
from tests.conftest import assert_trees_close


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for width in (64, 64, 8):
      x = nn.tanh(nn.Dense(width)(x))
    return x


def _setup():
  model = _MLP()
  x = jnp.ones((16, 32), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x)

  def loss(p, x):
    return jnp.mean(model.apply(p, x) ** 2)

  return loss, params, x


def _inlined(jaxpr):
  """`jaxpr` with ooojax's staged calls inlined, their name stacks under the call's."""
  m: dict = {}
  sub = lambda v: v if isinstance(v, _compat.Literal) else m.get(v, v)  # noqa: E731
  eqns = []
  for e in jaxpr.eqns:
    if _compat.call_name(e) == "ooo":
      inner = _compat.call_body(e).jaxpr.jaxpr
      m.update(zip(inner.invars, map(sub, e.invars)))
      for ie in inner.eqns:
        stack = e.source_info.name_stack + ie.source_info.name_stack
        eqns.append(
          ie.replace(
            invars=[sub(v) for v in ie.invars], source_info=ie.source_info.replace(name_stack=stack)
          )
        )
      m.update(zip(e.outvars, map(sub, inner.outvars)))
    else:
      if e.primitive.name == "shard_map":  # data_parallel: the program is its body
        e = _compat.map_subjaxprs(e, _inlined)
      eqns.append(e.replace(invars=[sub(v) for v in e.invars]))
  return jaxpr.replace(eqns=eqns, outvars=[sub(v) for v in jaxpr.outvars])


def _program(mode):
  loss, params, x = _setup()
  return jax.make_jaxpr(ooo.grad(loss, mode=mode, device="H100"))(params, x).jaxpr


def _text(jaxpr):
  # name stacks and source lines, as lowering reads them into HLO metadata;
  # equations ooojax makes (barriers, reshapes) point into ooojax: not compared
  text = jaxpr.pretty_print(source_info=True, name_stack=True)
  return re.sub(r"# [^\n]*(/passes/|unknown)[^\n]*", "#", text)


@pytest.mark.parametrize("mode", ["in_order", "single_gpu"])
def test_staged_program_equals_bind(mode, monkeypatch):
  staged = _program(mode)
  calls = [e for e in staged.eqns if _compat.call_name(e) == "ooo"]
  assert len(calls) == 1  # the scheduled program in one nested call
  fast = _text(_inlined(staged))
  monkeypatch.setattr(_compat, "_STAGE", None)  # every equation through bind
  slow = _text(_program(mode))
  assert fast == slow
  assert "ooo_" in fast  # the units' name scopes are in the name stacks
  assert "dot_general" in fast and "linear.py" in fast  # user source lines kept


def test_unknown_jit_form_falls_back_to_copying(monkeypatch):
  # a JAX whose nested-jit equation ooojax does not recognise: equations are copied
  from ooojax.passes import stage

  staged = _text(_inlined(_program("single_gpu")))
  orig = stage.CallStager.__init__

  def off(self):
    orig(self)
    self.ok = False

  monkeypatch.setattr(stage.CallStager, "__init__", off)
  copied = _program("single_gpu")
  assert not any(_compat.call_name(e) == "ooo" for e in copied.eqns)
  assert _text(copied) == staged


def test_staged_call_lowers_to_the_units_op_names():
  loss, params, x = _setup()
  hlo = (
    jax.jit(ooo.grad(loss, mode="single_gpu", device="H100"))
    .lower(params, x)
    .as_text(debug_info=True)
  )
  names = set(re.findall(r"ooo_[A-Z]\d+", hlo))
  assert "jit(ooo)" in hlo  # the one nested call
  assert {"ooo_F0", "ooo_X0", "ooo_W0"} <= names, sorted(names)  # each unit keeps its scope


def test_fast_path_is_taken_under_jit_and_not_eagerly(monkeypatch):
  calls = {"copied": 0}
  orig = _compat._staging_trace

  def spy():
    t = orig()
    calls["copied"] += t is not None
    return t

  monkeypatch.setattr(_compat, "_staging_trace", spy)
  loss, params, x = _setup()
  g = ooo.grad(loss, mode="in_order")
  want = jax.grad(loss)(params, x)
  assert_trees_close(jax.jit(g)(params, x), want)
  assert calls["copied"] > 0
  calls["copied"] = 0
  with jax.disable_jit():  # no staging trace: every equation is bound
    assert_trees_close(g(params, x), want)
  assert calls["copied"] == 0


def test_emit_consumes_the_split_it_is_handed():
  loss, params, x = _setup()
  vg = ooo.value_and_grad(loss, mode="single_gpu", device="H100")
  cell = {}

  def run(p, x):
    plan, dyn = vg.plan((p, x), {})
    sp = plan.split
    eqns = sp.jaxpr.jaxpr.eqns
    n = len(eqns)
    outs = emit(sp, plan.schedule, sp.consts, dyn, consume=True)
    cell["left"] = sum(e is not None for e in eqns)
    cell["n"] = n
    return outs[-1]  # a gradient leaf

  jax.jit(run).trace(params, x)
  assert cell["n"] > 0 and cell["left"] == 0


def test_gc_is_paused_only_inside_and_restored_on_errors():
  loss, params, x = _setup()
  g = ooo.grad(loss)
  assert gc.isenabled()
  jax.jit(g).trace(params, x)
  assert gc.isenabled()

  def bad(p, x):
    return jnp.ones(3) * loss(p, x)  # not a scalar

  with pytest.raises(TypeError):
    ooo.grad(bad)(params, x)
  assert gc.isenabled()
  gc.disable()
  try:  # a caller's disabled GC stays disabled
    jax.jit(g).trace(params, x)
    assert not gc.isenabled()
  finally:
    gc.enable()


def test_a_consumed_program_is_never_fingerprinted():
  loss, params, x = _setup()
  g = ooo.grad(loss)
  kept = []
  import ooojax._api as api

  def keep_alive(split, *a, **k):  # as a reference cycle would, until the next call
    kept.append(split.jaxpr)
    return api_emit(split, *a, **k)

  api_emit = api.emit
  api.emit = keep_alive
  try:
    for i in range(3):  # second call: the first program is alive but consumed
      fresh = jax.jit(lambda p, x: g(p, x))  # a new trace each time
      assert_trees_close(fresh(params, x * (1 + i)), jax.grad(loss)(params, x * (1 + i)))
  finally:
    api.emit = api_emit
  assert len(kept) == 3


def _scaled_stack(scales):
  # y = x @ (w * c): the multiply by the literal c is dW-only work, in the dW call
  def loss(ws, x):
    for w, c in zip(ws, scales):
      x = jnp.tanh(x @ (w * c))
    return jnp.mean(x**2)

  ws = [jax.random.normal(jax.random.PRNGKey(i), (512, 512)) / 23 for i in range(len(scales))]
  return loss, ws, jax.random.normal(jax.random.PRNGKey(9), (256, 512))


def test_equal_dw_clusters_share_one_call_body():
  # Deep models repeat one layer: its dW calls are traced and lowered once.
  scales = (2.0,) * 4 + (3.0,) * 4
  loss, ws, x = _scaled_stack(scales)
  g = ooo.grad(loss, mode="single_gpu", device="H100")
  calls = [
    e for e in _inlined(jax.make_jaxpr(g)(ws, x).jaxpr).eqns if e.primitive.name == "compute_on"
  ]
  bodies = {id(j) for e in calls for j in _compat.subjaxprs(e)}
  assert len(calls) >= 4 and 2 <= len(bodies) < len(calls)
  # a literal differs (2.0 vs 3.0): those clusters keep their own bodies
  assert_trees_close(jax.jit(g)(ws, x), jax.grad(loss)(ws, x))
  assert_trees_close(g(ws, x), jax.grad(loss)(ws, x))


def test_exact_key_tells_apart_what_computes_differently():
  from ooojax.passes.fingerprint import exact_key

  def key(f):
    j = jax.make_jaxpr(f)(jnp.ones(3)).jaxpr
    return exact_key(j.eqns, j.invars, j.outvars)

  assert key(lambda x: x * 2.0) == key(lambda x: x * 2.0)
  assert key(lambda x: x * 2.0) != key(lambda x: x * 3.0)
  assert key(lambda x: x * 0.0) != key(lambda x: x * -0.0)  # equal floats, different results
  assert key(lambda x: x * jnp.nan) == key(lambda x: x * jnp.nan)  # nan != nan, same result
  assert key(lambda x: jnp.sin(x)) != key(lambda x: jnp.cos(x))


def test_shared_calls_keep_their_own_scheduling_group():
  # a site's equations carry the context they were traced in: one group per call
  import re

  loss, ws, x = _scaled_stack((2.0,) * 8)
  g = ooo.grad(loss, mode="single_gpu", device="H100", ordering="scheduling_group")
  lines = jax.jit(g).lower(ws, x).as_text().splitlines()
  groups = [
    re.search(r'_scheduling_group_id = "(\d+)"', line + nxt).group(1)
    for line, nxt in zip(lines, lines[1:])
    if "call @compute_on" in line
  ]
  assert len(groups) >= 4 and len(set(groups)) == len(groups)


# --- mode="data_parallel" under shard_map(check_vma=True) ------------------------
def _on_two_devices(grad_fn, check_vma=True):
  from jax.sharding import PartitionSpec as P

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
  return jax.shard_map(
    grad_fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=P(), check_vma=check_vma
  )


def _dp_grad(loss):
  return _on_two_devices(lambda p, x: ooo.grad(loss, mode="data_parallel", axis_name="d")(p, x))


def test_data_parallel_copies_equations_under_check_vma(monkeypatch):
  # Traced from leaves varying over the axis, the gradient program is typed as
  # emission binds it: every equation is copied, none re-bound with casts.
  loss, params, x = _setup()
  seen = {"bind": 0, "vary": 0}
  orig_bind, orig_vary = _compat.bind_eqn, _compat.vary_inputs

  def bind(eqn, invals):
    seen["bind"] += 1
    return orig_bind(eqn, invals)

  def vary(ax):
    seen["vary"] += 1
    return orig_vary(ax)

  monkeypatch.setattr(_compat, "bind_eqn", bind)
  monkeypatch.setattr(_compat, "vary_inputs", vary)
  fast = jax.make_jaxpr(_dp_grad(loss))(params, x)
  assert seen == {"bind": 0, "vary": 0}
  monkeypatch.setattr(_compat, "_STAGE", None)  # every equation through bind
  slow = jax.make_jaxpr(_dp_grad(loss))(params, x)
  assert seen["bind"] > 0 and seen["vary"] == 0
  text = lambda c: _text(_inlined(c.jaxpr))  # noqa: E731
  assert text(fast) == text(slow)
  assert "psum" in text(fast)  # the buckets' reductions; AD adds none (see test_data_parallel)


def test_data_parallel_untyped_fallback(close):
  # A scan carry initialised invariant (jnp.zeros) whose body mixes in the
  # sharded batch cannot be traced from varying leaves (nor by jax.grad under
  # check_vma): ooo.grad traces it again untyped and re-binds with casts.
  d = 4

  def loss(w, xs):
    h, _ = jax.lax.scan(
      lambda h, x: (jnp.tanh(x @ w + h), None), jnp.zeros((xs.shape[0], d)), xs.swapaxes(0, 1)
    )
    return jnp.mean(h**2)

  w = jax.random.normal(jax.random.PRNGKey(0), (d, d))
  xs = jax.random.normal(jax.random.PRNGKey(1), (4, 3, d))
  with pytest.raises(TypeError, match="manual axis types"):
    jax.jit(_on_two_devices(lambda w, x: jax.grad(loss)(w, x))).trace(w, xs)
  got = jax.jit(_dp_grad(loss))(w, xs)
  want = jax.grad(lambda w: (loss(w, xs[:2]) + loss(w, xs[2:])) / 2)(w)
  close(got, want)


@pytest.mark.parametrize("per_device", [False, True])
def test_data_parallel_replicated_inputs(per_device, monkeypatch, close):
  # No input varies: traced with the inputs' invariant types (as jax.grad
  # traces them), unless something inside varies (axis_index): then from
  # varying leaves, else AD would reduce the gradients itself before the buckets.
  from jax.sharding import PartitionSpec as P

  loss, params, x = _setup()
  f = (lambda p, x: loss(p, x * (1.0 + jax.lax.axis_index("d")))) if per_device else loss
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
  g = jax.jit(
    jax.shard_map(
      lambda p, x: ooo.grad(f, mode="data_parallel", axis_name="d")(p, x),
      mesh=mesh,
      in_specs=(P(), P()),
      out_specs=P(),
    )
  )
  traces = []
  orig = _compat.invariant_program
  monkeypatch.setattr(_compat, "invariant_program", lambda c: traces.append(orig(c)) or traces[-1])
  binds = []
  orig_bind = _compat.bind_eqn
  monkeypatch.setattr(_compat, "bind_eqn", lambda e, v: binds.append(e) or orig_bind(e, v))
  got = g(params, x)
  assert traces == [not per_device]
  # either way the equations are copied (axis_index is bound: it names the mesh)
  assert [e.primitive.name for e in binds] == ["axis_index"] * per_device
  want = jax.tree.map(
    lambda *gs: sum(gs) / 2, *[jax.grad(loss)(params, x * (1.0 + i * per_device)) for i in range(2)]
  )
  close(got, want)


@pytest.mark.parametrize("check_vma", [True, False])
def test_shared_calls_under_shard_map_like_jax_grad(check_vma):
  # The shared calls are traced with the operands' own types (varying axes
  # kept), and a replicated parameter's gradient is summed over the axis.
  from jax.sharding import PartitionSpec as P

  loss, ws, x = _scaled_stack((2.0,) * 4 + (3.0,) * 4)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))

  def mapped(grad):
    return jax.shard_map(
      lambda w, x: grad(loss)(w, x),
      mesh=mesh,
      in_specs=(P(), P("d")),
      out_specs=P("d"),
      check_vma=check_vma,
    )

  ours = mapped(lambda f: ooo.grad(f, mode="single_gpu", device="H100"))
  (body,) = _compat.subjaxprs(jax.make_jaxpr(ours)(ws, x).eqns[0])
  body = _inlined(body)
  assert sum(e.primitive.name == "compute_on" for e in body.eqns) >= 4
  assert_trees_close(jax.jit(ours)(ws, x), jax.jit(mapped(jax.grad))(ws, x))
