"""hlo.replay: price a scheduled GPU program: compute stream next to one link.

Contract: `replay(hlo_text, n_devices, link, device="H100", measured=None) ->
Replay`, pure text and arithmetic, no JAX needed.

XLA:GPU's optimized module (`compiled.as_text()`, `is_scheduled=true`) runs
its entry computation in printed order on one compute stream; each async
collective (`all-reduce-start` .. `-done`, reduce-scatter / all-gather /
collective-permute, also wrapped in `async-start`) runs on the network from
its start to its done. This pass walks that order and keeps two clocks:

* **compute**: every kernel (fusion, GEMM, conv, copy, custom call, a
  collective XLA made synchronous) is priced by the roofline of
  `passes.cost` (`launch + max(flops / peak, bytes / bandwidth)`; a GEMM or
  conv at the tensor-core peak of its dtype, TF32 for f32), or by
  `measured[name]` seconds where a GPU timed that instruction.
* **link**: a start queues its transfer behind the link's previous one (one
  link serialises transfers) from the moment the compute stream reaches it;
  it takes the ring cost of its kind on `link` (all-reduce
  `2 (n-1)/n * bytes / bw + 2 (n-1) * latency`, reduce-scatter and all-gather
  `(n-1)/n * bytes / bw + (n-1) * latency` with bytes the unsharded size,
  collective-permute `bytes / bw + latency`). A done waits for its
  transfer: the compute stream stalls until it ends (`passes.simulate.LinkQueue`,
  the rule the data-parallel planner prices with; `in_flight=1` also forces the
  previous done at each start, XLA:GPU's one collective in flight, which a compiled
  program's order already holds).

`while` bodies run their known trip count (`known_trip_count` in the backend
config; once when unknown), `call`s their callee, a `conditional` its dearest
branch. Stream-annotated async calls are priced on the compute stream (their
second stream is not modelled). The result: compute time, communication time
(link busy), exposed communication (`step - compute`: the stall at the dones)
and the step. Everything is a model of the compiled schedule, never a timing.

>>> r = replay('''
... HloModule m, is_scheduled=true
... ENTRY %main (p: f32[1024,1024]) -> f32[1024,1024] {
...   %p = f32[1024,1024]{1,0} parameter(0)
...   %s = f32[1024,1024]{1,0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add
...   ROOT %d = f32[1024,1024]{1,0} all-reduce-done(%s)
... }''', 2, "nvlink")
>>> round(r.comm * 1e6, 2), r.exposed == r.comm, r.reductions
(13.32, True, 1)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from ooojax.passes.cost import DeviceSpec, get_spec
from ooojax.passes.hlo.schedule import COLLECTIVE_OPS, HloSchedule, Instr, parse
from ooojax.passes.simulate import LINKS, Link, LinkQueue

# Links beyond `passes.simulate.LINKS` (per direction; latency per ring step).
REPLAY_LINKS = {
  **LINKS,
  "IB100": Link("IB100", 5e-6, 100e9 / 8),  # 100 Gb/s InfiniBand (HDR100)
  "IB400": Link("IB400", 3e-6, 400e9 / 8),  # 400 Gb/s InfiniBand (NDR)
}

_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2}
_BYTES.update({"f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16})
_CONTRACT = re.compile(
  r'(?:lhs_contracting_dims=\{([\d,]*)\}|"lhs_contracting_dimensions":\[([^\]]*)\])'
)
_DIM_LABELS = re.compile(r"dim_labels=[^_]*_([^-]*)->")
_GROUPS = re.compile(r"feature_group_count=(\d+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_REPLICA = re.compile(r"replica_groups=(\{\{[\d,]*\}|\[(\d+),(\d+)\])")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_LINE_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_ASYNC_COLLECTIVE = tuple(f"{k}-start" for k in COLLECTIVE_OPS)


def get_link(link: str | Link) -> Link:
  """A `Link` from `REPLAY_LINKS` by name (case-insensitive) or passed through."""
  if isinstance(link, Link):
    return link
  for name, l in REPLAY_LINKS.items():
    if name.lower() == str(link).lower():
      return l
  raise ValueError(f"unknown link {link!r}; use one of {sorted(REPLAY_LINKS)} or pass a Link")


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One collective on the link: queued at `issue`, ran `start`..`end`, waited at `wait`."""

  name: str
  kind: str
  nbytes: int  # bytes that cross (the unsharded size for reduce-scatter / all-gather)
  issue: float
  start: float
  end: float
  wait: float  # when the compute stream reached its done

  @property
  def exposed(self) -> float:
    """How long the compute stream stalled at the done for this transfer."""
    return max(self.end - self.wait, 0.0)


@dataclasses.dataclass(frozen=True)
class Replay:
  """The replayed step: seconds on the compute stream, on the link, and the stall."""

  compute: float  # kernel seconds on the compute stream
  comm: float  # link busy seconds
  step: float  # when the compute stream (and the link) finished
  transfers: tuple[Transfer, ...]
  kernels: int
  link: str
  n_devices: int

  @property
  def exposed(self) -> float:
    """Communication the compute stream waited for (`step - compute`)."""
    return max(self.step - self.compute, 0.0)

  @property
  def reductions(self) -> int:
    """Collectives that reduce gradients (all-reduce, reduce-scatter)."""
    return sum(t.kind in ("all-reduce", "reduce-scatter") for t in self.transfers)

  def summary(self) -> str:
    return (
      f"replayed on {self.link} x{self.n_devices}: step {self.step * 1e3:.3f} ms, compute "
      f"{self.compute * 1e3:.3f} ms ({self.kernels} kernels), communication "
      f"{self.comm * 1e3:.3f} ms in {len(self.transfers)} collectives, exposed "
      f"{self.exposed * 1e3:.3f} ms"
    )


def collective_seconds(kind: str, nbytes: float, n: int, link: Link) -> float:
  """Ring cost of one collective over `n` devices; `nbytes` as `Transfer.nbytes`."""
  if n <= 1:
    return 0.0
  if kind == "all-reduce":
    steps, share = 2 * (n - 1), 2 * (n - 1) / n
  elif kind in ("reduce-scatter", "all-gather", "all-to-all"):
    steps, share = n - 1, (n - 1) / n
  else:  # collective-permute, send/recv, broadcast: one hop
    steps, share = 1, 1.0
  return steps * link.latency + share * nbytes / link.bandwidth


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)]


def _nbytes(shape: str) -> int:
  return sum(math.prod(d) * _BYTES.get(dt, 4) for dt, d in _arrays(shape))


def _first(shape: str) -> tuple[str, tuple[int, ...]]:
  a = _arrays(shape)
  return a[0] if a else ("f32", ())


class _Module:
  """The parsed schedule plus what `schedule.parse` does not keep, by instruction name."""

  def __init__(self, text: str):
    self.hlo: HloSchedule = parse(text)
    self.shape = {i.name: i.shape for c in self.hlo.computations.values() for i in c}
    self.attrs: dict[str, str] = {}
    for line in text.splitlines():
      m = _LINE_NAME.match(line)
      if m and any(k in line for k in ("dims", "dim_labels", "trip", "replica", "kind=kLoop")):
        self.attrs[m.group(1)] = line

  def operand_bytes(self, i: Instr) -> int:
    return sum(_nbytes(self.shape.get(o, "")) for o in i.operands)

  def read_bytes(self, i: Instr) -> int:
    """Bytes a kernel reads: a loop (elementwise) fusion reads at most as many
    elements of an operand as it writes (a slice of a bucket buffer, not all of it)."""
    if "kind=kLoop" not in self.attrs.get(i.name, ""):
      return self.operand_bytes(i)
    out = _nbytes(i.shape)
    return sum(min(_nbytes(self.shape.get(o, "")), out) for o in i.operands)

  def find_heavy(self, i: Instr, seen=()) -> tuple[Instr, str] | None:
    """The dot/conv (itself, or inside its fused computation) and its computation."""
    if i.op in ("dot", "convolution") or (i.op == "custom-call" and i.is_heavy and not i.calls):
      return i, ""
    for c in i.calls:
      if c in seen:
        continue
      for j in self.hlo.computations.get(c, ()):
        if j.is_heavy:
          found = self.find_heavy(j, (*seen, c))
          if found:
            return found
    return None

  def flops(self, i: Instr) -> tuple[float, str]:
    """(FLOPs, dtype) of a GEMM/conv kernel."""
    found = self.find_heavy(i)
    if found is None:
      return 0.0, "f32"
    h, _ = found
    dt, out = _first(h.shape)
    ops = [_first(self.shape.get(o, "")) for o in h.operands[:2]]
    if len(ops) < 2:
      return 0.0, dt
    (ldt, lhs), (_, rhs) = ops
    line = self.attrs.get(h.name, "")
    if h.kind == "conv":
      m = _DIM_LABELS.search(line)
      o = m.group(1).find("o") if m else -1
      feat = rhs[o] if 0 <= o < len(rhs) else (rhs[-1] if rhs else 1)
      g = _GROUPS.search(line)
      per = math.prod(rhs) / max(feat, 1) / (int(g.group(1)) if g else 1)
      return 2.0 * math.prod(out) * per, ldt
    m = _CONTRACT.search(line)
    if m:
      dims = [int(d.strip('" ')) for d in (m.group(1) or m.group(2) or "").split(",") if d.strip()]
      k = math.prod(lhs[d] for d in dims if d < len(lhs))
    else:  # no dimension numbers printed: assume no batch dims
      k = math.sqrt(max(math.prod(lhs) * math.prod(rhs) / max(math.prod(out), 1), 1))
    return 2.0 * math.prod(out) * k, ldt

  def group_size(self, i: Instr, n: int) -> int:
    line = self.attrs.get(i.name, "")
    mesh = _MESH_GROUPS.search(line)
    if mesh:  # replica_groups=mesh['data'=8, 'model'=2] {'data'}: the named axes' sizes
      sizes = dict(re.findall(r"'([^']*)'=(\d+)", mesh.group(1)))
      axes = re.findall(r"'([^']*)'", mesh.group(2))
      return math.prod(int(sizes.get(a, 1)) for a in axes) if axes else n
    m = _REPLICA.search(line)
    if not m:
      return n
    if m.group(2):  # iota form [groups, size]<=[...]
      return int(m.group(3))
    return len([x for x in m.group(1).strip("{}").split(",") if x])

  def trips(self, i: Instr) -> int:
    m = _TRIPS.search(self.attrs.get(i.name, ""))
    return int(m.group(1)) if m else 1


@dataclasses.dataclass
class _State:
  t: float = 0.0  # compute stream clock
  link: LinkQueue = dataclasses.field(default_factory=lambda: LinkQueue(None))
  compute: float = 0.0
  kernels: int = 0
  open: dict = dataclasses.field(default_factory=dict)  # start name -> index in transfers
  transfers: list = dataclasses.field(default_factory=list)


class _Replayer:
  def __init__(self, mod: _Module, n: int, link: Link, spec: DeviceSpec, measured, cal=None):
    self.mod, self.n, self.link, self.spec = mod, n, link, spec
    self.measured = dict(measured or {})
    self.scale = dict(cal.kernel_scale) if cal is not None else {}
    self.launch = spec.launch if cal is None or cal.launch_seconds is None else cal.launch_seconds
    self.seen: list | None = None  # (name, heavy, work seconds) per kernel, for `kernel_work`

  def work(self, i: Instr) -> float:
    """The roofline's seconds of one kernel, launch left out."""
    s = self.spec
    nbytes = self.mod.read_bytes(i) + _nbytes(i.shape)
    if i.is_heavy:
      flops, dt = self.mod.flops(i)
      peak = s.matmul_flops_16 if _BYTES.get(dt, 4) <= 2 else s.matmul_flops
    else:
      flops, peak = float(math.prod(_first(i.shape)[1])), s.vector_flops
    return max(flops / peak, nbytes / s.bandwidth)

  def kernel_seconds(self, i: Instr) -> float:
    if self.seen is not None:
      self.seen.append((i.name, i.is_heavy, self.work(i)))
    # A profiler names a kernel after its instruction, '.' written as '_'.
    for key in (i.name, i.name.replace(".", "_")):
      if key in self.measured:
        return self.measured[key]
    scale = self.scale.get("gemm" if i.is_heavy else "other", 1.0)
    return self.launch + scale * self.work(i)

  def run(self, comp: str, st: _State, depth: int = 0) -> None:
    for i in self.mod.hlo.computations.get(comp, ()):
      self.step(i, st, depth)

  def _issue(self, i: Instr, kind: str, st: _State) -> int:
    ins = self.mod.operand_bytes(i)
    out = _nbytes(i.shape) - (ins if i.op.endswith("-start") else 0)  # a start holds both
    # Bytes of the unsharded array: reduce-scatter's input, all-gather's output.
    nbytes = ins if kind == "reduce-scatter" else max(out, ins if kind != "all-gather" else 0)
    sec = collective_seconds(kind, nbytes, self.mod.group_size(i, self.n), self.link)
    issue = st.t
    st.t, start, end = st.link.start(st.t, sec)
    st.transfers.append(Transfer(i.name, kind, nbytes, issue, start, end, end))
    return len(st.transfers) - 1

  def _wait(self, k: int, st: _State) -> None:
    tr = st.transfers[k]
    st.transfers[k] = dataclasses.replace(tr, wait=st.t)
    st.t = st.link.done(st.t, tr.end)

  def step(self, i: Instr, st: _State, depth: int) -> None:
    op = i.op
    if i.kind == "trivial":
      return
    if op in _ASYNC_COLLECTIVE or (op == "async-start" and self._wrapped(i)):
      kind = op[: -len("-start")] if op != "async-start" else self._wrapped(i)
      st.open[i.name] = self._issue(i, kind, st)
      return
    if i.kind == "done" and i.operands and i.operands[0] in st.open:
      self._wait(st.open.pop(i.operands[0]), st)
      return
    if op in COLLECTIVE_OPS:  # synchronous: queued on the link, waited at once
      self._wait(self._issue(i, i.sync_of or op, st), st)
      return
    if i.kind in ("start", "done"):
      if op == "call-start" and depth < 8:  # side-stream call: priced in line
        for c in i.calls:
          self.run(c, st, depth + 1)
      return
    if op == "while" and depth < 8:
      for _ in range(self.mod.trips(i)):
        for c in i.calls:  # condition, then body (both per trip)
          self.run(c, st, depth + 1)
      return
    if op == "call" and depth < 8:
      for c in i.calls:
        self.run(c, st, depth + 1)
      return
    if op == "conditional" and depth < 8 and i.calls:
      self._dearest(i, st, depth)
      return
    sec = self.kernel_seconds(i)
    st.t += sec
    st.compute += sec
    st.kernels += 1

  def _wrapped(self, i: Instr) -> str:
    for c in i.calls:
      body = [j for j in self.mod.hlo.computations.get(c, ()) if j.kind != "trivial"]
      if body and body[-1].op in COLLECTIVE_OPS:
        return body[-1].op
    return ""

  def _dearest(self, i: Instr, st: _State, depth: int) -> None:
    best = None
    for c in i.calls:
      trial = dataclasses.replace(
        st, open=dict(st.open), transfers=list(st.transfers), link=st.link.copy()
      )
      self.run(c, trial, depth + 1)
      if best is None or trial.t > best.t:
        best = trial
    for f in dataclasses.fields(st):
      setattr(st, f.name, getattr(best, f.name))


def replay(
  hlo: str,
  n_devices: int,
  link: str | Link = "nvlink",
  device: str | DeviceSpec = "H100",
  measured: Mapping[str, float] | None = None,
  calibration=None,
  in_flight: int | None = None,
) -> Replay:
  """Replays the entry computation of a scheduled HLO module (text).

  Args:
    hlo: `compiled.as_text()` of a compile-only GPU program.
    n_devices: devices a collective spans when its replica groups are not printed.
    link: a name in `REPLAY_LINKS` ("nvlink", "IB400", "IB100", "25GbE", ...) or a `Link`.
    device: a `passes.cost` device spec ("H100") for the roofline.
    measured: seconds per instruction (or kernel) name, timed on a GPU: replace
      the roofline (`benchmarks.dp_calibrate` records them).
    calibration: a `passes.calibration.Calibration` with `kernel_scale` /
      `launch_seconds`: each other kernel costs `launch_seconds + scale[class] *
      roofline work` (`benchmarks.dp_calibrate --fit` writes one; None: the roofline).
    in_flight: collectives allowed started and not done at once; a start beyond them
      forces the oldest one's done (`passes.simulate.LinkQueue`, the rule the data-parallel
      planner prices with). None (default): as printed, the compiled order holds XLA's.

  Returns:
    A `Replay`: `compute`, `comm`, `exposed`, `step` in seconds and each transfer.
  """
  if n_devices < 1:
    raise ValueError(f"n_devices must be >= 1, got {n_devices!r}")
  mod = _Module(hlo)
  if not mod.hlo.entry_name:
    raise ValueError("replay needs an HLO module with an ENTRY computation (compiled.as_text())")
  lk, spec = get_link(link), get_spec(device)
  st = _State(link=LinkQueue(in_flight))
  _Replayer(mod, n_devices, lk, spec, measured, calibration).run(mod.hlo.entry_name, st)
  open_end = max((st.transfers[k].end for k in st.open.values()), default=0.0)
  comm = sum(t.end - t.start for t in st.transfers)
  return Replay(
    st.compute, comm, max(st.t, open_end), tuple(st.transfers), st.kernels, lk.name, n_devices
  )


def kernel_work(hlo: str, device: str | DeviceSpec = "H100") -> list[tuple[str, bool, float]]:
  """`(instruction name, GEMM/conv?, roofline work seconds)` per kernel the entry runs, in
  replay order (loops once per trip): what `benchmarks.dp_calibrate --fit` fits against."""
  mod = _Module(hlo)
  r = _Replayer(mod, 1, get_link("nvlink"), get_spec(device), None)
  r.seen = []
  r.run(mod.hlo.entry_name, _State())
  return r.seen
