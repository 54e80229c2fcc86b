#!/usr/bin/env bash
# The runs behind docs/parity.md: each task x seed x precision with the CLI, then the table.
# Usage: [LM_STEPS=400] bash docs/parity.sh [OUT_DIR]   (repository root, venv active; CPU: 20-60 min on 2 busy
# cores, nearly all of it lm in bf16/fp16). Finished runs are kept and skipped on a rerun.
set -euo pipefail
out=${1:-runs/parity}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# lm: the example's recipe (SGD lr 5.0, StepLR 0.95 per epoch, clip 0.5, bptt 35) on a
# smaller model than the example's 200-wide one: bf16/fp16 run 24-54x slower on a CPU
# without low-precision units. digits: the built-in task as it is.
lm=(--task lm --max-steps "${LM_STEPS:-400}" --batch-size 32 --task-opt emsize=32 --task-opt nhid=64
    --task-opt nlayers=2 --task-opt vocab=1000)
digits=(--task digits --max-steps 600)
run() {  # run TASK SEED PRECISION ARGS...
  local dir=$out/$1-$3-seed$2
  [ -f "$dir/summary.json" ] || python -m ddp_amp.train "${@:4}" --precision "$3" --seed "$2" \
    --eval-every 0 --log-every 1000 --run-dir "$dir" > /dev/null
}
for seed in 0 1 2 3 4; do
  for precision in fp32 bf16 fp16; do
    run digits "$seed" "$precision" "${digits[@]}"
  done
done
for seed in 0 1 2; do
  for precision in fp32 bf16 fp16; do
    run lm "$seed" "$precision" "${lm[@]}"
  done
done
python docs/parity_table.py "$out"
