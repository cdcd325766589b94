#!/bin/bash
# The GPU checks and benchmarks a 15-minute lease has time for, as one command (its parts' limits add up to 400 s,
# leaving the machine's start and the model's three carrying calls room): cuda_check's ``trees`` (EAGLE trees
# through CUDA graphs give the eager tokens, alone, batched, rows joining, caches growing) and ``waits`` (a tree
# step waits for the GPU once); then the embedded pair's AR against fixed EAGLE-2 trees (a tree's whole growth one
# captured graph since 2026-11-28, later: 6.90 ms a step on the H200 before, 8.03 on the H100 before cb5f9cf) with
# where the host spends a trees answer (cProfile), and the default job; for both, how much of an answer the GPU was
# busy, and the host's dearest operations (torch's profiler). Each result goes to OUT as it ends, so a stopped run
# keeps what finished. GPU_CHECK_RANDOM=1 adds the random 1.1B target's AR (130 s more).
#
# The embedded model's GGUF (98 MB) is more than one call carries beside the checkout: split it here
# (split -n 3 -d FILE part), carry a part a call into a folder git ignores, and name the parts here, in order, to
# be put together into the fuzzyspec cache. The machine's Python needs the gguf package too (carried as a wheel).
#
# Usage: bash benchmarks/gpu_check.sh OUT [GGUF_PART ...]
set -u
out=${1:?"usage: bash benchmarks/gpu_check.sh OUT [GGUF_PART ...]"}
shift
mkdir -p "$out"
if [ $# -gt 0 ]; then
  mkdir -p ~/.cache/fuzzyspec/gguf
  cat "$@" > ~/.cache/fuzzyspec/gguf/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/benchmarks:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
ar="our AR, compiled + CUDA graphs"
default="default job (planned EAGLE-2 trees sd)"
trees="EAGLE-2 trees sd, constant"
run() {  # a name, a time limit in seconds, then the command
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s"
}
run cuda_check 200 python3 benchmarks/cuda_check.py cuda trees,waits
run embedded 200 python3 benchmarks/bench_gpu.py --sets embedded --prompts 3 --rows "$ar;$trees;$default" \
  --profile "$trees" --timeline "$trees;$default" --json "$out/embedded.json"
if [ "${GPU_CHECK_RANDOM:-0}" = 1 ]; then
  run random 130 python3 benchmarks/bench_gpu.py --sets random --prompts 3 --rows "$ar" --json "$out/random.json"
fi
tail -n 6 "$out"/embedded.txt "$out"/cuda_check.txt "$out"/random.txt 2>/dev/null
