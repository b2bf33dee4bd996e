"""Data parallel: gradient buckets and the all-reduces that carry them.

One idea: each gradient is reduced as soon as the dW that makes it is done, in
an order the link can keep busy, and without the combiners merging it back.

* `plan`: buckets, reverse first-k and the link schedule (cost model).
* `emit`: each bucket's all-reduce issued right after its last dW unit.
* `loops`: a scanned stack's dW reduced one layer at a time inside its loop.
"""
