#!/usr/bin/env bash
# Runs behind docs/parity.md: every task x seed x precision with the CLI, then the table.
# Usage: bash docs/parity.sh [OUT_DIR]   (from the repository root; CPU; ~30 min on 2 busy cores)
set -euo pipefail
out=${1:-runs/parity}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# lm: the example's recipe (SGD lr 5.0, StepLR 0.95 per epoch, clip 0.5, bptt 35) on a
# smaller model than the example's 200-wide one: bf16/fp16 run 24-54x slower on a CPU
# without low-precision units. digits: the built-in task as it is.
lm=(--task lm --max-steps 400 --batch-size 32 --task-opt emsize=32 --task-opt nhid=64
    --task-opt nlayers=2 --task-opt vocab=1000)
digits=(--task digits --max-steps 600)
for seed in 0 1 2; do
  for precision in fp32 bf16 fp16; do
    for task in lm digits; do
      declare -n args=$task
      dir=$out/$task-$precision-seed$seed
      [ -f "$dir/summary.json" ] || python -m ddp_amp.train "${args[@]}" --precision "$precision" \
        --seed "$seed" --eval-every 0 --log-every 1000 --run-dir "$dir" > /dev/null
    done
  done
done
python - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {"lm": ("eval_ppl", "perplexity", "%", lambda v, ref: 100 * (v / ref - 1)),
        "digits": ("eval_accuracy", "accuracy %", "points", lambda v, ref: 100 * (v - ref))}
print("| task | metric | seed | fp32 | bf16 | fp16 | bf16 vs fp32 | fp16 vs fp32 | fp16 skipped steps |")
print("|---|---|---|---|---|---|---|---|---|")
for task, (key, label, unit, gap) in rows.items():
    for seed in (0, 1, 2):
        s = {p: json.loads((out / f"{task}-{p}-seed{seed}" / "summary.json").read_text())
             for p in ("fp32", "bf16", "fp16")}
        scale = 100 if task == "digits" else 1
        v = {p: s[p][key] for p in s}
        print(f"| {task} | {label} | {seed} | " + " | ".join(f"{v[p] * scale:.2f}" for p in s)
              + f" | {gap(v['bf16'], v['fp32']):+.2f} {unit} | {gap(v['fp16'], v['fp32']):+.2f} {unit}"
              + f" | {s['fp16']['skipped_total']} |")
PY
