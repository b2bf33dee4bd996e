"""scan.skew: one scan whose step i computes B(i) and W(i-1) side by side.

Contract: `skewed_scan(b_eqn, w_eqns, invals, stream=1) -> {outvar: value}`
evaluates a B-scan and its W-scans (from `passes.scan.split`) as ONE scan in
the current trace; `fuse(split, sched) -> (split, sched)` rewrites a split and
its schedule so that `passes.emit` emits every split backward scan that way.

After `scan_split`, the W-scans can only start once the whole B-scan has
finished, so in a scan over layers nothing overlaps the dW work. Skewing
restores the overlap the paper gets between layers: step i of the loop runs
B on layer i and W on layer i-1 (whose residuals B produced one step before
and which ride in the carry), the W part wrapped in a stream-annotated call
(`_compat.on_stream`) so XLA GPU runs it on a second stream beside the dX
work. A prologue runs B on the first layer alone and an epilogue W on the
last. Residuals are carried one step instead of stacked over all layers, so
the skewed scan also gives back the B/W split's extra memory. Its outputs are
exactly the B-scan's and W-scans' outputs (the same variables).

`ooo.grad(..., mode="single_gpu")` emits it; `tests/test_scan.py` checks the
compiled loop body on CPU and on a compile-only H100.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ooojax.passes import _compat
from ooojax.passes.cost import CostModel
from ooojax.passes.ir import Action, Kind, Schedule, Split, Unit, UnitKind
from ooojax.passes.simulate import simulate


@dataclasses.dataclass(frozen=True)
class _Body:
  """A scan equation's body as a function of (consts, carries, x slices)."""

  eqn: Any

  @property
  def p(self) -> _compat.ScanInfo:
    return _compat.scan_info(self.eqn)

  def split_in(self, vals):
    return self.p.split_in(vals)

  def __call__(self, consts, carries, xs):
    j = self.p.body
    outs = _compat.eval_jaxpr(j.jaxpr, j.consts, *consts, *carries, *xs)  # vma casts in DP
    return self.p.split_out(outs)


def _at(x, i):
  return jax.lax.index_in_dim(x, i, 0, keepdims=False)


def _then_ys(unpack, fn):
  """`unpack` (bufs -> (carries, ys)) with `fn` applied to its ys."""

  def run(bufs):
    k, ys = unpack(bufs)
    return k, fn(ys)

  return run


def skewed_scan(
  b_eqn,
  w_eqns: Sequence[Any],
  read: Callable[[Any], Any],
  stream: int | None = 1,
  pin: bool = True,
  reduce_ys=None,
) -> dict:
  """Runs a B-scan and its W-scans as one skewed scan; returns {outvar: value}.

  `reduce_ys(w_eqns, ys, in_loop) -> ys`, if given, is applied to each
  layer's W ys (one list per W-scan) where they are made: in the loop body,
  or after it for the last layer (`in_loop=False`). The data-parallel mode
  all-reduces the per-layer dW slices there (`passes.collectives.loops`).

  Args:
    b_eqn: the B-scan equation (`ScanSplit.b_eqn`).
    w_eqns: W-scan equations reading the B-scan's residual outputs.
    read: maps an outer input atom (Var or Literal) to its value.
    stream: the GPU stream the W part runs on inside the loop (a
      stream-annotated call); None runs it inline.
    pin: pin the call's window to B's work in each step by data (as
      `passes.emit` does for unrolled layers): XLA:GPU keeps W(i-1)'s start
      before B(i) and its done after B(i)'s dX carry (the carried residuals
      are written after that carry too, see `body`).
  """
  B = _Body(b_eqn)
  Ws = [_Body(e) for e in w_eqns]
  length, reverse = B.p.length, B.p.reverse
  for w in Ws:
    if w.p.length != length or w.p.reverse != reverse:
      raise ValueError("a W-scan must run over the B-scan's length and direction")
  b_c, b_k, b_x = B.split_in([read(v) for v in b_eqn.invars])
  nbk = len(b_k)
  n_res = len(b_eqn.outvars) - nbk - _n_b_ys(b_eqn, w_eqns)
  res_vars = list(b_eqn.outvars[len(b_eqn.outvars) - n_res :])
  res_pos = {v: i for i, v in enumerate(res_vars)}
  is_res = lambda a: isinstance(a, _compat.Var) and a in res_pos
  # Per W: its consts, accumulator inits, plain xs, and which residuals it reads.
  w_in = []
  for w in Ws:
    c, k, xs_atoms = w.split_in(list(w.eqn.invars))
    xs_plain = [a for a in xs_atoms if not is_res(a)]
    w_in.append(
      (
        [read(a) for a in c],
        [read(a) for a in k],
        [read(a) for a in xs_plain],
        [res_pos[a] for a in xs_atoms if is_res(a)],
        len(xs_plain),
      )
    )

  first = length - 1 if reverse else 0
  last = 0 if reverse else length - 1

  def run_w(i_w, consts, carries, plain_xs, res):
    _, _, _, which, _ = w_in[i_w]
    return Ws[i_w](consts, carries, plain_xs + [res[r] for r in which])

  def w_call(w_carries, w_xs, res):
    """Issues W; returns (call operands, flat results, unpack -> (carries, ys))."""

    def f(*flat):
      it = iter(flat)
      cs = [[next(it) for _ in w_in[i][1]] for i in range(len(Ws))]
      xs = [[next(it) for _ in range(w_in[i][4])] for i in range(len(Ws))]
      r = [next(it) for _ in range(n_res)]
      outs = []
      for i in range(len(Ws)):
        k_out, ys = run_w(i, w_in[i][0], cs[i], xs[i], r)
        outs += k_out + ys
      return tuple(outs)

    def split(outs):
      it = iter(outs)
      k_out, ys = [], []
      for i, w in enumerate(Ws):
        k_out.append([next(it) for _ in w_in[i][1]])
        ys.append([next(it) for _ in range(len(w.eqn.outvars) - len(w_in[i][1]))])
      return k_out, ys

    flat = [x for c in w_carries for x in c] + [x for xs in w_xs for x in xs] + list(res)
    n_out = sum(len(w.eqn.outvars) for w in Ws)
    if stream is None or n_out == 0:
      return flat, None, lambda _: split(f(*flat))
    if _compat.sharded_over_mesh([jax.typeof(x) for x in flat]):
      # Explicit sharding: operands and results as they are (see passes.stream_calls)
      bufs = _compat.on_stream(f, stream, n_out)(*flat)
      return flat, list(bufs), lambda b: split(list(b))
    # As in passes.stream_calls: operands in flat, one flat buffer per dtype out, so
    # layout changes happen inside the call and the done's only user is the
    # barrier that ties it to B's dX work (see `body`).
    in_shapes = [jnp.shape(x) for x in flat]
    operands = [x.reshape(-1) if len(sh) >= 2 else x for x, sh in zip(flat, in_shapes)]
    meta = []

    def flat_f(*a):
      o = f(*[x.reshape(sh) if len(sh) >= 2 else x for x, sh in zip(a, in_shapes)])
      dtypes = list(dict.fromkeys(x.dtype for x in o))
      meta[:] = [(x.shape, dtypes.index(x.dtype)) for x in o]
      parts = [[x.reshape(-1) for x in o if x.dtype == d] for d in dtypes]
      return tuple(p[0] if len(p) == 1 else jnp.concatenate(p) for p in parts)

    n_bufs = len({jnp.result_type(v.aval.dtype) for w in Ws for v in w.eqn.outvars})
    bufs = _compat.on_stream(flat_f, stream, n_bufs)(*operands)

    def unpack(bufs):
      offset = [0] * len(bufs)
      outs = []
      for sh, i in meta:
        n = int(np.prod(sh))
        outs.append(bufs[i][offset[i] : offset[i] + n].reshape(sh))
        offset[i] += n
      return split(outs)

    return operands, list(bufs), unpack

  def w_step(w_carries, w_xs, res):
    _, bufs, unpack = w_call(w_carries, w_xs, res)
    return unpack(bufs)

  # Prologue: B on the first position.
  bk, b_out = B(b_c, b_k, [_at(x, first) for x in b_x])
  n_bys = len(b_out) - n_res
  b_ys0, res0 = b_out[:n_bys], b_out[n_bys:]
  w_k = [list(k) for _, k, _, _, _ in w_in]

  b_rest = [
    jax.lax.slice_in_dim(x, 0 if reverse else 1, length - 1 if reverse else length) for x in b_x
  ]
  w_rest = [
    [jax.lax.slice_in_dim(x, 1 if reverse else 0, length if reverse else length - 1) for x in plain]
    for _, _, plain, _, _ in w_in
  ]

  if length > 1:

    def body(carry, xs):
      bk, wk, res = carry
      bx, wx = xs
      ops, bufs, unpack = w_call(wk, wx, res)  # W(i-1), beside B(i) on the side stream
      if reduce_ys is not None:  # data parallel: W(i-1)'s dW slices reduced in this step
        unpack = _then_ys(unpack, lambda ys: reduce_ys(w_eqns, ys, True))
      if bufs is not None and pin:
        # B(i) may not start before W's operands are ready (the start goes first)...
        _, (bk, bx) = jax.lax.optimization_barrier((ops, (list(bk), list(bx))))
      nbk_, b_out = B(b_c, bk, bx)  # B(i): the dX chain
      if bufs is not None and pin:
        # ...and W's done may not come before B(i)'s dX carry (tied twice: XLA
        # drops an unused barrier element whose only user is the barrier).
        # The new residuals are written into their carry slots only after that
        # anchor too: XLA's loop-schedule-linearizer orders every reader of a
        # carried value (W(i-1)'s call, its done included) before the
        # instruction that defines the slot's next value, so a residual B(i)
        # defines before its dX GEMM would pull W(i-1)'s done in front of it.
        # The barrier also keeps XLA from fusing the rewrite into B's kernels.
        anchor = list(nbk_) or list(b_out)
        late, res_new = jnp.array(True), list(b_out[n_bys:])
        for _ in range(2):
          (bufs, late, res_new), _ = jax.lax.optimization_barrier(((bufs, late, res_new), anchor))
        res_new = [_rewrite(r, late) for r in res_new]
      else:
        res_new = b_out[n_bys:]
      nwk, w_ys = unpack(bufs)
      return (nbk_, nwk, res_new), (b_out[:n_bys], w_ys)

    (bk, w_k, res_last), (b_ys_rest, w_ys_rest) = jax.lax.scan(
      body, (bk, w_k, res0), (b_rest, w_rest), reverse=reverse, unroll=B.p.unroll
    )
  else:
    res_last, b_ys_rest, w_ys_rest = res0, [], [[] for _ in Ws]

  # Epilogue: W on the last position.
  w_last = [[_at(x, last) for x in plain] for _, _, plain, _, _ in w_in]
  w_k, w_ys_last = w_step(w_k, w_last, res_last)
  w_ys_last = w_ys_last if reduce_ys is None else reduce_ys(w_eqns, w_ys_last, False)

  def stack(one, many, one_first):
    one = jnp.expand_dims(one, 0)
    if length == 1:
      return one
    return jnp.concatenate([one, many] if one_first else [many, one], axis=0)

  out: dict = {}
  for v, x in zip(b_eqn.outvars[:nbk], bk):
    out[v] = x
  b_ys_vars = b_eqn.outvars[nbk : nbk + n_bys]
  for j, v in enumerate(b_ys_vars):
    out[v] = stack(b_ys0[j], b_ys_rest[j] if length > 1 else None, not reverse)
  for i, w in enumerate(Ws):
    nk = len(w_in[i][1])
    for v, x in zip(w.eqn.outvars[:nk], w_k[i]):
      out[v] = x
    for j, v in enumerate(w.eqn.outvars[nk:]):
      out[v] = stack(w_ys_last[i][j], w_ys_rest[i][j] if length > 1 else None, reverse)
  return {v: x for v, x in out.items() if not isinstance(v, _compat.DropVar)}


def _rewrite(x, late):
  """`x`, copied by an elementwise op that runs no earlier than `late` (a True).

  The select defines a new value (a reshape or a barrier would not), so it is
  what XLA sees writing the loop carry; `late` comes out of a barrier, so no
  simplifier folds it away. One read and one write of `x` per loop step.
  """
  return jax.lax.select(jnp.broadcast_to(late, jnp.shape(x)), x, jnp.zeros_like(x))


def _n_b_ys(b_eqn, w_eqns) -> int:
  """How many of the B-scan's ys are its own (the rest are residuals for W)."""
  read = {v for e in w_eqns for v in e.invars if isinstance(v, _compat.Var)}
  ys = b_eqn.outvars[_compat.scan_info(b_eqn).num_carry :]
  n = len(ys)
  while n and ys[n - 1] in read:
    n -= 1
  return n


# --- fusing into a schedule for emission ---------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class SkewedScan:
  """The fused equation's primitive: `emit` binds it like any other.

  It holds what it fuses itself (the equation's params stay empty: only JAX's
  primitives have params, read in `passes._compat`).
  """

  b_eqn: Any
  w_eqns: tuple
  stream: int | None = 1
  pin: bool = True
  reduce_ys: Callable | None = None
  name = "skewed_scan"
  multiple_results = True

  @property
  def length(self) -> int:
    return _compat.scan_info(self.b_eqn).length

  def get_bind_params(self, params):
    return params

  def bind(self, *args):
    env = dict(zip(_fused_inputs(self.b_eqn, self.w_eqns), args))
    read = lambda a: env[a] if isinstance(a, _compat.Var) else a.val  # noqa: E731
    out = skewed_scan(self.b_eqn, self.w_eqns, read, self.stream, self.pin, self.reduce_ys)
    return [out[v] for v in _fused_outputs(self.b_eqn, self.w_eqns)]


def _fused_inputs(b_eqn, w_eqns):
  res = set(b_eqn.outvars)
  ins = [a for a in b_eqn.invars if isinstance(a, _compat.Var)]
  ins += [a for e in w_eqns for a in e.invars if isinstance(a, _compat.Var) and a not in res]
  return list(dict.fromkeys(ins))


def _fused_outputs(b_eqn, w_eqns):
  n_res = len(b_eqn.outvars) - _compat.scan_info(b_eqn).num_carry - _n_b_ys(b_eqn, w_eqns)
  outs = list(b_eqn.outvars[: len(b_eqn.outvars) - n_res])
  outs += [v for e in w_eqns for v in e.outvars]
  return [v for v in outs if not isinstance(v, _compat.DropVar)]


def fuse(
  split: Split, sched: Schedule, stream: int | None = 1, pin: bool = True, reduce_ys=None
) -> tuple[Split, Schedule]:
  """Replaces each split backward scan (a dX B-scan and its dW W-scans) by one skewed scan.

  `stream` is where the W part of each step runs (None: inline, one stream);
  `reduce_ys` is passed to `skewed_scan`.

  The fused equation takes the B-scan's place (its unit on the dX chain);
  the W-scans leave their dW units, and a unit left with no equations leaves
  the schedule. Returns the split and schedule unchanged when nothing fuses.
  """
  eqns = list(split.jaxpr.jaxpr.eqns)
  if not any(e.primitive.name == "scan" and split.kinds[k] is Kind.DX for k, e in enumerate(eqns)):
    return split, sched  # no B-scan: skip building the producer map
  producer = {v: k for k, e in enumerate(eqns) for v in e.outvars}
  fused_w: set[int] = set()
  changed = False
  for k, e in enumerate(eqns):
    if e.primitive.name != "scan" or split.kinds[k] is not Kind.DX:
      continue
    nk = _compat.scan_info(e).num_carry
    outs = set(e.outvars[nk:])
    ws = [
      j
      for j, w in enumerate(eqns)
      if j > k
      and not isinstance(w.primitive, SkewedScan)
      and w.primitive.name == "scan"
      and split.kinds[j] is Kind.DW
      and any(isinstance(v, _compat.Var) and v in outs for v in w.invars)
      and all(
        producer.get(v, -1) < k or producer.get(v) == k
        for v in w.invars
        if isinstance(v, _compat.Var)
      )
    ]
    if not ws or _n_b_ys(e, [eqns[j] for j in ws]) + nk == len(e.outvars):
      continue
    w_eqns = tuple(eqns[j] for j in ws)
    # Every residual must go to the fused W-scans only.
    res = e.outvars[nk + _n_b_ys(e, w_eqns) :]
    res_set = set(res)
    users = {
      j for j, u in enumerate(eqns) for v in u.invars if isinstance(v, _compat.Var) and v in res_set
    }
    if not users <= set(ws):
      continue
    eqns[k] = e.replace(
      primitive=SkewedScan(e, w_eqns, stream, pin, reduce_ys),
      params={},
      invars=_fused_inputs(e, w_eqns),
      outvars=_fused_outputs(e, w_eqns),
    )
    fused_w.update(ws)
    changed = True
  if not changed:
    return split, sched
  jaxpr = split.jaxpr.jaxpr.replace(eqns=eqns)
  new_split = dataclasses.replace(split, jaxpr=_compat.closed(jaxpr, split.jaxpr.consts))
  units = tuple(
    dataclasses.replace(u, eqns=tuple(i for i in u.eqns if i not in fused_w)) for u in sched.units
  )
  empty = {u.name for u in units if not u.eqns and u.kind.value == "W"}
  streams = tuple(tuple(a for a in s if a.unit not in empty) for s in sched.streams)
  calls = tuple(
    dataclasses.replace(c, units=kept)
    for c in sched.calls
    if (kept := tuple(u for u in c.units if u not in empty))
  )
  return new_split, dataclasses.replace(sched, units=units, streams=streams, calls=calls)


def predict(split: Split, cost: CostModel) -> tuple[float, float]:
  """(in-order, skewed) seconds of the split backward scans: cost-model estimates.

  Each B-scan trip and the trip of its W-scans for the previous layer run as
  two concurrent units on `passes.simulate`'s processor-sharing model, plus a
  cross-stream sync per trip; a prologue B and an epilogue W run alone.
  Returns (0, 0) when the split has no split backward scan.
  """
  eqns = split.jaxpr.jaxpr.eqns
  spec = cost.spec
  io = sk = 0.0
  for k, e in enumerate(eqns):
    if e.primitive.name != "scan" or split.kinds[k] is not Kind.DX:
      continue
    info = _compat.scan_info(e)
    outs = set(e.outvars[info.num_carry :])
    ws = [
      w
      for j, w in enumerate(eqns)
      if j > k
      and w.primitive.name == "scan"
      and split.kinds[j] is Kind.DW
      and any(isinstance(v, _compat.Var) and v in outs for v in w.invars)
    ]
    if not ws:
      continue
    n = float(info.length)
    cb, cw = cost.unit_cost([e]), cost.unit_cost(ws)
    tb, tw = cb.seconds / n, cw.seconds / n
    units = [Unit(UnitKind.DX, 0, (), (), tb, cb.util), Unit(UnitKind.DW, 0, (), (), tw, cw.util)]
    pair = simulate([[Action("X", 0, 0)], [Action("W", 0, 1)]], units, 0.0).makespan
    io += n * (tb + tw)
    sk += tb + (n - 1) * (pair + spec.sync) + tw
  return io, sk
