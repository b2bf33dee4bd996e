"""One module knows JAX's internals: `passes/_compat.py`.

A JAX upgrade that renames a primitive's params (jax 0.11 moved scan's
`num_consts` / `num_carry` into FlatTrees) must touch that file alone.
"""

import ast
import functools
import pathlib

import jax
import jax.numpy as jnp
import pytest

from ooojax.passes import _compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("passes", "ooojax", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py")]
COMPAT = ROOT / "passes" / "_compat.py"


def _reads_params(tree) -> list[int]:
  """Lines that index or walk an equation's params: `e.params[...]`, `.params.get(...)`,
  `.params.items()`, `dict(e.params)`, `e.params` in a `for`. Passing a
  `TrainState.params` along is not a read of a primitive's params."""
  lines = []
  for node in ast.walk(tree):
    target = None
    if isinstance(node, ast.Subscript):
      target = node.value
    elif isinstance(node, ast.Attribute) and node.attr in ("get", "items", "values", "keys"):
      target = node.value
    elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict" and node.args:
      target = node.args[0]
    elif isinstance(node, (ast.For, ast.comprehension)):
      target = node.iter
    if isinstance(target, ast.Attribute) and target.attr == "params":
      lines.append(target.lineno)  # a comprehension node has no line of its own
  return lines


def _jax_private(tree) -> list[int]:
  lines = []
  for node in ast.walk(tree):
    mods = []
    if isinstance(node, ast.ImportFrom) and node.module:
      mods = [node.module]
    elif isinstance(node, ast.Import):
      mods = [a.name for a in node.names]
    if any(m.startswith("jax._src") for m in mods):
      lines.append(node.lineno)
  return lines


@functools.cache
def _parsed(path: pathlib.Path) -> ast.Module:
  return ast.parse(path.read_text())  # once for both checks (parsing is most of their time)


@pytest.mark.parametrize("check", [_reads_params, _jax_private], ids=["params", "jax._src"])
def test_only_compat_knows_jax_internals(check):
  found = {
    str(p.relative_to(ROOT)): lines for p in SOURCES if p != COMPAT if (lines := check(_parsed(p)))
  }
  assert not found, f"move these into passes/_compat.py accessors: {found}"


def test_the_check_sees_a_params_read():
  assert _reads_params(ast.parse("n = eqn.params['num_carry']")) == [1]
  assert _reads_params(ast.parse("for k, v in e.params.items(): pass")) == [1]
  assert not _reads_params(ast.parse("close(state.params, ref)"))


def _fwd_bwd_scan():
  f = lambda w, x: jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0])
  w, x = jnp.ones((3, 4, 4)), jnp.ones((2, 4))
  return jax.make_jaxpr(jax.grad(f))(w, x).jaxpr


def test_scan_info_round_trips_through_scan_eqn():
  (fwd, *_), (bwd, *_) = (
    [e for e in _fwd_bwd_scan().eqns if _compat.is_scan(e)][i:] for i in (0, -1)
  )
  for e in (fwd, bwd):
    info = _compat.scan_info(e)
    assert info.length == 3 and info.num_carry >= 1
    again = _compat.scan_eqn(
      e,
      body=info.body,
      num_consts=info.num_consts,
      num_carry=info.num_carry,
      invars=e.invars,
      outvars=e.outvars,
    )
    assert _compat.scan_info(again) == info
  with pytest.raises(TypeError, match="scan_info expects a scan"):
    _compat.scan_info(jax.make_jaxpr(jnp.sin)(1.0).eqns[0])


def test_call_bodies_of_every_call_form():
  x = jnp.ones(3)
  forms = {
    "jit": jax.jit(jnp.sin),
    "remat": jax.checkpoint(jnp.sin),
    "custom_jvp": jax.nn.relu,
  }
  for name, f in forms.items():
    eqns = jax.make_jaxpr(f)(x).eqns
    assert any(_compat.call_body(e) is not None for e in eqns), name
  assert _compat.call_body(jax.make_jaxpr(jnp.sin)(x).eqns[0]) is None


def test_installed_packages_never_import_benchmarks_or_tests():
  # a pip-installed ooojax has neither: `python -m ooojax hlo` must still work
  bad = {}
  for p in SOURCES:
    rel = p.relative_to(ROOT)
    if rel.parts[0] not in ("ooojax", "passes"):
      continue
    for node in ast.walk(ast.parse(p.read_text())):
      mods = (
        [node.module or ""]
        if isinstance(node, ast.ImportFrom)
        else [a.name for a in node.names]
        if isinstance(node, ast.Import)
        else []
      )
      if any(m.split(".")[0] in ("benchmarks", "tests") for m in mods):
        bad.setdefault(str(rel), []).append(node.lineno)
  assert not bad, bad
