#!/usr/bin/env bash
# The GPU suite, for a session lent the `device` tool (ONE call, < 10 minutes):
#   run(command="bash benchmarks/gpu.sh")
# The GPU machine has jax 0.11.2 preinstalled and no network, so nothing is
# installed: the repo runs from PYTHONPATH. Results land in $OUT (or ./gpu_out),
# one file per step; steps run in priority order within a time budget
# (BUDGET seconds, default 540) and a step that no longer fits is listed in
# skipped.txt instead of being cut off.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
PY=${PY:-python3}  # the GPU image: python3 holds jax 0.11.2
BUDGET=${BUDGET:-540}
START=$SECONDS
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; $PY -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$OUT/env.txt" 2>&1

step() {  # step NAME TIMEOUT CMD...: runs CMD with at most TIMEOUT s, never past the budget
  local name=$1 t=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -le 20 ]; then echo "$name (needed up to ${t}s)" >> "$OUT/skipped.txt"; return; fi
  [ "$t" -gt "$left" ] && t=$left
  { echo "XLA_FLAGS=${XLA_FLAGS:-<unset>}"; timeout "$t" "$@"; echo "exit $? after $((SECONDS - START))s"; } >> "$OUT/$name.md" 2>&1
}
V=("jax.grad" "ooo single_gpu" "ooo single_gpu (none)" "ooo in_order")
st() { $PY -m benchmarks.step_time "$@" --variants "${V[@]}" --rounds 5; }

unset XLA_FLAGS
# 1. Each ordering compiles on this GPU, matches jax.grad; heavy dW overlap as compiled here.
step gpu_check 120 $PY -m benchmarks.gpu_check
# 2. Measured step times, default options (command buffers on), and the simulator check.
step step_time 90 st --model demo_cnn --batch 32
step step_time 90 st --model resnet50 --batch 32 --no-sim-check
step step_time 90 st --model mobilenet_v3_small --batch 32 --no-sim-check
# 3. The compiled schedule on this GPU (autotuned layouts) vs the compile-only H100's.
step gpu_schedule_real 150 $PY -m benchmarks.gpu_schedule --real --models demo resnet50
# 4. Command buffers off.
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
step step_time_cb_off 90 st --model resnet50 --batch 32 --no-sim-check
unset XLA_FLAGS
# 5. More models, scanned layers, then the HLO tests on this GPU.
step step_time 120 st --model densenet121 --batch 32 --no-sim-check
step step_time 90 st --model mobilenet_v3_large --batch 32 --no-sim-check
step scan 120 $PY -m benchmarks.scan --sim-layers 4
step pytest_gpu 120 $PY -m pytest -x -q tests/test_hlo.py tests/test_overlap.py
tail -n 25 "$OUT"/*.md "$OUT"/*.txt
