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
echo "XLA_FLAGS for each run are recorded in the file names and headers below." >> "$OUT/env.txt"

timeout 120 python -m benchmarks.gpu_check > "$OUT/gpu_check.txt" 2>&1
timeout 120 python -m pytest -x -q tests/test_grad.py tests/test_hlo.py > "$OUT/pytest_gpu.txt" 2>&1

for cb in default off; do
  if [ "$cb" = off ]; then export XLA_FLAGS="--xla_gpu_enable_command_buffer="; else unset XLA_FLAGS; fi
  echo "XLA_FLAGS=${XLA_FLAGS:-<unset>}" > "$OUT/step_time_cb_$cb.md"
  timeout 150 python -m benchmarks.step_time --batch 32 --rounds 5 >> "$OUT/step_time_cb_$cb.md" 2>&1
done
unset XLA_FLAGS
tail -n 3 "$OUT"/*.txt "$OUT"/*.md
