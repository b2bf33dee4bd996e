"""`benchmarks/gpu.sh` runs end to end before it ever meets a GPU.

A GPU is lent rarely and for one call: a step that breaks there (a shell
function passed to `timeout`, a renamed flag) loses its only run. The dry run
(`DRY=1`: tiny sizes, CPU, the same steps writing the same files) catches that
here.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.sh"


def _steps() -> list[str]:
  return re.findall(r"^step (\S+) \d+ ", SCRIPT.read_text(), flags=re.M)


def test_the_steps():
  steps = _steps()
  assert len(steps) >= 8 and len(set(steps)) == len(steps), steps  # one file per step
  # the ratios first (does the pinned step still lose with jit's fast dispatch?),
  # the host's share of the gaps, then the stream calibration to refit (issue 50)
  assert steps[:5] == [
    "step_time_demo_cnn",
    "step_time_resnet50",
    "gpu_gaps_demo_cnn",
    "stream_pairs",
    "executor_cost",
  ]


# Steps whose command is another step's with only the model or XLA_FLAGS changed:
# the dry run (a CPU, tiny sizes) would check nothing new in them, and test_zoo
# checks those models' gradients. `test_the_aliases` keeps this list honest.
ALIASES = {
  "step_time_mobilenet_v3_small": "step_time_resnet50",
  "step_time_densenet121": "step_time_resnet50",
  "step_time_mobilenet_v3_large": "step_time_resnet50",
  "step_time_resnet50_cb_off": "step_time_resnet50",
  # step_time_resnet50 runs a zoo model through the same `step_time.case`
  "gpu_trace_resnet50": "gpu_trace_demo_cnn",
}


def _command(name: str) -> str:
  (line,) = re.findall(rf"^step {name} \d+ (.*)$", SCRIPT.read_text(), flags=re.M)
  return re.sub(r"--model \S+", "--model M", line).split(" --also-with")[0].rstrip(" \\")


def test_the_aliases():
  for name, same in ALIASES.items():
    assert _command(name) == _command(same), name


# The dry run's steps, split over cells (`ONLY=`): each step is a fresh process that
# compiles, and one test running them all would be the longest of the suite, the
# last to end when xdist has nothing left to share out.
CELLS = 7  # 14 steps: two per cell


def _dry_steps() -> list[str]:
  return [s for s in _steps() if s not in ALIASES]


@pytest.mark.parametrize("cell", range(CELLS))
def test_dry_run_writes_every_steps_file(tmp_path, cell):
  steps = _dry_steps()[cell::CELLS]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  # BUDGET=1: a dry run ignores the budget (a busy machine must not fail it)
  env.update(
    DRY="1",
    OUT=str(tmp_path),
    PY=sys.executable,
    BUDGET="1",
    JAX_PLATFORMS="cpu",
    ONLY=" ".join(steps),
  )
  r = subprocess.run(
    ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000
  )  # only a hang
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert not (tmp_path / "skipped.txt").exists(), (tmp_path / "skipped.txt").read_text()
  assert "jax" in (tmp_path / "env.txt").read_text()
  assert sorted(p.stem for p in tmp_path.glob("*.md")) == sorted(steps)  # those steps only
  for name in steps:
    text = (tmp_path / f"{name}.md").read_text()
    codes = re.findall(r"^exit (\d+) after", text, flags=re.M)
    assert codes == ["0"], f"{name}: exit {codes}\n{text[-3000:]}"
  if "step_time_demo_cnn" in steps:
    # step-time steps print their table as they go: a run cut short keeps it
    assert "jax.grad" in (tmp_path / "step_time_demo_cnn.md").read_text()


def test_budget_spent_lists_every_step_as_skipped(tmp_path):
  # the real run's budget: with none left, each step is skipped and said so, none runs
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(OUT=str(tmp_path), PY=sys.executable, BUDGET="0", JAX_PLATFORMS="cpu")
  env.pop("DRY", None)
  r = subprocess.run(
    ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000
  )  # only a hang
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  skipped = (tmp_path / "skipped.txt").read_text().splitlines()
  assert [s.split()[0] for s in skipped] == _steps()
  assert not list(tmp_path.glob("*.md"))


def test_missing_dependency_stops_at_once(tmp_path):
  fake = tmp_path / "py"
  fake.write_text("#!/bin/sh\nexit 1\n")
  fake.chmod(0o755)
  env = dict(os.environ, OUT=str(tmp_path / "out"), PY=str(fake))
  r = subprocess.run(
    ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000
  )  # only a hang
  assert r.returncode == 1 and "missing a dependency" in r.stdout
