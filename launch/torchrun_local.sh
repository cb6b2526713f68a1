#!/usr/bin/env bash
# One node, N ranks under torchrun, with shardkit's config check and placement preflight.
#   NPROC=2 launch/torchrun_local.sh [script.py [script args]]
# CPU-only machines get gloo ranks; with GPUs set NPROC to the GPU count (one rank per GPU), or
# DEVICE=cpu to run NPROC CPU ranks on a GPU machine (the GPUs are hidden from the ranks).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NPROC="${NPROC:-2}"
if [ "${DEVICE:-auto}" = cpu ]; then export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu; fi
if [ "$#" -eq 0 ]; then set -- "$here/train_tiny.py" --steps 3; fi
exec shardkit launch --launcher torchrun --standalone --nproc_per_node "$NPROC" "$@"
