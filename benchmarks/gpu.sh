#!/usr/bin/env bash
# The GPU suite, for a session lent the `device` tool (ONE call, < 10 minutes; the
# tool brings back at most 8 files, so gather them in one archive):
#   run(command='G=/tmp/g; OUT=$G bash benchmarks/gpu.sh; tar czf $OUT/gpu.tgz -C $G .')
# The GPU machine has Python 3.12 with jax 0.11.2 (CUDA 13 plugin), flax, optax
# and pytest preinstalled and no network: nothing is installed, the repo runs
# from PYTHONPATH. Each step writes $OUT/<step>.md as it runs (a run cut short
# still returns what it did); steps go in order of value within BUDGET seconds
# (default 540), and one that no longer fits is listed in skipped.txt. A dry run
# has no budget: it checks that every step runs, however slow the machine.
#
#   DRY=1 bash benchmarks/gpu.sh   # CPU dry run: tiny sizes, the same steps and files
#                                  # (tests/test_gpu_sh.py runs it in CI)
#   ONLY="scan pytest" ...         # just the steps named
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
PY=${PY:-python3}  # the GPU image: python3 holds jax 0.11.2
BUDGET=${BUDGET:-540}
DRY=${DRY:-}
START=$SECONDS
mkdir -p "$OUT"
# Nothing can be installed there: stop at once, and say so, if a dependency is missing.
if ! $PY -c "import flax, optax, pytest, jax" > "$OUT/env.txt" 2>&1; then
  echo "missing a dependency (flax, optax, pytest, jax): see $OUT/env.txt" | tee -a "$OUT/env.txt"
  exit 1
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  $PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
  echo "DRY=${DRY:-<unset>} BUDGET=$BUDGET $(date -u +%FT%TZ)"; } >> "$OUT/env.txt" 2>&1

V=(--variants "jax.grad" "ooo single_gpu" "ooo single_gpu (none)" "ooo in_order" "ooo single_gpu (call 40us)")
if [ -n "$DRY" ]; then  # tiny sizes, two variants: every step runs through, fast, on CPU
  # (steps that loop over models or orderings run one: the same code, a CPU's time saved)
  V=(--variants "jax.grad" "ooo single_gpu")
  SIZE=(--tiny --batch 4 --no-sim-check) ROUNDS=(--rounds 1 --iters 1) CHECK=(--batch 4 --orderings auto)
  SCHED=(--models demo --tiny --batch 4) MECH=(--model demo_cnn --batch 4) SCAN=(--layers 2 --seq 8 --dim 16 --heads 2 --vocab 32 --rounds 1 --iters 1 --sim-layers 2 --skip-compile-only)
  PYTEST=(--collect-only)  # the suite runs in CI already: check that the command works
  EXEC=(--layers 2 --dim 16 --hidden 32 --batch 16 --microbatches 4 --rounds 1 --iters 1)
  TICK=(--ticks 8 --dims 16 --rounds 1 --iters 1)
  TRACE=(--tiny --batch 4 --steps 2) TRACE_EXEC=(--tiny --steps 2)
  DPCAL=(--tiny --steps 2)
  PAIRS=(--dry)
  GAPS=(--dry)
else
  SIZE=(--batch 32) ROUNDS=(--rounds 5) CHECK=(--batch 32) SCHED=(--models demo resnet50 --batch 32) SCAN=(--sim-layers 4)
  MECH=(--model resnet50 --batch 32)
  EXEC=()
  TICK=()
  PYTEST=()
  TRACE=(--batch 32) TRACE_EXEC=()
  DPCAL=()
  PAIRS=()
  GAPS=()
fi

step() {  # step NAME TIMEOUT CMD...: runs CMD (a program, not a shell function) for at most TIMEOUT s
  local name=$1 t=$2; shift 2
  # ONLY="a b": run just those steps (the test's dry run splits the steps over cells)
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  if [ -n "$DRY" ]; then
    # A dry run checks that each step runs and writes its file; on a busy machine a
    # step may take longer than on the GPU, so no budget decides it (still via `timeout`).
    t=3600
  else
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -le 20 ]; then echo "$name (needed up to ${t}s)" >> "$OUT/skipped.txt"; return; fi
    [ "$t" -gt "$left" ] && t=$left
  fi
  { echo "XLA_FLAGS=${XLA_FLAGS:-<unset>}"; echo "\$ $*"; timeout "$t" "$@"
    echo "exit $? after $((SECONDS - START))s"; } >> "$OUT/$name.md" 2>&1
}
ST=($PY -m benchmarks.step_time "${V[@]}" "${ROUNDS[@]}")

unset XLA_FLAGS
# 1. Measured step times first (the third H200 run found the pinned single_gpu step
# dispatched through Python every call, an effect on the control edge; fixed since):
# does the pinned two-stream step still lose once jit's fast path holds? The pinned
# windows are planned by the uncalibrated preset (a shipped calibration plans none yet).
export OOOJAX_CALIBRATION=none
step step_time_demo_cnn 90 "${ST[@]}" --model demo_cnn "${SIZE[@]}"
step step_time_resnet50 90 "${ST[@]}" --model resnet50 "${SIZE[@]}" --no-sim-check
# 1b. What the host does while the GPU idles beside pinned windows (third H200 run:
# ResNet-50 idle 18.7 ms a step against jax.grad's 0.8 ms, busy equal, Python
# dispatch): each device gap against the CUDA API calls and XLA thunks overlapping it.
step gpu_gaps_demo_cnn 90 $PY -m benchmarks.gpu_gaps "${GAPS[@]}"
# 1c. What one stream call costs here (pinned, unpinned; command buffers on and off) and
# what a second stream gains on real dX/dW pairs: writes calibration/<device>.json,
# which the cost model reads once it ships in ooojax/calibration/ (issue 50). The
# shipped figures (77-105 us a pinned call) held the Python dispatch: refit them.
unset OOOJAX_CALIBRATION
step stream_pairs 120 $PY -m benchmarks.stream_pairs "${PAIRS[@]}" --calibration-dir "$OUT/calibration"
export OOOJAX_CALIBRATION=none
# 1d. The pipeline executor with B and W recomputing F's LayerNorm statistics (the GPU
# default since) against F saving them: compile-only H100 149 -> 117 kernels a
# microbatch against the accumulated scan's 108; predicted ~1.08x the accumulated
# step against the third run's 1.43x (simulated at 2.7 us a kernel).
step executor_cost 150 $PY -m benchmarks.executor_cost "${EXEC[@]}" --ticks switch --recompute auto off --budget 120
# 1e. Device traces per variant (idle gaps, two streams at once, the same kernels'
# time) and each variant's compiled HLO (this device's layouts) under hlo/.
step gpu_trace_demo_cnn 90 $PY -m benchmarks.gpu_trace --model demo_cnn "${TRACE[@]}" --hlo-dir "$OUT/hlo"
step gpu_trace_resnet50 150 $PY -m benchmarks.gpu_trace --model resnet50 "${TRACE[@]}" --hlo-dir "$OUT/hlo"
# 2. Each ordering compiles on this GPU and matches jax.grad; heavy dW overlap as compiled here.
step gpu_check 120 $PY -m benchmarks.gpu_check "${CHECK[@]}"
# 2b. One data-parallel step (nanodo, plain jit and ooojax) on this one device: its
# kernel times beside the replay's H100 roofline (benchmarks.dp_exposed prices
# compiled multi-GPU programs with that roofline); dp_kernels.json calibrates it.
step dp_calibrate 120 $PY -m benchmarks.dp_calibrate "${DPCAL[@]}" --json "$OUT/dp_kernels.json"
# 3. The pipeline executor's tick options (records written every tick or behind a
# conditional, switch or select ticks, CUDA graphs) were settled by the second and third
# runs (RESULTS: "The third GPU run"); step 1d above times the executor as it now runs.
# What one conditional, one select tick and one CUDA-graph conditional cost here
# (settles passes.pipeline.lowering's HOST_SYNC and its choice).
step tick_cost 60 $PY -m benchmarks.tick_cost "${TICK[@]}"
# The executor's device trace beside the accumulated step: idle time is the ticks' gaps.
step gpu_trace_executor 90 $PY -m benchmarks.gpu_trace --executor 8 "${TRACE_EXEC[@]}" --hlo-dir "$OUT/hlo"
# 4. The compiled schedule on this device (autotuned layouts) vs the compile-only H100's.
step gpu_schedule_real 150 $PY -m benchmarks.gpu_schedule --real "${SCHED[@]}"
# 4b. Gradients against jax.grad at float32 tolerance: f32 matmuls in full precision (not TF32).
step pytest 120 env JAX_DEFAULT_MATMUL_PRECISION=highest $PY -m pytest -q -rs "${PYTEST[@]}" \
  tests/test_hlo.py tests/test_overlap.py tests/test_grad.py
# 5. More models, the single-GPU mechanisms, command buffers off, scanned layers
# (measured on 2026-11-27; DenseNet-121 and MobileNetV3-large ran out of their
# 120 s there, compiling).
step step_time_mobilenet_v3_small 90 "${ST[@]}" --model mobilenet_v3_small "${SIZE[@]}" --no-sim-check
# ooojax's own emission under default options, then with the latency-hiding scheduler
# off, then with four async calls allowed in flight; jax.grad under the same options.
step single_gpu_mechanisms 120 $PY -m benchmarks.step_time --variants "jax.grad" "ooo single_gpu" \
  "${ROUNDS[@]}" "${MECH[@]}" --no-sim-check \
  --also-with xla_gpu_enable_latency_hiding_scheduler=false \
  --also-with xla_gpu_experimental_parallel_async_compute_limit=4
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
step step_time_resnet50_cb_off 90 "${ST[@]}" --model resnet50 "${SIZE[@]}" --no-sim-check
unset XLA_FLAGS
step scan 120 $PY -m benchmarks.scan "${SCAN[@]}"
step step_time_densenet121 180 "${ST[@]}" --model densenet121 "${SIZE[@]}" --no-sim-check
step step_time_mobilenet_v3_large 150 "${ST[@]}" --model mobilenet_v3_large "${SIZE[@]}" --no-sim-check
echo "done after $((SECONDS - START))s" >> "$OUT/env.txt"
shopt -s nullglob  # every step skipped: no .md file, still a clean exit
tail -n 25 "$OUT"/*.md "$OUT"/*.txt
