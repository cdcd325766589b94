#!/usr/bin/env bash
# How the shipped drafters were made: the target's own answers, then every training run of the
# drafter ablation at once, on one GPU. Re-running it resumes (answers by shard, runs by checkpoint).
#
#   bash scripts/train_drafters.sh                  # on a GPU machine, from the repository root
#   DEVICE=cpu LIMIT=8 SHORT=0.1 LONG=0.2 bash scripts/train_drafters.sh   # a smoke test anywhere
#
# Inputs (WORK/inputs, made on a machine with the ShareGPT package by scripts/export_training_inputs.py):
# prompts-train.jsonl, prompts-held_out.jsonl, sharegpt-train-512.npz; TARGET: the target (default: the
# embedded SmolLM2-135M-Instruct, converted once from its GGUF if WORK/target is missing).
# Outputs: WORK/runs/<name>/ (config.json, model.safetensors, metrics.json, log) and WORK/*.done markers.
set -uo pipefail
WORK=${WORK:-$PWD/.gpu/work}
INPUTS=${INPUTS:-$WORK/inputs}
DEVICE=${DEVICE:-cuda}
LIMIT=${LIMIT:-}            # answer only the first N prompts (smoke tests)
SHORT=${SHORT:-6}           # minutes: the ablation runs
LONG=${LONG:-12}            # minutes: the runs that may ship
ANSWER_WORKERS=${ANSWER_WORKERS:-6}
BATCH=${BATCH:-16}
mkdir -p "$WORK/runs"
cd "$(dirname "$0")/.."
run() { python3 -m fuzzyspec.cli "$@"; }

TARGET=${TARGET:-$WORK/target}
if [ ! -f "$TARGET/config.json" ] && [ ! -f "$TARGET" ]; then
  python3 -c "import sys; from pathlib import Path; from fuzzyspec.loading import convert_gguf, embedded_gguf
gguf = Path(sys.argv[2]) if sys.argv[2] else embedded_gguf()
convert_gguf(gguf, Path(sys.argv[1]))" "$TARGET" "${GGUF:-}" || exit 1
fi
common=(--target "$TARGET" --device "$DEVICE" --dtype bfloat16)
limit=(); [ -n "$LIMIT" ] && limit=(--limit "$LIMIT")

# 1. The target's own answers, greedy and at temperature 0.8, to the ShareGPT training prompts (several
#    processes share the shards), and to held-out prompts for evaluation.
if [ ! -f "$WORK/answers.done" ]; then
  for ((i = 0; i < ANSWER_WORKERS; i++)); do
    run train data --out "$WORK/answers" --prompts "$INPUTS/prompts-train.jsonl" "${common[@]}" "${limit[@]}" \
      --batch-size 256 --worker "$i/$ANSWER_WORKERS" > "$WORK/answers-$i.log" 2>&1 &
  done
  run train data --out "$WORK/answers-held_out" --prompts "$INPUTS/prompts-held_out.jsonl" "${common[@]}" \
    --limit "${LIMIT:-300}" --batch-size 256 > "$WORK/answers-held_out.log" 2>&1 &
  wait
  touch "$WORK/answers.done"
fi

# 2. Training: every run at once (small models share the GPU well). name, minutes, kind, options.
train_run() {
  local name=$1 minutes=$2 kind=$3; shift 3
  [ -f "$WORK/runs/$name/metrics.json" ] && return 0
  run train "$kind" --out "$WORK/runs/$name" "${common[@]}" --data "$WORK/answers" \
    --eval-data "$WORK/answers-held_out" --eval-sequences 256 --batch-size "$BATCH" --epochs 50 \
    --budget-minutes "$minutes" "$@" > "$WORK/runs/$name.log" 2>&1 || echo "run $name failed" >&2
}
eagle3=(--lr 8e-4 --warmup-steps 200)
draft=(--lr 5e-4 --warmup-steps 100)
# Ablation (SHORT minutes each): one lever changed at a time against e3-16k.
(
  train_run e3-16k "$SHORT" eagle3 "${eagle3[@]}" --draft-vocab 16384 &
  train_run e3-8k "$SHORT" eagle3 "${eagle3[@]}" --draft-vocab 8192 &
  train_run e3-16k-ttt1 "$SHORT" eagle3 "${eagle3[@]}" --draft-vocab 16384 --ttt-steps 1 &
  train_run e3-16k-tv "$SHORT" eagle3 "${eagle3[@]}" --draft-vocab 16384 --loss tv &
  train_run e3-16k-sharegpt "$SHORT" eagle3 "${eagle3[@]}" --draft-vocab 16384 \
    --data "$INPUTS/sharegpt-train-512.npz" &
  train_run e1-selfdistill "$SHORT" eagle --lr 5e-4 --warmup-steps 100 &
  train_run draft-16k-ce-short "$SHORT" draft "${draft[@]}" --draft-vocab 16384 &
  wait
  touch "$WORK/short.done"
) &
# The candidates to ship (LONG minutes): the head, and the draft LM under each loss.
(
  train_run e3-16k-long "$LONG" eagle3 "${eagle3[@]}" --draft-vocab 16384 &
  train_run draft-16k-ce "$LONG" draft "${draft[@]}" --draft-vocab 16384 &
  train_run draft-16k-tv "$LONG" draft "${draft[@]}" --draft-vocab 16384 --loss tv &
  train_run draft-16k-js "$LONG" draft "${draft[@]}" --draft-vocab 16384 --loss js &
  wait
  touch "$WORK/long.done"
) &
wait
