#!/usr/bin/env bash
# python -m ddp_amp.train "$@" under a rounding-order control: the same fp32 arithmetic and the
# same random numbers, summed in another order. How far such a change alone moves a run's final
# metric is the yardstick docs/parity.md holds the bf16/fp16 gaps against.
#   CONTROL=none         plain (none-again: the same, to show that a rerun is bitwise equal)
#   CONTROL=2threads     CPU: OMP_NUM_THREADS=2, so matmul sums split over two threads
#   CONTROL=cublaslt     GPU: matrix products through cuBLASLt instead of cuBLAS
#   CONTROL=noworkspace  GPU: CUBLAS_WORKSPACE_CONFIG=:0:0, so cuBLAS picks kernels without split-K workspace
set -euo pipefail
case ${CONTROL:-none} in
  none|none-again) exec python -m ddp_amp.train "$@" ;;
  2threads) OMP_NUM_THREADS=2 exec python -m ddp_amp.train "$@" ;;
  cublaslt) exec python -c 'import sys, torch
torch.backends.cuda.preferred_blas_library("cublaslt")
from ddp_amp.train import main
sys.exit(main(sys.argv[1:]))' "$@" ;;
  noworkspace) CUBLAS_WORKSPACE_CONFIG=:0:0 exec python -m ddp_amp.train "$@" ;;
  *) echo "parity_control.sh: CONTROL=$CONTROL: expected none, none-again, 2threads, cublaslt or noworkspace" >&2
     exit 2 ;;
esac
