#!/usr/bin/env bash
# anchor-rl's methods in verl 0.9.1: Qwen2.5-1.5B-Instruct on GSM8K, 8 GPUs.
#
#   bash examples/verl/run_qwen2.5_1.5b.sh                          # PVPO
#   bash examples/verl/run_qwen2.5_1.5b.sh anchor_rl_method=v05     # V0.5
#   bash examples/verl/run_qwen2.5_1.5b.sh anchor_rl_method=vapo    # VAPO
#
# Any other verl or anchor_rl key goes on the command line too (anchor_rl.pvpo.m=8,
# trainer.n_gpus_per_node=4, ...). Needs verl 0.9.1 with vLLM on the GPU nodes and this
# package installed there (its verl.plugins entry point registers the trainer in every Ray
# worker): docs/integrations.md, section "verl".
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export ANCHOR_RL_CACHE="${ANCHOR_RL_CACHE:-$HOME/.cache/anchor-rl}"   # the anchor store
python3 -m verl.trainer.main_ppo \
    --config-path="$here/config" \
    --config-name=anchor_rl_qwen2.5_1.5b \
    "$@"
