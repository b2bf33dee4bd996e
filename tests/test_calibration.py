"""A calibration file (passes.calibration) changes what single_gpu admits."""

import json

import jax
import jax.numpy as jnp
import pytest

import ooojax as ooo
from ooojax.passes import calibration, cost
from tests.test_overlap import _demo_case


def _calls(**kw):
  loss, args, k = _demo_case()
  args = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), args)
  return ooo.explain(loss, *args, mode="single_gpu", device="H100", **k).schedule.calls


def test_calibration_file_changes_admission(tmp_path, monkeypatch):
  monkeypatch.setenv(calibration.ENV, "none")  # the preset
  base = _calls()
  assert base  # the spec's own per-call cost admits the conv dW
  entry = {"format": 1, "device": "H100", "jax": jax.__version__, "pair_gain": {"x": 1.1}}
  (tmp_path / "h100.json").write_text(json.dumps({**entry, "call_seconds": 1e-3}))
  monkeypatch.setenv(calibration.ENV, str(tmp_path))
  assert cost.get_spec("H100").sync == 1e-3
  assert _calls() == ()  # 1 ms per stream call: no cluster is worth one
  (tmp_path / "h100.json").write_text(json.dumps({**entry, "call_seconds": 0.0, "x": 1}))
  assert len(_calls()) >= len(base)
  (tmp_path / "h100.json").write_text(json.dumps({**entry, "call_seconds": "fast"}))
  with pytest.raises(ValueError, match="call_seconds"):
    cost.get_spec("H100")


def test_a_calibration_variable_that_is_no_folder_is_refused(monkeypatch):
  # a device name there would otherwise be ignored without a word
  monkeypatch.setenv(calibration.ENV, "h200")
  with pytest.raises(ValueError, match="'h200' is not a folder.*device='H200'"):
    cost.get_spec("H200")
