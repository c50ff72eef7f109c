#!/usr/bin/env bash
# The GPU tables of docs/results.md ("On a GPU"), in one go on a machine with one CUDA GPU.
#
# Usage: bash benchmarks/gpu_tables.sh [OUT] (default runs/gpu), with anchor-rl, trl and ray
# installed. Stages run in order of priority, each with what is left of a time budget
# (GPU_TABLES_SECONDS, default 540 s; a stage gets at most twice the seconds it is said to
# need): a stage that would not fit is skipped and says so.
# After each stage AFTER_STAGE (a shell command, optional) runs, e.g. to copy results away:
# copy the JSON, markdown and logs only (the bench runs save model checkpoints, GBs for the
# larger model; archiving them cost one session minutes of GPU time).
#
#   1. the machine and versions;
#   2. a larger HF-format model: a random Llama body at TinyLlama's width, 16 layers (~0.7B),
#      written by benchmarks/make_hf_model.py with the project's tokenizer;
#   3. anchor-rl's sampler (decode static and graph; auto is graph on a GPU) against
#      transformers' generate (benchmarks/probe_generate.py), bf16;
#   4. suite trl, bf16, 3 seeds, on the larger model and on `base` (the H100 session paired
#      2 seeds of each before its time ran out);
#   5. suite throughput on `base` in bf16 (the update padding-free with shared prefixes, the
#      default, and padded), in float32, and the larger model in bf16;
#   6. the update's scoring layouts (padded, packed, shared-prefix) on synthetic batches with
#      short and long responses, both models, bf16 (benchmarks/probe_layouts.py);
#   7. suite throughput on the larger model with the padded update;
#   8. suite throughput on `base` with 1 and 2 Ray rollout workers on a share of the GPU.
# The H100 session's cuDNN A/B (the bf16 update with cuDNN's attention allowed):
#   ANCHOR_RL_SDPA_CUDNN=on anchor-rl bench throughput --device cuda model=random:base ...
#
# A dry run of the plumbing on the CPU (small shapes, 1-step smoke profiles):
#   GPU_TABLES_DEVICE=cpu GPU_TABLES_MODEL="--hidden 64 --layers 2 --heads 4 --kv-heads 2
#   --intermediate 128" GPU_TABLES_BENCH="--profile quick" GPU_TABLES_BASE=random:tiny
#   GPU_TABLES_SKIP=layouts bash benchmarks/gpu_tables.sh /tmp/gpu-dry
# (the layouts stage's 1,024-token profiles take minutes a model on a CPU).
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
  # a stage gets at most twice what it needs, so one that hangs leaves time for the rest
  local cap=$((2 * need < $(left) ? 2 * need : $(left)))
  echo "== $name ($(date +%T), $(left) s left)"
  timeout "$cap" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - start)) s"
  tail -n 4 "$out/$name.log"
  if [ -n "${AFTER_STAGE:-}" ]; then eval "$AFTER_STAGE"; fi
}

stage machine 20 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  nproc; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)";
  python3 -c "import trl, datasets; print(\"trl\", trl.__version__, \"datasets\", datasets.__version__)";
  python3 -c "import ray; print(\"ray\", ray.__version__)"'
stage model 60 python3 benchmarks/make_hf_model.py "$big" --device "$dev" "${model_args[@]}"
stage generate 100 python3 benchmarks/probe_generate.py "$base" "$big" --device "$dev" \
  --dtype bfloat16 --repeats 3 --decodes "static,graph" --out "$out/generate-bf16.json"
# a trl run is a fresh process (imports, model load) and each seed ends in an evaluation:
# on the H100 5 runs of the larger model took ~270 s
stage trl-big-bf16 330 anchor-rl bench trl --device "$dev" --seeds 0,1,2 --steps 8 "${bench[@]}" \
  --out "$out/trl-big-bf16" "model=$big" "${B[@]}"
stage trl-base-bf16 250 anchor-rl bench trl --device "$dev" --seeds 0,1,2 --steps 8 "${bench[@]}" \
  --out "$out/trl-base-bf16" "model=$base" "${B[@]}"
# on the H100 the padded update was 2.4x as fast at the trl suite's lengths: the layouts at
# RL lengths too (1024-token responses), on both models
stage layouts 150 python3 benchmarks/probe_layouts.py "$base" "$big" --device "$dev" \
  --autocast bf16 --repeats 3 --micro-batch 8 --out "$out/layouts-bf16.json"
stage throughput-base-bf16 60 anchor-rl bench throughput --device "$dev" --steps 5 "${bench[@]}" \
  --out "$out/throughput-base-bf16" "model=$base" "${B[@]}"
# the update's layouts were chosen on the CPU; on a GPU the padded one (fewer, larger
# kernels) may be faster: the A/B for the GPU default
stage throughput-base-bf16-padded 60 anchor-rl bench throughput --device "$dev" --steps 5 \
  "${bench[@]}" --out "$out/throughput-base-bf16-padded" "model=$base" "${B[@]}" \
  optim.padding_free=off optim.shared_prefix=off
stage throughput-base 60 anchor-rl bench throughput --device "$dev" --steps 5 "${bench[@]}" \
  --out "$out/throughput-base" "model=$base"
stage throughput-big-bf16 60 anchor-rl bench throughput --device "$dev" --steps 5 "${bench[@]}" \
  --out "$out/throughput-big-bf16" "model=$big" "${B[@]}"
stage throughput-big-bf16-padded 60 anchor-rl bench throughput --device "$dev" --steps 5 \
  "${bench[@]}" --out "$out/throughput-big-bf16-padded" "model=$big" "${B[@]}" \
  optim.padding_free=off optim.shared_prefix=off
stage throughput-ray 90 env RAY_AUTH_MODE=disabled python3 -c "
from anchor_rl.bench.runner import BenchArgs
from anchor_rl.bench.throughput import run_throughput_suite
run_throughput_suite(BenchArgs('$out/throughput-ray', steps=5, overrides=['device=$dev', 'model=$base']),
                     layouts=('', 'g1', 'g2'))"
echo "== done after $((SECONDS - start)) s"
