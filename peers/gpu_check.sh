#!/usr/bin/env bash
# The GPU check: one command, about 8 minutes on one H100/H200, each part bounded; every part's
# output under $OUT (default out/gpu_check), one line a part in $OUT/summary.txt.
#   bash peers/gpu_check.sh
# It needs vLLM importable (requirements-gpu.txt).
# Without a GPU it rehearses every part that can run on CPU (tiny model, small shapes), which
# checks the script itself; the table it prints there says nothing about a GPU.
#   1. varlen   FlashAttention's varlen kernel against per-segment SDPA, asserted (CPU: skipped)
#   2. gpu      the tiny model end to end (train.py, compiled layers on a GPU) in bf16 and fp16,
#               colocated and on a separate engine: logprob mismatch, push seconds, memory
#   3. lora     the same with a rank-8 adapter (bf16, colocated: config/qwen_lora.py's mode)
#   4. lora7b   the trainer step at Qwen2.5-7B's shape with LoRA as config/qwen_lora.py trains
#               it: peak memory must stay under 30 GiB (CPU: the small shape, no limit)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
PY=${PY:-python3}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
export VLLM_USE_FLASHINFER_SAMPLER=0  # requirements-gpu.txt installs no flashinfer
if nvidia-smi > /dev/null 2>&1; then
  DTYPES=bfloat16,float16
  SHAPE="--shape=7b --max_gib=30 --groups=16 --tokens=512 --budget=16384"
else
  DTYPES=bfloat16
  SHAPE="--shape=small --groups=2 --tokens=128 --budget=4096"
fi

part() {  # name, seconds, command...: runs it, keeps its output, says how it ended
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  grep -E '^\{|^[a-z].* [0-9.e+-]+ ' "$OUT/$name.log" | tail -n 8
}

$PY prepare.py tiny > /dev/null
part varlen 120 $PY bench.py --varlen
part gpu 300 $PY bench.py --gpu --models=tiny --dtypes=$DTYPES --modes=colocate,separate
part lora 120 $PY bench.py --gpu --models=tiny --dtypes=bfloat16 --modes=colocate --lora_rank=8
part lora7b 150 $PY -m torch.distributed.run --nproc_per_node=1 bench.py --trainer $SHAPE \
  --lora_rank=32 --checkpointing=1
cat "$OUT/summary.txt"
! grep -qv "rc=0" "$OUT/summary.txt"
