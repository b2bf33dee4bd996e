"""Pipeline stages made of scanned layers: B runs the B-scan, W the (merged) W-scans.

Forced CPU devices, 2 stages. Gradients against jax.grad of the unpipelined
model; the structure of the F/B/W phases (which matmuls each runs, counted
over the layers) against jax.vjp of one stage; the compiled tick loop.
"""

import doctest

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ooojax as ooo
from ooojax.passes import _compat
from ooojax.passes.hlo import schedule as hlo_schedule
from ooojax.passes.pipeline.flavor import make_flavor
from ooojax.passes.scan import merge as scan_merge
from tests.conftest import assert_trees_close
from tests.test_pipeline import _jit, _mesh, _reference, _stack

LAYERS, D, H, ROWS = 3, 8, 16, 8  # ROWS per batch; 4 per microbatch with 2 microbatches


def _lax_stage(p, x):
  def layer(h, w):
    return h + jnp.tanh(h @ w["w"] + w["b"]), None

  return jax.lax.scan(layer, x, p)[0]


def _lax_params(n_stages):
  k = jax.random.split(jax.random.key(0), 2)
  return {
    "w": jax.random.normal(k[0], (n_stages, LAYERS, D, D)) / np.sqrt(D),
    "b": jax.random.normal(k[1], (n_stages, LAYERS, D)) * 0.1,
  }


class _Layer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(H)(nn.LayerNorm()(x))
    return x + nn.Dense(D)(nn.gelu(h)), None


class _Stage(nn.Module):
  """A MaxText-style stage: its layers in one `nn.scan` (optionally `nn.remat`)."""

  remat: bool = False

  @nn.compact
  def __call__(self, x):
    layer = nn.remat(_Layer, prevent_cse=False) if self.remat else _Layer
    return nn.scan(
      layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
    )()(x, None)[0]


def _flax(n_stages, remat=False):
  stage = _Stage(remat)
  params = _stack(
    [
      stage.init(k, jnp.zeros((1, D)))["params"]
      for k in jax.random.split(jax.random.key(0), n_stages)
    ]
  )
  return lambda p, x: stage.apply({"params": p}, x), params


def _model(kind, n_vstages=2):
  if kind == "lax":
    return _lax_stage, _lax_params(n_vstages)
  return _flax(n_vstages, remat=kind == "flax-remat")


_loss = lambda y, t: jnp.mean((y - t) ** 2)  # noqa: E731
_X = jax.random.normal(jax.random.key(1), (ROWS, D))
_T = jax.random.normal(jax.random.key(2), (ROWS, D))


def _step(stage_fn, name, lag=0):
  sched = ooo.pipeline.schedule(name, stages=2, microbatches=2, lag=lag)
  return ooo.pipeline.value_and_grad(
    stage_fn, _loss, mesh=_mesh(2), axis_name="stage", schedule=sched
  )


@pytest.mark.parametrize(
  "kind,name,lag",
  [
    ("lax", "1f1b", 0),
    ("lax", "ooo", 0),
    ("lax", "zb-h1", 1),
    ("lax", "interleaved", 0),
    ("flax", "1f1b", 0),
    ("flax", "ooo", 0),
    ("flax-remat", "zb-h1", 0),
  ],
)
def test_scanned_stage_matches_jax_grad(kind, name, lag):
  # interleaved: 4 virtual stages on 2 devices (first, middle and last kinds).
  stage_fn, params = _model(kind, 4 if name == "interleaved" else 2)
  loss, grads = _jit(_step(stage_fn, name, lag))(params, (_X, _T))
  ref_loss, ref_grads = _reference(stage_fn, _loss, params, _X, _T)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)


# --- structure: which phase runs which matmul -------------------------------------
def _dots(jaxpr, ids=None, trips=1, out=None):
  """[(output shape, times run)] of every dot_general, scans counted x length."""
  out = [] if out is None else out
  for k, e in enumerate(jaxpr.eqns):
    if ids is not None and k not in ids:
      continue
    if e.primitive.name == "dot_general":
      out.append((tuple(e.outvars[0].aval.shape), trips))
    n = trips * (_compat.scan_info(e).length if _compat.is_scan(e) else 1)
    for sub in _compat.subjaxprs(e):
      _dots(getattr(sub, "jaxpr", sub), None, n, out)
  return out


def _phase(fl, ids):
  return [fl.jaxpr.eqns[k] for k in ids]


@pytest.mark.parametrize("kind", ["lax", "flax", "flax-remat"])
def test_b_runs_the_dx_chain_and_w_the_stacked_dw(kind):
  stage_fn, params = _model(kind)
  p1 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
  x = jax.ShapeDtypeStruct((ROWS // 2, D), jnp.float32)
  w_shapes = {tuple(a.shape[1:]) for a in jax.tree.leaves(p1) if len(a.shape) == 3}
  dw_dots = len(w_shapes) * LAYERS  # one dW matmul per kernel per layer
  fl = make_flavor(False, True, stage_fn, _loss, None, p1, None, x, x, x)  # the last stage
  scans = lambda ids: [e for e in _phase(fl, ids) if e.primitive.name == "scan"]  # noqa: E731
  # B holds the B-scan (it carries dX through the layers); W one loop over the
  # layers computing every stacked dW (the W-scans, merged).
  (b_scan,), (w_scan,) = scans(fl.b_eqns), scans(fl.w_eqns)
  assert _compat.scan_info(b_scan).num_carry >= 1 and _compat.scan_info(w_scan).num_carry == 0
  grads = {v for v in fl.grads}
  assert grads <= set(w_scan.outvars)  # every stacked dW comes out of W
  f, b, w = (_dots(fl.jaxpr, set(ids)) for ids in (fl.f_eqns, fl.b_eqns, fl.w_eqns))
  # B computes no dW: none of its matmuls has a weight's shape; W's all do.
  assert not [s for s, _ in b if s in w_shapes]
  assert sum(n for s, n in w if s in w_shapes) == dw_dots
  assert all(s in w_shapes for s, _ in w)
  # Nothing is recomputed: F + B + W run as many matmuls as jax.vjp of the stage
  # (with remat that count includes its one recomputation of the forward).
  ref = jax.make_jaxpr(lambda p, x, ct: jax.vjp(stage_fn, p, x)[1](ct))(p1, x, x)
  count = lambda ds: sum(n for _, n in ds)  # noqa: E731
  assert count(f) + count(b) + count(w) == count(_dots(ref.jaxpr))
  assert count(f) == len(w_shapes) * LAYERS  # the forward's dots, once
  # B's stacked residuals (what W reads, e.g. each layer's output cotangent)
  # are stored per microbatch like every B->W residual.
  assert any(v.aval.shape[:1] == (LAYERS,) for v in fl.bres)


def test_compiled_tick_loop_runs_one_loop_per_phase():
  stage_fn, params = _model("flax")
  compiled = jax.jit(_step(stage_fn, "zb-h1")).lower(params, (_X, _T)).compile()
  loss, grads = compiled(params, (_X, _T))
  ref_loss, ref_grads = _reference(stage_fn, _loss, params, _X, _T)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)
  s = hlo_schedule.parse(compiled.as_text())
  # The table's scan is the entry's while loop; its body's action switch
  # holds one branch per (stage kind, F/B/W) the table uses (the other
  # conditionals write residual records or pick a transfer pattern).
  conds = [i for c in s.computations.values() for i in c if i.op == "conditional"]
  cond = [max(conds, key=lambda i: len(i.calls))]

  def loops(comp, seen=()):
    n = 0
    for i in s.computations.get(comp, ()):
      n += i.op == "while"
      if i.op != "while":
        n += sum(loops(c, seen + (comp,)) for c in i.calls if c not in seen)
    return n

  per_branch = [loops(c) for c in cond[0].calls]
  assert len(per_branch) == 1 + 2 * 3  # idle + (first, last) x (F, B, W)
  # On both stage kinds (first, last) F: the forward scan; B: the B-scan; W:
  # ONE merged W-scan, not one per stacked leaf (this stage has 6); the idle
  # branch none.
  assert sorted(per_branch) == [0] + [1] * (len(per_branch) - 1), per_branch


# --- scan_merge on its own ------------------------------------------------------
def test_merge_scans_equals_the_separate_scans():
  def two(w, v, h):
    a = jax.lax.scan(lambda c, w: (c * 2 + w, jnp.sum(w * h)), h, w)
    b = jax.lax.scan(lambda c, w: (c - w, w @ h), h, v)  # same xs shape, shared h
    return a, b

  args = (jnp.arange(6.0).reshape(3, 2), jnp.ones((3, 2)), jnp.array([1.0, -1.0]))
  closed = jax.make_jaxpr(two)(*args)
  j = closed.jaxpr
  merged, new = scan_merge.merge_runs(j, range(len(j.eqns)))
  assert len(merged.eqns) == len(j.eqns) - 1 and len(set(new.values())) == len(merged.eqns)
  ours = _compat.eval_jaxpr(merged, closed.consts, *args)
  assert_trees_close(ours, jax.tree.leaves(two(*args)))
  # Scans that feed each other, or differ in length, stay apart.
  chained = jax.make_jaxpr(
    lambda w, h: jax.lax.scan(
      lambda c, w: (c + w, None), jax.lax.scan(lambda c, w: (c * w, None), h, w)[0], w
    )[0]
  )
  j2 = chained(args[0], args[2]).jaxpr
  assert scan_merge.merge_scans(j2.eqns) is None
  uneven = jax.make_jaxpr(
    lambda w, v: (
      jax.lax.scan(lambda c, w: (c, w), 0.0, w),
      jax.lax.scan(lambda c, w: (c, w), 0.0, v),
    )
  )
  assert scan_merge.merge_scans(uneven(jnp.ones(3), jnp.ones(4)).jaxpr.eqns) is None
  result = doctest.testmod(scan_merge)
  assert result.attempted > 0 and result.failed == 0
