#!/usr/bin/env bash
# Train on this host: one torchrun worker per GPU, or one plain process on a CPU-only host.
#
#   launch/local.sh [python -m ddp_amp.train options]
#   launch/local.sh --precision bf16 --max-steps 5000
#   NPROC=2 launch/local.sh --device cpu        # 2 CPU processes (gloo) via torchrun
#
# Variables: PYTHON (default python), NPROC (default: number of GPUs; 0 = one plain process),
#   PREEMPT_SIGNALS (forwarded by torchrun, default SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1),
#   SHUTDOWN_TIMEOUT (s torchrun waits for workers to checkpoint before SIGKILL, default 300),
#   MODULE (default ddp_amp.train; MODULE=ddp_amp.doctor launch/local.sh --probe checks the setup).
# Prints the exact command, then runs it.
set -euo pipefail
PYTHON=${PYTHON:-python}
NPROC=${NPROC:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}
PREEMPT_SIGNALS=${PREEMPT_SIGNALS:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-300}
MODULE=${MODULE:-ddp_amp.train}
if (( NPROC > 0 )); then
    cmd=("$PYTHON" -m ddp_amp.torchrun --standalone --nproc-per-node="$NPROC"
         --signals-to-handle="$PREEMPT_SIGNALS" --shutdown-timeout="$SHUTDOWN_TIMEOUT"
         -m "$MODULE" "$@")
else
    cmd=("$PYTHON" -m "$MODULE" "$@")
fi
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
