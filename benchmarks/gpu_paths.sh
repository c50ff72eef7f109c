#!/usr/bin/env bash
# Runs, on one GPU, the paths the CPU test suite covers but no GPU session had run: the LoRA
# sampler check (a rollout after an update scores with the policy's log-probs), LoRA on an
# HF-format model with resume, `eval --adapter` and `serve --adapter`, SIGTERM and an exact
# resume (grpo, vapo), VAPO with a LoRA policy and critic, and a Ray rollout worker on the GPU
# sampling a LoRA policy.
#
# Usage: bash benchmarks/gpu_paths.sh OUT     (anchor-rl importable; ray for the Ray stage)
#
# Each stage has its own time limit and prints "== STAGE ok|FAILED (rc) after S s"; the
# stages' logs and JSON go to OUT, and OUT/stages.txt lists every stage's outcome. A stage
# that fails does not stop the next.
set -u
out=${1:?usage: gpu_paths.sh OUT}
mkdir -p "$out"
work=${GPU_PATHS_WORK:-/tmp/gpu_paths}
dev=${GPU_PATHS_DEVICE:-cuda}   # cpu: a dry run of the script here
rm -rf "$work" && mkdir -p "$work"
start=$SECONDS
export CLI="python3 -m anchor_rl.cli" work dev out
export SMALL="rollout.prompts_per_step=4 rollout.n=4 rollout.max_new_tokens=32 train_prompts=64 eval.every=0 log.progress=false"

stage() {  # stage NAME SECONDS COMMAND...: run COMMAND with a time limit, log it, note the outcome
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  if declare -F "$1" >/dev/null; then  # a function of this script: in a bash of its own
    timeout "$limit" bash -c '"$@"' _ "$@" >"$out/$name.log" 2>&1
  else
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
  fi
  rc=$?
  if [ $rc -eq 0 ]; then echo "$name ok $((SECONDS - t0))s" | tee -a "$out/stages.txt"
  else echo "$name FAILED rc=$rc $((SECONDS - t0))s" | tee -a "$out/stages.txt"; tail -5 "$out/$name.log"
  fi
}

same_metrics() {  # same_metrics RUN_A RUN_B: every metric of every step equal but timings
  python3 - "$1" "$2" <<'EOF'
import json, sys
from anchor_rl.trainer.logging import metrics_but_timings
a, b = metrics_but_timings(sys.argv[1]), metrics_but_timings(sys.argv[2])
diff = [(i, k, x[k], y.get(k)) for i, (x, y) in enumerate(zip(a, b)) for k in x if x[k] != y.get(k)]
print(json.dumps({"steps": [len(a), len(b)], "differing": len(diff), "first": diff[:5]}, default=str))
sys.exit(0 if len(a) == len(b) and not diff else 1)
EOF
}

sigterm_resume() {  # sigterm_resume PRESET: a run stopped by SIGTERM after 3 steps, resumed, against a straight one
  local p=$1 args
  args=(--preset "$p" model=sft:tiny device=$dev steps=8 checkpoint.every=0 $SMALL)
  $CLI train "${args[@]}" --out "$work/straight_$p" || return 1
  $CLI train "${args[@]}" --out "$work/stopped_$p" &
  local pid=$! waited=0
  until [ -f "$work/stopped_$p/metrics.jsonl" ] && [ "$(wc -l <"$work/stopped_$p/metrics.jsonl")" -ge 3 ]; do
    sleep 0.2; waited=$((waited + 1)); [ $waited -gt 600 ] && { kill $pid; return 1; }
  done
  kill -TERM $pid; wait $pid; local rc=$?
  echo "stopped with exit code $rc (143 expected)"
  [ $rc -eq 143 ] || return 1
  $CLI train --resume "$work/stopped_$p" || return 1
  same_metrics "$work/straight_$p" "$work/stopped_$p"
}

serve_adapter() {  # serve the HF model with the trained adapter and ask it for one completion
  $CLI serve --model "$work/hf" --adapter "$1" --name tiny-llama --device $dev --port 8917 \
    --log-level warning &
  local pid=$! i rc
  for i in $(seq 240); do
    curl -sf localhost:8917/health >/dev/null && break; sleep 0.5
  done
  curl -sf localhost:8917/v1/completions -H 'content-type: application/json' -o "$out/serve_reply.json" \
    -d '{"model": "tiny-llama", "prompt": "What is 2 + 3?", "max_tokens": 8}'
  rc=$?
  cat "$out/serve_reply.json"
  kill $pid; wait $pid 2>/dev/null
  return $rc
}

export -f same_metrics sigterm_resume serve_adapter

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__)" | tee -a "$out/machine.txt"

stage lora_sampler 150 python3 benchmarks/lora_sampler_check.py --device $dev --sizes tiny,base \
  --precisions model,bf16 --out "$out/lora_sampler.json"
stage hf_model 60 python3 benchmarks/make_hf_model.py "$work/hf" --hidden 256 --layers 4 --heads 4 \
  --kv-heads 2 --intermediate 688 --device $dev
stage lora_hf_train 120 $CLI train --preset grpo --out "$work/lora" model="$work/hf" device=$dev \
  steps=4 lora.rank=8 lora.alpha=16 checkpoint.every=2 $SMALL
stage lora_hf_resume 120 $CLI train --resume "$work/lora" steps=6
adapter=$(ls -d "$work"/lora/checkpoints/step_*/policy 2>/dev/null | tail -1)
stage eval_adapter 120 $CLI eval --model "$work/hf" --adapter "${adapter:-missing}" --task arithmetic --limit 32 \
  --device $dev --out "$out/eval_adapter.json"
stage serve_adapter 120 serve_adapter "${adapter:-missing}"
stage sigterm_grpo 150 sigterm_resume grpo
stage sigterm_vapo 150 sigterm_resume vapo
stage lora_vapo 120 $CLI train --preset vapo --out "$work/lora_vapo" model=sft:tiny device=$dev steps=3 \
  lora.rank=8 $SMALL
stage ray_lora_worker 150 env RAY_AUTH_MODE=disabled $CLI train --preset grpo \
  --out "$work/ray_lora" model=sft:tiny device=$dev steps=3 lora.rank=8 cluster.rollout_workers=1 \
  rollout.engine_args.num_gpus_per_worker=0.5 $SMALL
echo "== all stages after $((SECONDS - start)) s"
cat "$out/stages.txt"
