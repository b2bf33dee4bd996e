"""What one exchange between two processes costs on gloo (CPU collectives).

  python -m benchmarks.gloo_exchange              # 16 and 32 kB, 7 rounds

Two processes (`jax.distributed`, gloo over localhost TCP, one CPU device each,
pinned to cores 0 and 1), each timing loops of 100 ticks inside one jitted
`shard_map` program, per tick:

- `two-way`: one `ppermute` in which both processes send and receive
  (`[(0, 1), (1, 0)]`): what the pipeline executor did on every tick where an
  activation goes up while a gradient comes down;
- `one-way x2`: the same two transfers as two one-way permutes in a row (what
  it does on CPU now, `passes.pipeline.execute.one_way`);
- `ping-pong`: one one-way permute per tick, alternating direction;
- `one direction`: one one-way permute per tick, always 0 -> 1 (GPipe's runs);
- `work + ...`: the same after about 1.5 ms of matmuls per tick
  (the executor's tick: compute, then the send), and `work alone`;
- `work beside two-way`: the matmuls and a send that needs nothing they compute,
  in one tick: XLA:CPU runs them one after the other (on a shaped link the tick
  costs the sum; `--link-gbit 0.1`);
- `the same, 8 more thunks` (and `carries swapped`): the loop body padded past
  the 8 thunks under which XLA:CPU's ThunkExecutor runs a body in sequence, and
  with no buffer-reuse edge between the exchange and the work: still the sum.

Prints the median and min microseconds per tick over the rounds (issue 34).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

KBS = (8, 16, 32, 64)


def _worker(pid: int, port: int, rounds: int) -> None:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("stage",))
  T = 100

  def loop(tick):
    body = lambda x: lax.scan(lambda c, i: (tick(c, i), None), x, jnp.arange(T))[0]  # noqa: E731
    return jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"), check_vma=False)
    )

  def loop2(tick):  # carry (x, y): a tick's work on x beside its send of y
    def body(x):
      a, b = lax.scan(lambda c, i: (tick(*c, i), None), (x, x * 2), jnp.arange(T))[0]
      return b + a * 1e-30  # both carries live: XLA drops a carry nothing reads

    return jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"), check_vma=False)
    )

  up, down = [(0, 1)], [(1, 0)]
  wmat = jnp.full((512, 512), 1e-3, jnp.float32)

  def _work(c):  # about 1.5 ms of matmuls, then the same shape back
    # (seeded by the carry: a loop-invariant seed was hoisted out of the loop,
    # so the rows before 2026-11-26 20:50 timed about 16 us of work)
    y = lax.fori_loop(0, 8, lambda _, a: jnp.tanh(a @ wmat), jnp.ones((64, 512)) + c[0] * 1e-9)
    return c + jnp.sum(y) * 1e-9

  def padded(swap: bool):
    """`work beside two-way` with 8 small sorts on carries of their own: over 8
    thunks, XLA:CPU's ThunkExecutor runs the loop body as a graph, not in
    sequence. With `swap` the exchanged carries alternate, so buffer reuse adds
    no edge between the exchange and the work (TF_CPP_VMODULE=thunk_executor=6)."""

    def body(x):
      def step(c, i):
        a, b0, b1, pads = c
        a, got = _work(a), lax.ppermute(b0, "stage", up + down)
        pads = tuple(lax.sort(p + i.astype(p.dtype)) for p in pads)
        return ((a, b1, got, pads) if swap else (a, got, b1, pads)), None

      pads = tuple(jnp.arange(4.0) * k for k in range(8))
      a, b0, b1, pads = lax.scan(step, (x, x * 2, x * 3, pads), jnp.arange(T))[0]
      return b0 + b1 + a * 1e-30 + sum(jnp.sum(p) for p in pads) * 1e-30

    return jax.jit(
      jax.shard_map(body, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"), check_vma=False)
    )

  ticks = {
    "two-way": loop(lambda c, i: lax.ppermute(c, "stage", up + down)),
    "one-way x2": loop(
      lambda c, i: lax.ppermute(c, "stage", up) + lax.ppermute(c * 2, "stage", down)
    ),
    "ping-pong": loop(
      lambda c, i: lax.switch(
        i % 2,
        [lambda a: lax.ppermute(a, "stage", up), lambda a: lax.ppermute(a, "stage", down)],
        c,
      )
    ),
    # the same direction every tick (GPipe's forward run, its backward run)
    "one direction": loop(lambda c, i: lax.ppermute(c, "stage", up)),
    # each tick a stage's worth of compute first, then the send (the executor's tick)
    "work + ping-pong": loop(
      lambda c, i: lax.switch(
        i % 2,
        [lambda a: lax.ppermute(a, "stage", up), lambda a: lax.ppermute(a, "stage", down)],
        _work(c),
      )
    ),
    "work + one direction": loop(lambda c, i: lax.ppermute(_work(c), "stage", up)),
    "work alone": loop(lambda c, i: _work(c)),
    # the send of y needs nothing the work computes: does XLA:CPU run them at once?
    "work + two-way": loop(lambda c, i: lax.ppermute(_work(c), "stage", up + down)),
    "work beside two-way (independent)": loop2(
      lambda x, y, i: (_work(x), lax.ppermute(y, "stage", up + down))
    ),
    # over 8 thunks the body runs as a graph; swapped: no buffer edge either
    "the same, 8 more thunks": padded(swap=False),
    "the same, 8 more thunks, carries swapped": padded(swap=True),
  }
  res = {}
  for kb in KBS:
    n = kb * 256  # float32
    x = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("stage")), np.ones((n,), np.float32), (2 * n,)
    )
    for f in ticks.values():
      jax.block_until_ready(f(x))
    for _ in range(rounds):
      for k, f in ticks.items():
        multihost_utils.sync_global_devices("exchange")
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        res.setdefault((k, kb), []).append((time.perf_counter() - t0) / T * 1e6)
  if pid == 0:
    print("| per tick (us), median [min] | " + " | ".join(f"{kb} kB" for kb in KBS) + " |")
    print("|---" * (len(KBS) + 1) + "|")
    for k in ticks:
      cells = [f"{np.median(res[(k, kb)]):.0f} [{min(res[(k, kb)]):.0f}]" for kb in KBS]
      print(f"| {k} | " + " | ".join(cells) + " |")
  jax.distributed.shutdown()


def main(argv=None) -> None:
  import argparse

  from benchmarks.pipeline_mp import ROOT, free_port, worker_env

  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument(
    "--link-gbit",
    type=float,
    help="run both processes in a network namespace whose loopback is shaped to "
    "this many Gbit/s (root, unshare, tc; as benchmarks.pipeline_mp --link-gbit)",
  )
  ap.add_argument("--_worker", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--_port", type=int, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args._worker is not None:
    return _worker(args._worker, args._port, args.rounds)
  if args.link_gbit:  # both workers inside one shaped namespace (one tbf on lo)
    from benchmarks.pipeline_mp import tbf

    script = (
      f'ip link set lo mtu 1500 up && tc qdisc add dev lo root {tbf(args.link_gbit)} && exec "$@"'
    )
    inner = [sys.executable, "-m", "benchmarks.gloo_exchange", "--rounds", str(args.rounds)]
    subprocess.run(["unshare", "-n", "sh", "-c", script, "sh", *inner], cwd=ROOT, check=True)
    return
  port = free_port()
  cmd = lambda i: [  # noqa: E731
    "taskset",
    "-c",
    str(i % (os.cpu_count() or 1)),
    sys.executable,
    "-m",
    "benchmarks.gloo_exchange",
    "--rounds",
    str(args.rounds),
    "--_worker",
    str(i),
    "--_port",
    str(port),
  ]
  procs = [
    subprocess.Popen(cmd(i), cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, text=True)
    for i in range(2)
  ]
  out = [p.communicate(timeout=600)[0] for p in procs]
  print(out[0], end="")


if __name__ == "__main__":
  main()
