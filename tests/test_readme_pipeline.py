"""The README's pipeline train step (flax linen, dropout, metrics) runs as written."""

import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).parent.parent / "README.md"
MARK = "A flax linen train step with dropout and metrics, end to end:"


def test_readme_pipeline_train_step_runs():
  text = README.read_text()
  code = re.search(r"```python\n(.*?)```", text[text.index(MARK) :], re.S).group(1)
  env: dict = {}
  exec(compile(code, str(README), "exec"), env)  # noqa: S102
  assert env["metrics"]["accuracy"].shape == () and np.isfinite(float(env["loss"]))
  assert jax.tree.structure(env["params"]) == jax.tree.structure(
    env["model"].init(jax.random.key(0), env["x"])["params"]
  )
