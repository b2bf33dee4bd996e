"""benchmarks/_cpu.py: the stack-offset helpers the overhead benchmark measures with."""

import pytest

from benchmarks import _cpu


def test_at_stack_offset_calls_from_a_frame_of_that_many_locals():
  assert _cpu.at_stack_offset(0, lambda: 7) == 7
  assert _cpu.at_stack_offset(300, lambda: "x") == "x"
  # a frame's size on the data stack is its locals (plus header and stack)
  assert _cpu._padding_frame(300).__code__.co_nlocals == 1 + 300  # fn + the padding
  with pytest.raises(ValueError, match="slots"):
    _cpu.at_stack_offset(-1, lambda: None)


def test_offset_grid_spans_one_chunk():
  grid = _cpu.offset_grid(16)
  assert grid[0] == 0 and len(set(grid)) == 16
  assert all(0 <= g < _cpu.CHUNK_SLOTS for g in grid)
  assert grid[1] * 16 == _cpu.CHUNK_SLOTS
  with pytest.raises(ValueError):
    _cpu.offset_grid(0)


def test_cpu_times():
  out, t = _cpu.cpu_times(lambda: sum(range(2_000_000)))  # tens of ms of user time
  assert out == sum(range(2_000_000))
  assert t.total > 0 and t.user >= 0 and t.sys >= 0 and t.faults >= 0 and t.total == t.user + t.sys
