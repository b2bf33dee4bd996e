"""Compile-only GPU schedules: the HLO schedule parser and ooojax.gpu_hlo."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ooojax as ooo
from ooojax import gpu_hlo
from ooojax.passes.hlo import schedule as hlo_schedule

REASON = gpu_hlo.unavailable_reason()
needs_gpu_hlo = pytest.mark.skipif(REASON is not None, reason=f"compile-only GPU: {REASON}")

# A hand-written scheduled module: every pair kind, a while body, CPU-style
# fusions that hold a convolution / dot, and the newer operand printing style.
SNIPPET = r"""
HloModule m, is_scheduled=true

%wgrad (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  ROOT %cc = (f32[8,8]{1,0}, u8[0]{0}) custom-call(%a, %a), custom_call_target="__cudnn$convBackwardFilter"
}

%small (a: f32[8,8]) -> f32[8] {
  %a = f32[8,8]{1,0} parameter(0)
  ROOT %r = f32[8]{0} fusion(%a), kind=kInput, calls=%fused_reduce
}

%fused_reduce (p: f32[8,8]) -> f32[8] {
  %p = f32[8,8]{1,0} parameter(0)
  ROOT %red = f32[8]{0} reduce(%p), dimensions={0}, to_apply=%add
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%conv_body (p: f32[1,8,8,1], q: f32[3,3,1,1]) -> f32[1,8,8,1] {
  %p = f32[1,8,8,1]{3,2,1,0} parameter(0)
  %q = f32[3,3,1,1]{3,2,1,0} parameter(1)
  ROOT %convolution.1 = f32[1,8,8,1]{3,2,1,0} convolution(%p, %q), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
}

%wrapped_rs (w: f32[8,8]) -> f32[1,8] {
  %w = f32[8,8]{1,0} parameter(0)
  ROOT %rs = f32[1,8]{1,0} reduce-scatter(%w), dimensions={0}, to_apply=%add
}

%body (t: (f32[8,8], s32[])) -> (f32[8,8], s32[]) {
  %t = (f32[8,8]{1,0}, s32[]) parameter(0)
  %v = f32[8,8]{1,0} get-tuple-element(%t), index=0
  %ars = f32[8,8]{1,0} all-reduce-start(%v), to_apply=%add, metadata={op_name="jit(f)/while/body/psum"}
  %g2 = f32[8,8]{1,0} fusion(%v, %v), kind=kCustom, calls=%gemm_comp, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %ard = f32[8,8]{1,0} all-reduce-done(%ars)
  %i = s32[] get-tuple-element(%t), index=1
  ROOT %out = (f32[8,8]{1,0}, s32[]) tuple(%ard, %i)
}

%gemm_comp (a: f32[8,8], b: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %b = f32[8,8]{1,0} parameter(1)
  ROOT %dot.3 = f32[8,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p0: f32[8,8], p1: f32[1,8,8,1], p2: f32[3,3,1,1]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[1,8,8,1]{3,2,1,0} parameter(1)
  %p2 = f32[3,3,1,1]{3,2,1,0} parameter(2)
  %call-start = ((f32[8,8]{1,0}), f32[8,8]{1,0}) call-start(%p0), to_apply=%wgrad, frontend_attributes={_xla_stream_annotation="1",inlineable="false"}, metadata={op_name="jit(f)/ooo_W3/compute_on"}
  %call-start.1 = ((f32[8,8]{1,0}), f32[8]{0}) call-start(%p0), to_apply=%small, frontend_attributes={_xla_stream_annotation="1"}, metadata={op_name="jit(f)/ooo_W4/compute_on"}
  %gemm = (f32[8,8]{1,0}, s8[0]{0}) custom-call(f32[8,8]{1,0} %p0, f32[8,8]{1,0} %p0), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(f)/ooo_X2/dot_general"}
  %call-done.1 = f32[8]{0} call-done(%call-start.1)
  %conv_fusion = f32[1,8,8,1]{3,2,1,0} fusion(%p1, %p2), kind=kOutput, calls=%conv_body
  %call-done = f32[8,8]{1,0} call-done(%call-start)
  %cp-start = (f32[8,8]{1,0}, f32[8,8]{1,0}) collective-permute-start(%p0), source_target_pairs={{0,1},{1,0}}
  %sync-ar = f32[8,8]{1,0} all-reduce(%p0), to_apply=%add
  %cp-done = f32[8,8]{1,0} collective-permute-done(%cp-start)
  %as = ((f32[8,8]{1,0}), f32[1,8]{1,0}) async-start(%p0), calls=%wrapped_rs
  %ad = f32[1,8]{1,0} async-done(%as), calls=%wrapped_rs
  %loop = (f32[8,8]{1,0}, s32[]) while(%t0), condition=%cond, body=%body
  ROOT %res = f32[8,8]{1,0} add(%call-done, %cp-done)
}
"""


def test_parse_snippet_instrs_and_kinds():
  s = hlo_schedule.parse(SNIPPET)
  assert s.is_scheduled and s.entry_name == "main"
  by = {i.name: i for i in s.entry}
  assert by["gemm"].kind == "gemm" and by["gemm"].is_heavy
  assert by["gemm"].operands == ("p0", "p0")  # typed operands, newer printing
  assert by["gemm"].op_name == "jit(f)/ooo_X2/dot_general"
  assert by["conv_fusion"].kind == "conv" and by["conv_fusion"].is_heavy
  assert by["sync-ar"].kind == "collective" and not by["sync-ar"].is_heavy
  assert by["p0"].kind == "trivial" and by["loop"].kind == "control"
  assert by["call-start"].stream == "1" and by["cp-start"].stream is None
  assert set(s.computations) >= {"main", "body", "wgrad", "conv_body"}
  assert s.find("g2", "body").kind == "gemm"  # a triton GEMM fusion: dot inside
  order = [i.name for i in s.entry]
  assert order.index("call-done") < order.index("sync-ar") < order.index("cp-done")


def test_parse_snippet_pairs():
  s = hlo_schedule.parse(SNIPPET)
  kinds = [(p.kind, p.computation) for p in s.pairs]
  # entry pairs first, by start position; then the while body's
  assert kinds == [
    ("call", "main"),
    ("call", "main"),
    ("collective-permute", "main"),
    ("reduce-scatter", "main"),
    ("all-reduce", "body"),
  ]
  heavy_call, small_call = s.pairs_of("call")
  assert heavy_call.heavy_callee and heavy_call.stream == "1"
  assert [i.kind for i in heavy_call.callee if i.kind != "trivial"] == ["conv"]
  assert [i.name for i in heavy_call.overlapped_heavy] == ["gemm", "conv_fusion"]
  assert not small_call.heavy_callee and [i.name for i in small_call.between] == ["gemm"]
  (cp,) = s.pairs_of("collective-permute")
  assert [i.name for i in cp.between] == ["sync-ar"] and cp.callee == ()
  (ar,) = s.pairs_of("all-reduce")
  assert ar.computation == "body" and [i.name for i in ar.overlapped_heavy] == ["g2"]
  assert s.heavy_overlap() == (1, 1)
  text = s.summary()
  assert "heavy dW calls overlapped: 1 / 1" in text and "(in body)" in text
  assert len([ln for ln in text.splitlines() if "between" in ln]) == len(s.pairs)


def test_parse_tolerates_unscheduled_and_unnamed_entry():
  s = hlo_schedule.parse(
    "HloModule x\n\n%f (a: f32[]) -> f32[] {\n  ROOT %a = f32[] parameter(0)\n}\n"
  )
  assert not s.is_scheduled and s.entry_name == "f" and s.pairs == ()


def test_parse_real_cpu_hlo():
  # XLA:CPU keeps stream-annotated calls as plain `call`s and collectives sync.
  cpus = jax.devices("cpu")
  if len(cpus) < 8:
    pytest.skip(f"needs 8 CPU devices (XLA_FLAGS in conftest), have {len(cpus)}")
  mesh = jax.sharding.Mesh(np.array(cpus[:8]), ("d",))  # CPU even where a GPU is the default

  def f(w, x):
    def body(w, x):
      return jax.lax.psum(jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w), "d")

    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P(), check_vma=False)(
      w, x
    )

  w = jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
  x = jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P("d")))
  s = hlo_schedule.parse(jax.jit(f).lower(w, x).compile().as_text())
  kinds = [i.kind for i in s.entry]
  assert "collective" in kinds and "gemm" in kinds and s.pairs == ()
  assert kinds.index("gemm") < kinds.index("collective")


# ---- ooojax.gpu_hlo --------------------------------------------------------------
def test_reason_says_what_to_do(monkeypatch):
  monkeypatch.setattr(gpu_hlo, "_installed_plugin", lambda: None)
  assert "gpu-hlo" in gpu_hlo.unavailable_reason()
  monkeypatch.setattr(gpu_hlo, "_installed_plugin", lambda: "cuda12")
  monkeypatch.setattr(gpu_hlo, "_dist_version", lambda name: None)
  monkeypatch.setattr(gpu_hlo, "_probe", lambda: NotImplementedError("topology not implemented"))
  assert "JAX_PLATFORMS=cpu" in gpu_hlo.unavailable_reason()
  monkeypatch.setattr(gpu_hlo, "_dist_version", lambda name: "0.0.1")
  assert "does not match jaxlib" in gpu_hlo.unavailable_reason()
  monkeypatch.setattr(gpu_hlo, "_dist_version", lambda name: None)
  monkeypatch.setattr(gpu_hlo, "_probe", lambda: None)
  assert gpu_hlo.unavailable_reason() is None


def test_plugin_versions_fall_back_to_the_table(monkeypatch):
  import importlib

  real = importlib.import_module

  def no_versions(name, *a):
    if name.endswith("._versions"):
      raise ImportError(name)
    return real(name, *a)

  monkeypatch.setattr(importlib, "import_module", no_versions)
  monkeypatch.setattr(gpu_hlo, "_installed_plugin", lambda: "cuda13")
  monkeypatch.setattr(gpu_hlo, "_dist_version", lambda name: "0.11.2")
  gpu_hlo.plugin_versions.cache_clear()
  try:
    v = gpu_hlo.plugin_versions()
    assert v["source"] == "table" and v["cudnn"] == (9, 12) and v["cuda"] == (13, 0)
  finally:
    gpu_hlo.plugin_versions.cache_clear()


def test_target_configs_and_bad_input():
  for g in ("H100", "H200", "A100"):
    text = gpu_hlo.target_config(g)
    assert "dnn_version_info" in text and "runtime_version" in text
  assert "150754820096" in gpu_hlo.target_config("H200")
  v = gpu_hlo.plugin_versions()
  assert len(v["cudnn"]) == 2 and len(v["cuda"]) == 2
  with pytest.raises(ValueError, match="unknown gpu"):
    gpu_hlo.target_config("H300")
  with pytest.raises(ValueError, match="mesh shape"):
    gpu_hlo.mesh("H100", 8, ("a", "b"))


def _mlp(x, ws):
  for w in ws:
    x = jnp.tanh(x @ w)
  return jnp.mean(x**2)


@needs_gpu_hlo
@pytest.mark.parametrize("gpu", ["H100", "H200"])
def test_jax_grad_mlp_has_gemms_no_pairs(gpu):
  ws = [jax.ShapeDtypeStruct((128, 128), jnp.float32)] * 3
  x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  s = gpu_hlo.schedule(jax.grad(_mlp, argnums=1), x, ws, gpu=gpu)
  assert s.is_scheduled and s.pairs == ()
  assert sum(i.kind == "gemm" for i in s.entry) >= 5


def _demo_cnn(batch=8):
  from ooojax import demo

  model = demo.SmallCNN()
  x = jax.ShapeDtypeStruct((batch, 32, 32, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((batch,), jnp.int32)
  v = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
  _, loss_fn = demo.make_step(jax.grad, model, None)
  return loss_fn, (v["params"], v["batch_stats"], x, y)


@needs_gpu_hlo
def test_single_gpu_demo_cnn_has_stream_calls():
  loss_fn, args = _demo_cnn()
  g = ooo.grad(loss_fn, has_aux=True, mode="single_gpu", ordering="none", device="H100")
  s = gpu_hlo.schedule(g, *args, gpu="H100")
  calls = s.stream_calls()
  # one stream call per side-stream Call of the schedule (merged clusters; the
  # BatchNorm/bias ones joined a conv's or a Dense's: passes.slots)
  sched = ooo.explain(loss_fn, *args, has_aux=True, mode="single_gpu", device="H100").schedule
  assert len(calls) == len(s.pairs_of("call")) == len(sched.calls) >= 4
  assert all(p.stream == "1" and p.computation == s.entry_name for p in calls)
  heavy = [p for p in calls if p.heavy_callee]
  kinds = sorted(next(i.kind for i in p.callee if i.is_heavy) for p in heavy)
  # Conv_1/Conv_2 and the 2 Dense kernels; Conv_0's dW stays on stream 0
  assert kinds == ["conv"] * 2 + ["gemm"] * 2
  conv_targets = {i.target for p in heavy for i in p.callee if i.kind == "conv"}
  assert conv_targets == {"__cudnn$convBackwardFilter"}
  k, n = s.heavy_overlap()
  assert n == 4 and 0 <= k <= n
  assert f"heavy dW calls overlapped: {k} / {n}" in s.summary()


@needs_gpu_hlo
def test_eight_device_psum_has_all_reduce_pairs():
  m = gpu_hlo.mesh("H100", 8)

  def f(w, x):
    def body(w, x):
      return jax.lax.psum(jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w), "d")

    return jax.shard_map(body, mesh=m, in_specs=(P(), P("d")), out_specs=P(), check_vma=False)(w, x)

  w = jax.ShapeDtypeStruct((64, 64), jnp.float32)  # replicated by compile_text
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(m, P("d")))
  s = gpu_hlo.schedule(f, w, x, mesh=m)
  (ar,) = s.pairs_of("all-reduce")
  # nothing to overlap: XLA >= 0.11 makes the pair one synchronous all-reduce
  assert ar.start.op in ("all-reduce-start", "all-reduce") and ar.callee == ()
  assert ar.sync == (ar.start.op == "all-reduce") and not ar.between
  assert gpu_hlo.mesh("H100", 8) is m  # cached


@needs_gpu_hlo
def test_cli_hlo_on_demo(tmp_path, capsys):
  from ooojax.__main__ import main

  out = tmp_path / "demo.hlo"
  assert main(["hlo", "--model", "demo", "--tiny", "--mode", "jax", "--out", str(out)]) == 0
  text = capsys.readouterr().out
  assert "compile-only H100 x1" in text and "heavy dW calls overlapped: 0 / 0" in text
  assert "is_scheduled=true" in out.read_text()
  with pytest.raises(ValueError, match="unknown model"):
    main(["hlo", "--model", "nope"])


def test_compare_prediction_with_compiled_snippet():
  from ooojax.passes.hlo import compare as hlo_compare
  from ooojax.passes.ir import Action, Schedule, Unit, UnitKind
  from ooojax.passes.simulate import simulate

  X, W = UnitKind.DX, UnitKind.DW
  units = (
    Unit(X, 0, (), (), cost=1.0, util=0.5),
    Unit(X, 2, (), ("X0",), cost=3.0, util=0.5),
    Unit(W, 3, (), ("X0",), cost=1.0, util=0.5, label="w3"),
    Unit(W, 4, (), ("X0",), cost=1.0, util=0.5, label="w4"),
    Unit(W, 5, (), ("X0",), cost=1.0, util=0.5, label="w5"),
  )
  streams = (
    (Action("X", 0, 0), Action("X", 2, 0)),
    (Action("W", 3, 1), Action("W", 4, 1), Action("W", 5, 1)),
  )
  sched = Schedule(streams, (), units)
  hlo = hlo_schedule.parse(SNIPPET)
  assert hlo_compare.unit_of(hlo.find("gemm")) == "X2"
  c = hlo_compare.compare(sched, simulate(streams, units), hlo, "H100")
  assert [u.unit for u in c.units] == ["W3", "W4", "W5"]
  w3, w4, w5 = c.units
  assert w3.predicted_overlap and w3.heavy and w3.xla_call == "call-start"
  assert w3.heavy_between == ("gemm", "conv_fusion") and w3.xla_overlapped and w3.agrees
  assert not w4.heavy and w4.kernels_between == ("gemm",) and w4.xla_overlapped
  assert w5.xla_call is None and not w5.xla_overlapped and c.mismatches() == (w5,)
  assert c.heavy_overlap == (1, 1) and "<- differs" in c.summary()
