#!/usr/bin/env bash
# The GPU tables of docs/results.md ("On a GPU"), in one go on a machine with one CUDA GPU.
#
# Usage: bash scripts/gpu_tables.sh [OUT] (default runs/gpu), with anchor-rl, trl and ray
# installed. Stages run in order of priority, each with what is left of a time budget
# (GPU_TABLES_SECONDS, default 540 s): a stage that would not fit is skipped and says so.
# After each stage AFTER_STAGE (a shell command, optional) runs, e.g. to copy results away.
#
#   1. the machine and versions;
#   2. a larger HF-format model: a random Llama body at TinyLlama's width, 16 layers (~0.7B),
#      written by scripts/make_hf_model.py with the project's tokenizer;
#   3. anchor-rl's sampler (decode auto and graph) against transformers' generate
#      (scripts/probe_generate.py), bf16, and on `base` in float32 (the same tokens?);
#   4. suite throughput: `base` in bf16 (cuDNN attention left out, and allowed), the larger
#      model in bf16 (decode auto and graph);
#   5. suite trl on the larger model, bf16, 3 seeds, with decode=graph;
#   6. what the first GPU session measured already: `base` in float32, trl on the larger
#      model with the default decoder; then trl on `base`;
#   7. suite throughput on `base` with 1 and 2 Ray rollout workers on a share of the GPU.
#
# A dry run of the plumbing on the CPU (small shapes, 1-step smoke profiles):
#   GPU_TABLES_DEVICE=cpu GPU_TABLES_MODEL="--hidden 64 --layers 2 --heads 4 --kv-heads 2
#   --intermediate 128" GPU_TABLES_BENCH="--profile quick" GPU_TABLES_BASE=random:tiny
#   bash scripts/gpu_tables.sh /tmp/gpu-dry
set -u
out=${1:-runs/gpu}
budget=${GPU_TABLES_SECONDS:-540}
dev=${GPU_TABLES_DEVICE:-cuda}
base=${GPU_TABLES_BASE:-random:base}
read -r -a model_args <<<"${GPU_TABLES_MODEL:-}"
read -r -a bench <<<"${GPU_TABLES_BENCH:-}"
start=$SECONDS
mkdir -p "$out"
B=(optim.autocast=bf16 rollout.engine_args.precision=bf16)
big="$out/llama-0.7b"

# JAX, when a library loads it, takes 75% of the GPU's memory (the trl suite sets this too)
export JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
skip=" ${GPU_TABLES_SKIP:-} " # stage names not to run, e.g. "machine generate"

left() { echo $((budget - (SECONDS - start))); }
stage() { # NAME SECONDS_NEEDED COMMAND...
  local name=$1 need=$2
  shift 2
  if [[ $skip == *" $name "* ]]; then
    echo "== skip $name (GPU_TABLES_SKIP)"
    return
  fi
  if (($(left) < need)); then
    echo "== skip $name: $(left) s left, it needs ~$need s"
    return
  fi
  echo "== $name ($(date +%T), $(left) s left)"
  timeout "$(left)" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - start)) s"
  tail -n 4 "$out/$name.log"
  if [ -n "${AFTER_STAGE:-}" ]; then eval "$AFTER_STAGE"; fi
}

stage machine 20 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  nproc; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)";
  python3 -c "import trl, datasets; print(\"trl\", trl.__version__, \"datasets\", datasets.__version__)";
  python3 -c "import ray; print(\"ray\", ray.__version__)"'
stage model 60 python3 scripts/make_hf_model.py "$big" --device "$dev" "${model_args[@]}"
# decode=graph (CUDA graphs) is unmeasured: its stages come first; generate checks that it
# samples the same tokens as the static decoder (the same seeds)
stage generate 100 python3 scripts/probe_generate.py "$base" "$big" --device "$dev" \
  --dtype bfloat16 --decodes "auto,graph" --out "$out/generate-bf16.json"
# in float32 the two decoders' logits agree to ~1e-5, so they should sample the same tokens
stage generate-fp32 40 python3 scripts/probe_generate.py "$base" --device "$dev" \
  --dtype float32 --repeats 2 --decodes "auto,graph" --out "$out/generate-fp32.json"
stage throughput-base-bf16 60 anchor-rl bench throughput --device "$dev" --steps 5 "${bench[@]}" \
  --out "$out/throughput-base-bf16" "model=$base" "${B[@]}"
# the same with cuDNN's attention allowed in the update (anchor_rl.models.shared_prefix)
stage throughput-base-bf16-cudnn 60 env ANCHOR_RL_SDPA_CUDNN=on anchor-rl bench throughput \
  --device "$dev" --steps 5 "${bench[@]}" --out "$out/throughput-base-bf16-cudnn" "model=$base" \
  "${B[@]}"
stage throughput-big-bf16 60 anchor-rl bench throughput --device "$dev" --steps 5 "${bench[@]}" \
  --out "$out/throughput-big-bf16" "model=$big" "${B[@]}"
stage throughput-big-bf16-graph 60 anchor-rl bench throughput --device "$dev" --steps 5 \
  "${bench[@]}" --out "$out/throughput-big-bf16-graph" "model=$big" "${B[@]}" \
  rollout.engine_args.decode=graph
stage trl-big-bf16-graph 150 anchor-rl bench trl --device "$dev" --seeds 0,1,2 --steps 8 \
  "${bench[@]}" --out "$out/trl-big-bf16-graph" "model=$big" "${B[@]}" \
  rollout.engine_args.decode=graph
stage throughput-base 60 anchor-rl bench throughput --device "$dev" --steps 5 "${bench[@]}" \
  --out "$out/throughput-base" "model=$base"
stage trl-big-bf16 150 anchor-rl bench trl --device "$dev" --seeds 0,1,2 --steps 8 "${bench[@]}" \
  --out "$out/trl-big-bf16" "model=$big" "${B[@]}"
stage trl-base-bf16 120 anchor-rl bench trl --device "$dev" --seeds 0,1,2 --steps 8 "${bench[@]}" \
  --out "$out/trl-base-bf16" "model=$base" "${B[@]}"
stage throughput-ray 90 env RAY_AUTH_MODE=disabled python3 -c "
from anchor_rl.bench.runner import BenchArgs
from anchor_rl.bench.throughput import run_throughput_suite
run_throughput_suite(BenchArgs('$out/throughput-ray', steps=5, overrides=['device=$dev', 'model=$base']),
                     layouts=('', 'g1', 'g2'))"
echo "== done after $((SECONDS - start)) s"
