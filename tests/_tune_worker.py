"""One process of the 2-process tune test (see test_pipeline_tune.py).

Usage: python tests/_tune_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.json
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402

pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)

import json  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ooojax as ooo  # noqa: E402


def loss(w, x, t):  # a small scan of layers: the trial's compiles stay short
  h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]
  return jnp.mean((h - t) ** 2)


mesh = jax.sharding.Mesh(np.array(jax.devices()), ("stage",))
rep = NamedSharding(mesh, P())
put = lambda a: jax.make_array_from_process_local_data(rep, np.asarray(a))  # noqa: E731
w = put(np.full((4, 8, 8), 0.1, np.float32))
x = put(np.linspace(-1, 1, 16 * 8, dtype=np.float32).reshape(16, 8))
t = put(np.zeros((16, 8), np.float32))
step = ooo.pipeline.make_train_step(
  loss, optax.sgd(0.1), mesh=mesh, axis_name="stage", microbatches=4
)
state = step.init(w, x, t)
step = step.tune(state, x, t, rounds=2)
state, l = step(state, x, t)
with open(out, "w") as f:
  json.dump({"label": step.tuning.label, "times": step.tuning.times, "loss": float(l)}, f)
jax.distributed.shutdown()
