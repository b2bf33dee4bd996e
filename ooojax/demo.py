"""The demo: train a small flax CNN with jax.grad and with ooo.grad, side by side."""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ooojax as ooo


class SmallCNN(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    for feats in (16, 32, 64):
      x = nn.Conv(feats, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train)(x)
      x = nn.relu(x)
      x = nn.max_pool(x, (2, 2), (2, 2))
    x = x.mean(axis=(1, 2))
    return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))


def _data(batch: int):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((batch, 32, 32, 3)).astype(np.float32)
  y = rng.integers(0, 10, size=batch)
  x[np.arange(batch), :4, :4, 0] += y[:, None, None]  # a learnable signal
  return jnp.asarray(x), jnp.asarray(y)


def make_step(grad_fn, model, opt):
  def loss_fn(params, batch_stats, x, y):
    logits, upd = model.apply(
      {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (loss, upd["batch_stats"])

  @jax.jit
  def step(params, batch_stats, opt_state, x, y):
    grads, (loss, batch_stats) = grad_fn(loss_fn, has_aux=True)(params, batch_stats, x, y)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), batch_stats, opt_state, loss

  return step, loss_fn


def _time(step, state, x, y, n: int) -> float:
  out = step(*state, x, y)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(n):
    out = step(*state, x, y)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / n


def run(
  steps: int = 10,
  batch: int = 32,
  spec: str = "H100",
  plot: str | None = None,
  timing_reps: int = 5,
) -> dict:
  model = SmallCNN()
  x, y = _data(batch)
  v = model.init(jax.random.PRNGKey(0), x)
  opt = optax.sgd(0.05, momentum=0.9)
  base_step, loss_fn = make_step(jax.grad, model, opt)
  ooo_step, _ = make_step(ooo.grad, model, opt)

  states = {
    name: (v["params"], v["batch_stats"], opt.init(v["params"]))
    for name in ("jax.grad", "ooo.grad")
  }
  print(
    f"Training SmallCNN (batch {batch}, synthetic data) for {steps} steps "
    f"on {jax.devices()[0].device_kind} with jax {jax.__version__}"
  )
  print(f"{'step':>4}  {'jax.grad loss':>14}  {'ooo.grad loss':>14}")
  losses = {"jax.grad": [], "ooo.grad": []}
  for i in range(steps):
    for name, step in (("jax.grad", base_step), ("ooo.grad", ooo_step)):
      p, b, o, loss = step(*states[name], x, y)
      states[name] = (p, b, o)
      losses[name].append(float(loss))
    print(f"{i:4d}  {losses['jax.grad'][-1]:14.6f}  {losses['ooo.grad'][-1]:14.6f}")
  diff = max(abs(a - b) for a, b in zip(losses["jax.grad"], losses["ooo.grad"]))
  print(f"max |loss difference| over {steps} steps: {diff:.2e}")

  # The two-stream schedule ooo.grad(mode="single_gpu") would use on a `spec`
  # GPU (mode="auto" re-emits in order on CPUs, and on GPUs unless the calibrated
  # cost model predicts >= 1.03x: see `_options.AUTO_MODE`).
  report = ooo.explain(
    loss_fn, v["params"], v["batch_stats"], x, y, has_aux=True, device=spec, mode="single_gpu"
  )
  print()
  print(report.summary())
  # What XLA:GPU really schedules for it (a compile-only H100; no GPU needed).
  from ooojax import gpu_hlo

  reason = gpu_hlo.unavailable_reason() if spec in gpu_hlo.GPUS else f"no target config for {spec}"
  if reason is None:
    c = report.compiled(spec)
    k, n = c.heavy_overlap
    print(
      f"  compiled for a compile-only {spec}: {k} of {n} stream-1 calls holding a conv/GEMM "
      "have dX convs/GEMMs scheduled inside their window (python -m ooojax hlo for details)"
    )
  else:
    print(f"  (compiled {spec} schedule not shown: {reason})")
  print(
    "  (predictions: on the GPUs measured so far, an H100 and an H200 with jax 0.11.2, this "
    "two-stream step ran at 0.39-0.51x jax.grad's; priced as they measured, no call pays "
    "and mode='auto' runs in order: docs/guides/second-stream-on-gpu.md)"
  )

  # Measured, alternating baseline and ooojax in the same process.
  t = {"jax.grad": [], "ooo.grad": []}
  for _ in range(timing_reps):
    for name, step in (("jax.grad", base_step), ("ooo.grad", ooo_step)):
      t[name].append(_time(step, states[name], x, y, 5))
  med = {k: float(np.median(vs)) for k, vs in t.items()}
  auto = ooo.Options().resolved_mode()
  print(
    f"\nmeasured step time on this machine ({jax.devices()[0].device_kind}, "
    f"median of {timing_reps}): jax.grad {med['jax.grad'] * 1e3:.2f} ms, "
    f"ooo.grad {med['ooo.grad'] * 1e3:.2f} ms, ratio jax.grad/ooo.grad "
    f"{med['jax.grad'] / med['ooo.grad']:.3f}x (mode='auto' ran {auto!r} here)"
  )
  if plot:
    import matplotlib

    matplotlib.use("Agg")
    ax = report.plot()
    ax.figure.savefig(plot, dpi=120, bbox_inches="tight")
    print(f"Gantt chart of the {spec} schedule written to {plot}")
  return {"losses": losses, "report": report, "step_ms": med}
