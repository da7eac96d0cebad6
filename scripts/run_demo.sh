#!/usr/bin/env bash
# The README's first command: set up (idempotent), then the main job: train a small GPT on the
# bundled corpus with 2 processes through the deepspeed_c launcher (CPU ranks on gloo when the
# machine has no GPU). Extra arguments go to the training script (e.g. --text my.txt --steps 500
# --deepspeed_config my_config.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/deepspeed_c --num_gpus 2 examples/train_gpt/train.py \
    --deepspeed_config examples/train_gpt/ds_config.json "$@"
