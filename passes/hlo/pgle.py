"""hlo.pgle: the link model handed to XLA:GPU's latency-hiding scheduler as a profile.

Contract: `profile(hlo_text, n_devices, link) -> str` (a `ProfiledInstructionsProto`
in text form), pure text and arithmetic, no JAX needed; `compiler_options(...)` writes
it to a file and names it in the XLA option that reads it.

XLA:GPU places each collective's start only as early as its own latency estimate
says the transfer needs, and that estimate is NVLink-fast: on a slower link
(InfiniBand, Ethernet) the compute it schedules inside each window covers a fraction
of the transfer (issue 53, fourth pass). Its profile-guided latency estimator
(`--xla_gpu_pgle_profile_file_or_directory_path`) takes a profile of
`costs { name: "<instruction>" cost_us: ... }` and, for an async start named there,
uses that cost as the latency to its done. This pass writes that profile from the
link model (`passes.hlo.replay`: each collective of a compiled program, its own time
on `link`, queueing left out), so a second compile of the same program schedules
for the link it will run on. Names match because the same jitted function lowers to
the same module: compile once, profile, compile again with the option. Instructions
the profile does not name keep XLA's own estimate (it logs them as missing).

>>> p = profile('''
... HloModule m, is_scheduled=true
... ENTRY %main (p: f32[1024,1024]) -> f32[1024,1024] {
...   %p = f32[1024,1024]{1,0} parameter(0)
...   %s = f32[1024,1024]{1,0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add
...   ROOT %d = f32[1024,1024]{1,0} all-reduce-done(%s)
... }''', 2, "IB400")
>>> print(p, end="")
costs { name: "s" cost_us: 89.886 }
"""

from __future__ import annotations

import os
import tempfile

from ooojax.passes.hlo.replay import get_link, replay
from ooojax.passes.simulate import Link

# The XLA:GPU debug option that reads a profile (file or directory).
PGLE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"


def profile(hlo: str, n_devices: int, link: str | Link, device: str = "H100") -> str:
  """Each collective's seconds on `link` as a `ProfiledInstructionsProto` (text).

  Args:
    hlo: `compiled.as_text()` of a compile-only (or real) GPU program.
    n_devices: devices a collective spans when its replica groups are not printed.
    link: a `passes.hlo.replay.REPLAY_LINKS` name ("IB400", "25GbE", ...) or a `Link`.
    device: the roofline spec the replay walks with (only the order matters here).
  """
  r = replay(hlo, n_devices, get_link(link), device)
  # The transfer's own time, not its queueing: XLA asks how long this collective takes.
  return "".join(
    f'costs {{ name: "{t.name}" cost_us: {(t.end - t.start) * 1e6:.3f} }}\n' for t in r.transfers
  )


def compiler_options(
  hlo: str, n_devices: int, link: str | Link, path: str | None = None, device: str = "H100"
) -> dict[str, str]:
  """Writes `profile(...)` to `path` (default: a new temporary file) and returns
  `{PGLE_OPTION: path}`, for `jax.jit(f).lower(...).compile(compiler_options=...)`
  of the same function that compiled to `hlo`."""
  text = profile(hlo, n_devices, link, device)
  if path is None:
    fd, path = tempfile.mkstemp(prefix="ooojax-pgle-", suffix=".pbtxt")
    os.close(fd)
  with open(path, "w") as f:
    f.write(text)
  return {PGLE_OPTION: path}
