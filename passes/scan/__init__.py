"""Layers in one `lax.scan`: the backward scan split into B and W, merged, skewed.

One idea: a scan over layers is a loop whose transposed body computes dX and
dW together; these passes give the dW part the same out-of-order freedom as
unrolled layers.

* `split`: a backward scan becomes a B-scan (the dX carry chain) and W-scans
  (per-parameter dW), registered as `passes.split`'s rewrite rule for `scan`.
* `merge`: independent scans over the same layers run as one loop.
* `skew`: one loop whose step i runs B(i) beside W(i-1).
"""

from ooojax.passes import split as _split
from ooojax.passes.scan.split import split_scan_rule as _split_scan_rule

_split.REWRITE_RULES.setdefault("scan", _split_scan_rule)
