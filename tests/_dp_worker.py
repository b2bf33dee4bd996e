"""One process of the 2-process data-parallel test (see test_data_parallel_multiprocess.py).

Usage: python tests/_dp_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz
The same script runs on a multi-host GPU cluster without the CPU lines:
`jax.distributed.initialize()` there reads the coordinator from the cluster
environment (SLURM, Open MPI, Kubernetes...) and each host sees its own GPUs.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402

pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ooojax import data_parallel as dp  # noqa: E402
from tests.test_data_parallel_train import make_problem  # noqa: E402

params, loss, xs = make_problem(len(jax.devices()))
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("batch",))
rep = NamedSharding(mesh, P())
params = jax.tree.map(lambda a: jax.make_array_from_process_local_data(rep, np.asarray(a)), params)
per = xs[0].shape[0] // nproc
batches = [
  jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("batch")), np.asarray(x[pid * per : (pid + 1) * per])
  )
  for x in xs
]
step = dp.make_train_step(loss, optax.adam(1e-2), mesh, first_k=2)
state = step.init(params, batches[0])
for b in batches:
  state, _ = step(state, b)
state = step.flush(state)
flat = {
  jax.tree_util.keystr(k): np.asarray(jax.device_get(v.addressable_data(0)))
  for k, v in jax.tree_util.tree_flatten_with_path(state.params)[0]
}
np.savez(out, **flat)
jax.distributed.shutdown()
