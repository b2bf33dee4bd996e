"""`ooo.explain`: what was split and how it was scheduled, for people."""

from __future__ import annotations

import dataclasses

from ooojax._report import LoopRow, Report
from ooojax.passes.cost import CostModel

__all__ = ["LoopRow", "Report", "explain"]


def explain(fun, *args, argnums=0, has_aux=False, **options):
  """Splits and schedules `fun` at `args` without running it.

  Takes `ooo.grad`'s arguments and options (`kwargs={...}` for `fun`'s keyword
  arguments) and returns a `Report`. With `mode="data_parallel"` (and
  `axis_name`) it returns a `DataParallelReport` instead: `args` are one
  device's shard, `axis_size=N` gives the number of devices outside
  `pmap` / `shard_map`, `cross_step=True` chooses k as
  `ooojax.data_parallel.make_train_step` does. Pipelines:
  `ooo.pipeline.explain`. With `defer="auto" | paths | predicate` (as
  `ooojax.single_gpu.make_train_step` takes it; `fun(params, batch)`) the
  report also says what the deferred train step carries to the next step
  (`Report.carried`).

  >>> import jax.numpy as jnp, ooojax as ooo
  >>> r = ooo.explain(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((3, 2)), jnp.ones((4, 3)))
  >>> r.counts["DW"] > 0
  True
  >>> d = ooo.explain(lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]) * p["s"]),
  ...                 {"w": jnp.ones((3, 2)), "s": jnp.ones(2)}, jnp.ones((4, 3)),
  ...                 mode="data_parallel", axis_name="batch", axis_size=8, bucket_bytes=1)
  >>> [b.paths for b in d.buckets]
  [("['w']",), ("['s']",)]
  >>> c = ooo.explain(lambda p, x: jnp.mean((jnp.tanh(x @ p["a"]) @ p["b"]) ** 2),
  ...                 {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 2))}, jnp.ones((8, 3)),
  ...                 defer=("b",)).carried
  >>> c.deferred_paths, c.carried_bytes        # b's input activation and output cotangent
  (("['b']",), 192)

  What users hold is taken as it is: an nnx module or a `(graphdef, state)`
  pair as the differentiated argument (its non-float leaves, such as RNG keys,
  are not differentiated), and a loss that names a mesh axis (synchronised
  BatchNorm outside `pmap`) with `mesh=` (a `Mesh`, `AbstractMesh` or
  `{name: size}`) and `axis_name=`: the loss is traced with the axis bound,
  shapes only. In data-parallel mode `axis_name` and `axis_size` bind it.

  Data parallel as a sharded-jit (GSPMD) user holds it: `mode="data_parallel",
  mesh=mesh` takes the axis size from the mesh and the data axis from
  `axis_name=` or else from the batch's own sharding (the mesh axis its
  leading dimension is split over); such a batch is the global one, explained
  as one device's shard of it.
  """
  from ooojax import _explain_inputs as inputs

  kwargs = options.pop("kwargs", {})
  mesh = options.pop("mesh", None)
  mode = options.get("mode", "auto")
  axes = inputs.mesh_axes(mesh) if mesh is not None else {}
  bound = None
  if mode == "data_parallel" and mesh is not None and "axis_size" not in options:
    # as a GSPMD user holds it: the data axis named, or found from the batch's sharding
    from ooojax._api import _check_argnums, _resolve_argnums

    idx = _resolve_argnums(_check_argnums(argnums), len(args))
    name = options["axis_name"] = inputs.data_axis(args, idx, axes, options.get("axis_name"))
    options["axis_size"] = axes[name]
    args = inputs.local_args(tuple(args), idx, name, axes[name])
  elif mode == "data_parallel":
    name = options.get("axis_name")
    if name is not None and name in axes and "axis_size" not in options:
      options["axis_size"] = axes[name]
    elif name is not None and _explain_dp_size_ok(options.get("axis_size")):
      axes.setdefault(name, options["axis_size"])  # bound while tracing (sync BatchNorm)
  if mode == "data_parallel" and options.get("axis_name") is not None:
    # traced as one device's shard, as the step runs it: constraints on the data axis
    # (flax's nn.with_partitioning boxes unboxing) dropped there (`_dp_gspmd._in_shard`)
    from ooojax import _dp_gspmd
    from ooojax.passes import _compat

    fun = _dp_gspmd._in_shard(fun, options["axis_name"], _compat.context_mesh() is not None)
  elif mode != "data_parallel" and "axis_name" in options:
    # outside data_parallel, axis_name= names the axis the loss reads (bound from mesh=)
    bound = options.pop("axis_name")
    if bound not in axes:
      raise ValueError(
        f"axis_name={bound!r} outside mode='data_parallel' names the mesh axis the loss "
        f"reads; pass mesh= with that axis too, e.g. ooo.explain(loss, params, batch, "
        f"mesh=jax.make_mesh((8,), ({bound!r},)), axis_name={bound!r})"
        if mesh is None
        else f"axis_name={bound!r} is not an axis of mesh= ({list(axes)})"
      )
  from ooojax import _filter
  from ooojax._args import _check_argnums, _resolve_argnums

  idx = _resolve_argnums(_check_argnums(argnums), len(args))
  # an Equinox module is filtered by value_and_grad itself: its Python floats
  # (a max-pool's init, Dropout's p) stay static, as eqx.filter_value_and_grad
  moved = None
  if not any(_filter.holds_module(args[i]) for i in idx):
    moved = inputs.float_only(fun, tuple(args), idx, options.get("allow_int", False))
  if moved is not None:
    fun, args = moved.fun, moved.args

  def run():
    return _explain(fun, args, argnums, has_aux, options, kwargs)

  if mode == "data_parallel":  # the data axis's size is the plan: never guessed
    try:
      return inputs.run_bound(run, axes) if axes else run()
    except NameError as e:
      if inputs.unbound_name(e) is not None:
        raise inputs.unbound_axis_note(e, mode)  # noqa: B904 - the same error, a note added
      raise
  out, guessed = inputs.run_binding(run, axes)
  if guessed and hasattr(out, "notes"):
    out = dataclasses.replace(out, notes=(*out.notes, inputs.bound_note(guessed)))
  return out


def _explain_dp_size_ok(n) -> bool:
  # a bad axis_size is left to explain_dp's own error
  return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _explain(fun, args, argnums, has_aux, options, kwargs):
  from ooojax._api import value_and_grad
  from ooojax._compiled import Call
  from ooojax.data_parallel import _explain as _explain_dp

  defer = options.pop("defer", None)
  only = {k: options.pop(k) for k in _explain_dp.EXPLAIN_ONLY if k in options}
  if options.get("mode") == "data_parallel":
    if defer is not None:
      raise ValueError(
        "defer= explains the single-GPU deferred step; with mode="
        "'data_parallel' pass cross_step=True (the first-k layers' "
        "all-reduce and update carried to the next step) instead"
      )
    return _explain_dp.explain_dp(fun, args, argnums, has_aux, options, kwargs, **only)
  if only:
    raise ValueError(
      f"{sorted(only)} apply to mode='data_parallel' only (got mode="
      f"{options.get('mode', 'auto')!r})"
    )
  vg = value_and_grad(fun, argnums, has_aux, **options)
  plan, _ = vg.plan(args, kwargs)
  carried = None
  if defer is not None:
    from ooojax.single_gpu._defer_plan import plan_deferral

    if argnums != 0 or not args:
      raise ValueError(
        f"defer= explains single_gpu.make_train_step, which differentiates "
        f"the first argument (params): use argnums=0, got {argnums!r}"
      )
    carried = plan_deferral(
      plan, args[0], defer, CostModel(vg.options.device, vg.options.measured), has_aux
    )
  return Report(
    plan.split,
    plan.schedule,
    vg.options.resolved_mode(),
    Call(fun, args, argnums, has_aux, dict(options), dict(kwargs)),
    carried,
  )
