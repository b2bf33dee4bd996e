"""What XLA did: scheduled HLO read back as data and set beside the prediction.

One idea: claims about overlap are checked in the compiled schedule, not only
in the cost model.

* `schedule`: scheduled HLO text as frozen dataclasses (async pairs, what runs inside);
  it reads the text with `text` and names kernel kinds with `kinds`.
* `compare`: per dW unit, the predicted stream and overlap against the compiled one.
* `windows`: per collective, the compute XLA scheduled while it is in flight.
* `replay`: the schedule priced, compute stream next to one link: exposed communication.
* `kernels`: the kernels a program launches and the bytes they write, set beside jax.grad's.
"""
