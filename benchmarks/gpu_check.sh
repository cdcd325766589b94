#!/bin/bash
# The GPU checks and benchmarks a lent GPU machine has time for, as one command (its parts' limits add up to 590 s):
# cuda_check's parts that the 2026-11-28 lease did not reach, and ``waits`` (a tree step waits for the GPU once);
# the embedded pair's AR against the default job (with plans backing off while held back, and as before) with where
# the host spends an answer of each, and against fixed EAGLE-2 trees (grown on the device since cb5f9cf, their
# shape read with the outcome since d07ea20: 8.03 ms a step before, read once a level); and the random 1.1B target's
# AR. Each result goes to OUT as it ends, so a stopped run keeps what finished.
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
before="default job, plans every 4 (as before)"
trees="EAGLE-2 trees sd, constant"
run() {  # a name, a time limit in seconds, then the command
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s"
}
run cuda_check 180 python3 benchmarks/cuda_check.py cuda waits,held,loading,overhead
run embedded 280 python3 benchmarks/bench_gpu.py --sets embedded --prompts 3 --rows "$ar;$default;$before;$trees" \
  --profile "$ar;$default" --json "$out/embedded.json"
run random 130 python3 benchmarks/bench_gpu.py --sets random --prompts 3 --rows "$ar" --json "$out/random.json"
tail -n 4 "$out/cuda_check.txt" "$out/embedded.txt" "$out/random.txt"
