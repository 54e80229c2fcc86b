#!/usr/bin/env bash
# Several nodes by hand (no SLURM): run this once on EVERY node with the same settings.
#
#   MASTER_ADDR=node1 NNODES=2 launch/multinode.sh [python -m ddp_amp.train options]
#       c10d rendezvous at MASTER_ADDR:MASTER_PORT; ranks are assigned as nodes join
#   MASTER_ADDR=node1 NNODES=2 NODE_RANK=0 launch/multinode.sh ...   (and NODE_RANK=1 on node2)
#       static rendezvous: node NODE_RANK=0 must be MASTER_ADDR
#
# Variables: MASTER_ADDR (required: a name or address every node can reach), MASTER_PORT
#   (default 29500, must be free on MASTER_ADDR), NNODES (required), NODE_RANK (optional, see
#   above), NPROC_PER_NODE (default: GPUs on this node, else 1), RUN_ID (rendezvous id, the
#   same on all nodes; also names the run directory runs/<task>-<RUN_ID>, so a new RUN_ID is a
#   new run and the same one resumes it; default: the SLURM job id inside a SLURM job, a new
#   id with NNODES=1, and required otherwise), PYTHON (default python),
#   PREEMPT_SIGNALS and SHUTDOWN_TIMEOUT as in launch/local.sh.
#   MODULE (default ddp_amp.train). Check the network first, with the same line on every node:
#   MODULE=ddp_amp.doctor MASTER_ADDR=node1 NNODES=2 launch/multinode.sh --probe
# Prints the exact command, then runs it.
set -euo pipefail
PYTHON=${PYTHON:-python}
: "${MASTER_ADDR:?set MASTER_ADDR to the first node (reachable from every node)}"
: "${NNODES:?set NNODES to the number of nodes}"
MASTER_PORT=${MASTER_PORT:-29500}
if [[ -z "${RUN_ID:-}" ]]; then
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        RUN_ID=$SLURM_JOB_ID
    elif (( NNODES == 1 )); then
        RUN_ID=$(date +%Y%m%d-%H%M%S)-$$   # this launch's own: a second launch is a new run
    else
        echo "launch/multinode.sh: set RUN_ID to the same new value on every node (e.g. RUN_ID=\$(date +%Y%m%d-%H%M)); it names the run" >&2
        exit 2
    fi
fi
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
NPROC_PER_NODE=${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}
PREEMPT_SIGNALS=${PREEMPT_SIGNALS:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-300}
MODULE=${MODULE:-ddp_amp.train}
if [[ -n "${NODE_RANK:-}" ]]; then
    rdzv=(--node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT")
else
    rdzv=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT")
fi
cmd=("$PYTHON" -m ddp_amp.torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE"
     "${rdzv[@]}" --rdzv-id="$RUN_ID" --signals-to-handle="$PREEMPT_SIGNALS"
     --shutdown-timeout="$SHUTDOWN_TIMEOUT" -m "$MODULE" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
