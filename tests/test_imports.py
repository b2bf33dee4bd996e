"""Module -> module imports inside the package only run downward: no circle.

Every module under `ooojax/` and `passes/` is parsed with `ast`; every import
of another in-package module counts, at the top of the file or inside a
function (a lazy import is still a dependency), except those under
`if TYPE_CHECKING:`, which never run. `passes.x` and `ooojax.passes.x` are the
same module (`ooojax/passes` is a symlink to `passes/`). Importing a submodule
also runs its parent packages' `__init__`: from outside a package that is an
edge to the package too (`ooojax._api` importing `ooojax.data_parallel._x`
runs `ooojax/data_parallel/__init__` first, so that `__init__` must not import
`_api` back). From inside it is not: a package's `__init__` importing its own
submodules is the façade, not a circle.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _modules() -> dict[str, pathlib.Path]:
  """Dotted name (`ooojax.x`, `ooojax.passes.y`) -> source file."""
  mods = {}
  for top, prefix in (("ooojax", "ooojax"), ("passes", "ooojax.passes")):
    base = ROOT / top
    for p in base.rglob("*.py"):
      rel = p.relative_to(base)
      if rel.parts[0] == "passes":  # the symlink: counted once, as passes/
        continue
      parts = list(rel.with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      mods[".".join([prefix, *parts])] = p
  return mods


def _canon(name: str) -> str:
  return "ooojax." + name if name == "passes" or name.startswith("passes.") else name


def _is_type_checking(test: ast.expr) -> bool:
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
  )


def _imports(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
  """The in-package modules that `name` imports, anywhere but under TYPE_CHECKING."""
  is_pkg = path.name == "__init__.py"
  here = name if is_pkg else name.rsplit(".", 1)[0]
  out: set[str] = set()

  def resolve(mod: str) -> str | None:
    # the deepest in-package module that the dotted path names
    while mod and mod not in mods:
      mod = mod.rpartition(".")[0]
    return mod or None

  def visit(node: ast.AST) -> None:
    if isinstance(node, ast.If) and _is_type_checking(node.test):
      for child in node.orelse:
        visit(child)
      return
    if isinstance(node, ast.Import):
      for a in node.names:
        if (m := resolve(_canon(a.name))) is not None:
          out.add(m)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = here.split(".")
        base = base[: len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
      else:
        mod = _canon(node.module or "")
      for a in node.names:
        if f"{mod}.{a.name}" in mods:  # `from pkg import submodule`
          out.add(f"{mod}.{a.name}")
        elif (m := resolve(mod)) is not None:
          out.add(m)
    for child in ast.iter_child_nodes(node):
      visit(child)

  visit(ast.parse(path.read_text()))
  for m in list(out):  # the parent packages a submodule import runs, seen from outside them
    parts = m.split(".")
    for i in range(1, len(parts)):
      pkg = ".".join(parts[:i])
      if pkg in mods and not (name == pkg or name.startswith(pkg + ".")):
        out.add(pkg)
  out.discard(name)
  return out


def _graph() -> dict[str, set[str]]:
  mods = _modules()
  return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component with more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on: set[str] = set()
  comps: list[list[str]] = []

  def strong(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        strong(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        comps.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      strong(v)
  return [_one_cycle(graph, set(c)) for c in comps]


def _one_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
  # breadth-first from the component's first module back to itself
  start = min(comp)
  prev: dict[str, str] = {}
  frontier = [start]
  while frontier:
    nxt = []
    for v in frontier:
      for w in sorted(graph[v] & comp):
        if w == start:
          path = [v]
          while path[-1] != start:
            path.append(prev[path[-1]])
          return [*reversed(path), start]
        if w not in prev:
          prev[w] = v
          nxt.append(w)
    frontier = nxt
  raise AssertionError("a strongly connected component has a cycle")


def test_the_package_imports_without_a_circle():
  cycles = _cycles(_graph())
  assert not cycles, "import circles (break each by moving the shared piece down):\n" + "\n".join(
    " -> ".join(c) for c in cycles
  )


def test_the_graph_sees_every_kind_of_import():
  g = _graph()
  # a top-level `from ooojax.passes.x import y`, a relative one, and the symlinked name
  assert "ooojax.passes.split" in g["ooojax._api"]
  assert all(not m.startswith("passes.") for deps in g.values() for m in deps)
  assert "ooojax.passes.pipeline.actions" in g["ooojax.passes.pipeline.schedule"]
  # importing a submodule from outside its package runs the package's __init__ first
  assert "ooojax.passes" in g["ooojax._api"]  # via ooojax.passes.split
  # ... but not from inside it: the façade importing its own parts is no circle
  assert "ooojax.passes" not in g["ooojax.passes.split"]


def test_the_check_finds_a_circle():
  g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _cycles(g) == [["a", "b", "c", "a"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []
