"""Sphinx configuration for the ooojax docs site.

Sphinx + MyST (markdown pages) + myst-nb (the notebooks, rendered from their
stored cells, never executed here: `tests/test_notebooks.py` runs them) +
autodoc/napoleon (the API reference from the Google docstrings): the stack
JAX, flax and optax publish with, so their readers find the layout they know.
No intersphinx: CI reaches package registries only, and an unreachable
inventory is a warning, which -W makes an error.

Build: `sphinx-build -W -b html docs docs/_build/html` (warnings are errors;
`.ci/run` builds it).
"""

import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the source tree, as PYTHONPATH=. runs it
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # autodoc imports ooojax, which imports jax
os.environ.setdefault("MPLBACKEND", "Agg")

project = "ooojax"
author = "the ooojax authors"
copyright = "the ooojax authors, Apache-2.0"
release = version = "0.1.0"

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]
exclude_patterns = ["_build", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb", ".rst": "restructuredtext"}

# MyST: `file.md#heading` links, $math$, ::: fences.
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3
# benchmarks/RESULTS.md is an append-only log whose sections are `###` under
# one `#` (benchmarks/_report.py writes them): its heading jumps are by design.
suppress_warnings = ["myst.header"]

# Notebooks: render the committed cells, never execute (CI executes them in tests).
nb_execution_mode = "off"

# API reference: the docstrings are Google style with markdown-ish `code`.
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
default_role = "literal"  # `x` in a docstring reads as code, as on GitHub

html_theme = "sphinx_book_theme"
html_title = "ooojax"
html_theme_options = {"show_toc_level": 2, "use_download_button": False}


# The docstrings are written to read well as plain text and on GitHub
# (markdown-style `code`s, attribute lists without a header). Two repairs let
# reStructuredText take them as they are, for today's docstrings and those to come:
_CODE_THEN_LETTER = re.compile(r"(`[^`\s](?:[^`]*[^`\s])?`)(?=[\w(])")


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _repair_docstring(app, what, name, obj, options, lines):
  out = []
  for i, line in enumerate(lines):
    # `gpu`s, `nnx.Param`s: inline code must end before a letter
    line = _CODE_THEN_LETTER.sub(r"\1\\ ", line)
    prev, nxt = (out[-1] if out else ""), (lines[i + 1] if i + 1 < len(lines) else "")
    if prev.strip() and line.strip() and not prev.lstrip().startswith((">>>", "...")):
      # a dedent needs a blank line before it (an attribute list's next name), and
      # so does a line that an indented block follows (the name it describes)
      if _indent(line) < _indent(prev) or (
        _indent(line) == _indent(prev)
        and nxt.strip()
        and _indent(nxt) > _indent(line)
        and not line.lstrip().startswith((">>>", "..."))
      ):
        out.append("")
    out.append(line)
  lines[:] = out


def setup(app):
  app.connect("autodoc-process-docstring", _repair_docstring, priority=600)  # after napoleon
