"""benchmarks/pipeline.py: the simulated paper-scale table (cost model only)."""

import math
import re

from benchmarks import pipeline


def test_paper_scale_table_has_a_finite_cell_for_every_runnable_schedule():
  # 8 stages: even splits; 32: BERT-24 has fewer layers than stages (n/a), BERT-48
  # an uneven split (~).
  lines, exact, every = pipeline.table_paper_scale(stages=(8, 32), micro_per_stage=(2,))
  rows = [l for l in lines if l.startswith("| BERT-")]
  assert len(rows) == 2 * 2 * 2  # models x links x stages
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")][4:]
    assert len(cells) == len(pipeline.PAPER_SCHEDULES)
    for c in cells:
      if c == "n/a":
        continue
      ms, x = re.fullmatch(r"~?([0-9.]+) \(([0-9.]+)x\)", c).groups()
      assert math.isfinite(float(ms)) and float(ms) > 0 and math.isfinite(float(x))
  assert any("| BERT-48 | 10GbE | 8 |" in r and "n/a" not in r for r in rows)  # zb-v fits
  assert all(r.count("n/a") == 5 for r in rows if r.startswith("| BERT-24") and "| 32 |" in r)
  assert any("~" in r for r in rows if r.startswith("| BERT-48") and "| 32 |" in r)
  assert exact and len(every) > len(exact) and all(math.isfinite(v) and v > 0 for v in every)
  assert "1.41-1.99x" in "".join(pipeline.paper_scale_summary(exact, every))
