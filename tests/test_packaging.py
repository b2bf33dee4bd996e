"""The installed wheel claims one import name, `ooojax`.

The repository keeps the passes at the top (`passes/`, the design card's
layout); `ooojax/passes` is a symlink to it, so the wheel ships them as
`ooojax.passes` and running from the source tree (`PYTHONPATH=.`) imports the
same modules under the same name. Nothing may import a top-level `passes`:
with the source tree on `sys.path` that would load a second copy of every
module (two registries, two `Unit` classes).
"""

import ast
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [
  p
  for d in ("passes", "ooojax", "benchmarks", "tests", "scripts", "docs")
  if (ROOT / d).is_dir()
  for p in (ROOT / d).rglob("*.py")
]
# the source tree off sys.path: pip would take its metadata for an installed ooojax
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _top_level_passes(source: str) -> list[int]:
  lines = []
  for node in ast.walk(ast.parse(source)):
    mods = (
      [node.module or ""]
      if isinstance(node, ast.ImportFrom) and not node.level
      else [a.name for a in node.names]
      if isinstance(node, ast.Import)
      else []
    )
    if any(m.split(".")[0] == "passes" for m in mods):
      lines.append(node.lineno)
  return lines


def _notebook_code(path: pathlib.Path) -> str:
  cells = json.loads(path.read_text())["cells"]
  code = ("".join(c["source"]) for c in cells if c["cell_type"] == "code")
  # IPython magics (`%matplotlib`) are not Python
  return "\n".join(line for c in code for line in c.splitlines() if not line.startswith(("%", "!")))


def test_nothing_imports_a_top_level_passes():
  found = {
    str(p.relative_to(ROOT)): lines for p in SOURCES if (lines := _top_level_passes(p.read_text()))
  }
  found |= {
    str(p.relative_to(ROOT)): lines
    for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
    if (lines := _top_level_passes(_notebook_code(p)))
  }
  assert not found, f"import `ooojax.passes...` instead of `passes...`: {found}"


def test_the_check_sees_a_top_level_import():
  assert _top_level_passes("from passes.split import split\nimport passes") == [1, 2]
  assert not _top_level_passes("from ooojax.passes import cost\nfrom . import passes")


def test_a_top_level_passes_import_is_refused():
  # the source tree on sys.path makes `passes` importable; it must fail loudly
  r = subprocess.run(
    [sys.executable, "-c", "import passes"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
  )
  assert r.returncode != 0 and "ooojax.passes" in r.stderr, r.stderr


def test_the_passes_link_points_at_the_passes():
  link = ROOT / "ooojax" / "passes"
  assert link.is_symlink() and link.resolve() == (ROOT / "passes").resolve()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  pytest.importorskip(
    "setuptools",
    reason="building the wheel offline needs setuptools (the `test` extra installs it)",
  )
  # build from a copy: setuptools writes build/ and *.egg-info beside pyproject.toml
  src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(ROOT / name, src / name)
  for name in ("ooojax", "passes"):
    shutil.copytree(
      ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
    )
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "wheel",
      "--no-deps",
      "--no-build-isolation",
      "-q",
      "-w",
      str(out),
      str(src),
    ],
    capture_output=True,
    text=True,
    env=_ENV,
  )
  assert r.returncode == 0, r.stdout + r.stderr
  (whl,) = out.glob("ooojax-*.whl")
  return whl


def test_the_wheel_has_one_top_level_package_holding_every_pass(wheel):
  names = zipfile.ZipFile(wheel).namelist()
  tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
  assert tops == {"ooojax"}, tops
  shipped = {n for n in names if n.startswith("ooojax/passes/") and n.endswith(".py")}
  want = {"ooojax/" + str(p.relative_to(ROOT)) for p in (ROOT / "passes").rglob("*.py")}
  assert shipped == want, (want - shipped, shipped - want)
  # the GPU calibrations the cost model reads (passes.calibration.SHIPPED)
  cals = {"ooojax/calibration/" + p.name for p in (ROOT / "ooojax" / "calibration").glob("*.json")}
  assert cals and cals <= set(names), cals - set(names)


def test_installing_the_wheel_adds_only_ooojax(wheel, tmp_path):
  # a clean venv (no jax: --no-deps), so only what the wheel itself adds appears
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_ENV)
  py = venv / "bin" / "python"
  site = pathlib.Path(
    subprocess.run(
      [py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
      check=True,
      capture_output=True,
      text=True,
      env=_ENV,
    ).stdout.strip()
  )
  before = set(p.name for p in site.iterdir())
  subprocess.run(
    [py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, env=_ENV
  )
  added = {n for n in set(p.name for p in site.iterdir()) - before if not n.endswith(".dist-info")}
  assert added == {"ooojax"}, added
  assert (site / "ooojax" / "passes" / "pipeline" / "generate.py").is_file()
