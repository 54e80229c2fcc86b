#!/usr/bin/env bash
# Submit to SLURM with the sizes as variables instead of editing the #SBATCH lines.
#
#   NODES=2 GPUS=8 TIME=12:00:00 launch/submit.sh [python -m ddp_amp.train options]
#   NODES=1 GPUS=0 TASKS=2 launch/submit.sh --device cpu --max-steps 100   # CPU-only try-out
#
# NODES=1 uses slurm/one_node.sbatch (srun, one task per GPU); more nodes use
# slurm/multi_node.sbatch (one torchrun per node). Variables: NODES (default 1), GPUS per node
# (default 4; 0 = CPU), TASKS per node for one node without GPUs (default 1), TIME (default
# 04:00:00), SIGNAL (default USR1@120: the preemption warning), PARTITION, ACCOUNT (optional),
# SBATCH_EXTRA (more sbatch options). Prints the exact command, then runs it.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
NODES=${NODES:-1}
GPUS=${GPUS:-4}
TIME=${TIME:-04:00:00}
SIGNAL=${SIGNAL:-USR1@120}
args=(--nodes="$NODES" --gpus-per-node="$GPUS" --time="$TIME" --signal="$SIGNAL")
[[ -n "${PARTITION:-}" ]] && args+=(--partition="$PARTITION")
[[ -n "${ACCOUNT:-}" ]] && args+=(--account="$ACCOUNT")
if (( NODES == 1 )); then
    template=$here/slurm/one_node.sbatch
    per_node=$(( GPUS > 0 ? GPUS : ${TASKS:-1} ))
    args+=(--ntasks-per-node="$per_node")
else
    template=$here/slurm/multi_node.sbatch
    args+=(--ntasks-per-node=1)
fi
read -r -a extra <<< "${SBATCH_EXTRA:-}"
cmd=(sbatch "${args[@]}" "${extra[@]}" "$template" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
