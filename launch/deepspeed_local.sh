#!/usr/bin/env bash
# One node, N ranks under the deepspeed launcher, with shardkit's config check and preflight.
#   NPROC=2 DS_CONFIG=ds_configs/zero3.json launch/deepspeed_local.sh [script.py [script args]]
# Without a GPU DeepSpeed uses its CPU accelerator and gloo; the --num_gpus count is then ranks.
# DEVICE=cpu does the same on a GPU machine (GPUs hidden, DeepSpeed's CPU accelerator forced).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NPROC="${NPROC:-2}"
if [ "${DEVICE:-auto}" = cpu ]; then export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu; fi
DS_CONFIG="${DS_CONFIG:-$here/../ds_configs/zero3.json}"
MASTER_PORT="${MASTER_PORT:-29512}"
if [ "$#" -eq 0 ]; then set -- "$here/train_tiny.py" --steps 3 --deepspeed_config "$DS_CONFIG"; fi
exec shardkit launch --launcher deepspeed --num_gpus "$NPROC" --master_port "$MASTER_PORT" "$@"
