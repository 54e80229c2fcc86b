#!/usr/bin/env bash
# The GPU checks behind docs/benchmarks.md's GPU figures. Part "checks": the CUDA tests, the
# CLI on one GPU (plain, torchrun + NCCL, two ranks sharing the GPU over gloo), the fp32
# rounding-order controls that docs/parity.sh can use on a GPU. Part "bench": every section of
# the benchmark, the host, overhead and fast-path ones also as DDP over NCCL on a group of one,
# the transformer one with fp8 where torchao is installed. Repository root, on a CUDA machine
# with a CUDA build of torch and the project's dependencies (pip install -e '.[test,fp8]').
# Usage: bash docs/gpu_check.sh [OUT_DIR] [checks|bench|all]
# (checks about 7 minutes on one H100, bench about 12)
set -uo pipefail
out=${1:-runs/gpu-check}
part=${2:-all}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
step() {  # step SECONDS COMMAND...: run it with a time limit, print its exit code, go on
  local limit=$1; shift
  echo "=== $*"
  timeout "$limit" "$@"
  echo "=== exit $? after ${SECONDS}s of the script"
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
python -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"
python -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1

if [[ $part == checks || $part == all ]]; then
step 180 python -m pytest -q -p no:cacheprovider -m cuda tests
# The default run: --device auto takes the GPU, --precision auto takes bf16 there.
step 120 python -m ddp_amp.train --run-dir "$out/default"
step 120 torchrun --standalone --nproc_per_node=1 -m ddp_amp.train --precision fp16 --max-steps 300 \
    --run-dir "$out/nccl-1rank-fp16"
step 120 torchrun --standalone --nproc_per_node=2 -m ddp_amp.train --backend gloo --precision bf16 \
    --max-steps 300 --run-dir "$out/gloo-2ranks-1gpu-bf16"
# --shard --cpu-offload: the shards, gradients and optimizer state in host memory, the
# optimizer stepping on the CPU. Only a GPU run can offload (a CPU run refuses the flag), so
# this is its only check: a few steps must finish (summary.json is written at the end).
step 180 python -m ddp_amp.train --task lm --shard --cpu-offload --device cuda --max-steps 20 \
    --run-dir "$out/shard-cpu-offload"
if [[ -f $out/shard-cpu-offload/summary.json ]]; then echo "cpu-offload: finished"; else echo "cpu-offload: FAILED"; fi
# --shard --compile: each unit's forward compiled, the loss too (docs/sharding.md), against the
# same sharded run eager, and fp8 (float8 linears, which want compile) where torchao is
# installed. A wider lm than the default so the step is GPU-bound; samples/s is the median of
# the logged steps after step 100 (the compile is paid in the first steps).
shardlm=(--task lm --shard --device cuda --precision bf16 --task-opt emsize=1024 --task-opt nhid=4096
  --task-opt nlayers=8 --task-opt nhead=16 --task-opt bptt=256 --batch-size 32 --max-steps 300
  --log-every 10 --eval-every 0)
step 180 python -m ddp_amp.train "${shardlm[@]}" --run-dir "$out/shard-eager"
step 240 python -m ddp_amp.train "${shardlm[@]}" --compile --run-dir "$out/shard-compiled"
step 240 python -m ddp_amp.train "${shardlm[@]}" --compile --precision fp8 --run-dir "$out/shard-compiled-fp8"
python - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
for name in ("shard-eager", "shard-compiled", "shard-compiled-fp8"):
    path = Path(sys.argv[1]) / name / "metrics.jsonl"
    rows = [r for r in map(json.loads, path.read_text().splitlines()) if "samples_per_s" in r] if path.exists() else []
    late = [r["samples_per_s"] for r in rows if r["step"] > 100]
    print(f"{name}: {len(rows)} logged steps, median samples/s after step 100 "
          f"{statistics.median(late) if late else float('nan'):.1f}, last loss {rows[-1]['loss'] if rows else 'none'}")
EOF
# Two ranks on one GPU without --backend gloo: expected to stop with the one-line hint.
step 60 torchrun --standalone --nproc_per_node=2 -m ddp_amp.train --max-steps 10 --run-dir "$out/nccl-2ranks-1gpu"

# Rounding-order controls for the parity table: fp32 again with another GEMM library or
# workspace. Each must change the loss a little after a few steps (and not more).
probe=(--task lm --max-steps 30 --batch-size 32 --task-opt vocab=1000 --log-every 1 --precision fp32 --seed 0)
for control in none none-again cublaslt noworkspace; do
  CONTROL=$control step 60 bash docs/parity_control.sh "${probe[@]}" --run-dir "$out/probe-$control" > /dev/null
done
python - "$out" <<'EOF'
import json, sys
from pathlib import Path
def losses(name):
    path = Path(sys.argv[1]) / f"probe-{name}" / "metrics.jsonl"
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r] if path.exists() else []
base = losses("none")
for name in ("none-again", "cublaslt", "noworkspace"):
    other = losses(name)
    diffs = [abs(a - b) for a, b in zip(base, other)]
    print(f"control {name}: {len(other)} steps, max |loss - fp32| {max(diffs, default=float('nan')):.3g}, "
          f"at step 30 {diffs[-1] if diffs else float('nan'):.3g}")
EOF
fi

if [[ $part == bench || $part == all ]]; then
  step 300 python -m ddp_amp.bench --sections recipe,host,overhead,fastpaths --json "$out/bench-gpu.json"
  step 300 python -m ddp_amp.bench --sections host,overhead,fastpaths --backend nccl --json "$out/bench-gpu-ddp1.json"
  step 560 python -m ddp_amp.bench --sections transformer --json "$out/transformer.json"
fi
