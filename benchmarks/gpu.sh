#!/usr/bin/env bash
# The GPU suite, for a session lent the `device` tool (one call, < 10 minutes):
#   run(command="bash benchmarks/gpu.sh")
# The GPU machine has jax 0.11.2 preinstalled and no network, so nothing is
# installed: the repo runs from PYTHONPATH. Results land in $OUT (or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$OUT/env.txt" 2>&1

# 1. Does each ordering mechanism compile on GPU, and match jax.grad? (~1 min)
timeout 150 python -m benchmarks.gpu_check > "$OUT/gpu_check.txt" 2>&1
timeout 120 python -m pytest -x -q tests/test_hlo.py > "$OUT/pytest_hlo_gpu.txt" 2>&1

# 1b. The compiled schedule on this GPU (autotuned) vs the compile-only H100's.
timeout 240 python -m benchmarks.gpu_schedule --real > "$OUT/gpu_schedule_real.md" 2>&1

# 2. Step times, command buffers on (XLA default) and off.
V=("jax.grad" "ooo single_gpu" "ooo single_gpu (none)" "ooo in_order")
run() {  # run NAME TIMEOUT ARGS...
  local name=$1 t=$2; shift 2
  { echo "XLA_FLAGS=${XLA_FLAGS:-<unset>}"; timeout "$t" python -m benchmarks.step_time "$@" --variants "${V[@]}" --rounds 5; } >> "$OUT/step_time_$name.md" 2>&1
}
unset XLA_FLAGS
run cb_default 90 --model demo_cnn --batch 32
run cb_default 90 --model mobilenet_v3_small --batch 32 --no-sim-check
run cb_default 90 --model mobilenet_v3_large --batch 32 --no-sim-check
run cb_default 120 --model densenet121 --batch 32 --no-sim-check
run cb_default 90 --model resnet50 --batch 32 --no-sim-check
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
run cb_off 90 --model mobilenet_v3_small --batch 32 --no-sim-check
run cb_off 120 --model densenet121 --batch 32 --no-sim-check
unset XLA_FLAGS
tail -n 25 "$OUT"/*.txt "$OUT"/*.md
