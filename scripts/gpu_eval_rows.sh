#!/usr/bin/env bash
# The H200 rows of docs/accuracy.md: `kvq eval` of both shipped trained models, compiled with the
# kvq passes (the kernels run only through the compiled graph), on each FlashInfer decode path,
# bf16, at the eval's defaults (the CPU table's windows, decode steps and prompts). One process
# per (model, kernel), all at once; the KV configs are the CPU table's, the calibrated row with
# the headroom-2 scales `kvq calibrate` now writes (benchmarks/results/cpu_2026-12-02_scales_headroom2_*).
#
# Needs the GGUFs' parts and SHA256SUMS in /tmp/xfer (gpu_run.sh eval says how they travel) and
# the Brown eval texts in /tmp/xfer/corpus; the wheels installed in /tmp/site (gpu_run.sh). A
# transformers wheel carried into /tmp/xfer goes to /tmp/site_tf, first on this script's path
# only (the image's 5.17 converts Gemma-3's GGUF wrongly: docs/accuracy.md).
# Writes $OUT/eval_<model>_<kernel>.{json,txt} and $OUT/eval_rows_log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if ls /tmp/xfer/transformers-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_tf /tmp/xfer/transformers-*.whl
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site_tf:/tmp/site:$PWD TORCH_KVQ_PROGRESS=1
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_KVQ_CORPUS=${TORCH_KVQ_CORPUS:-/tmp/xfer/corpus} TORCH_KVQ_CACHE=/tmp/kvqcache
LOG=$OUT/eval_rows_log.txt
. scripts/join_models.sh && join_models "$LOG" || exit 1
R=benchmarks/results/cpu_2026-12-02_scales_headroom2
PTH="--kv int8_per_token_head --kv fp8_per_token_head"  # the per-(token, head) modes and two maps each
declare -A KV=(
  [smollm2]="--kv fp8 --kv fp8-cal=fp8:scales=${R}_smollm2.safetensors $PTH
    --kv int8-ends-bf16=int8_per_token_head:map=0:auto,-1:auto
    --kv three-modes=fp8:map=0-9:int8_per_token_head,10-19:fp8_per_token_head"
  [gemma3]="--kv fp8 --kv fp8-sliding-bf16=fp8:skip=sliding_window --kv fp8-cal=fp8:scales=${R}_gemma3.safetensors $PTH
    --kv int8-sliding-bf16=int8_per_token_head:map=sliding_window:auto
    --kv fp8pth-sliding-int8pth-global=fp8_per_token_head:map=full_attention:int8_per_token_head"
)
for m in smollm2 gemma3; do  # convert each GGUF once before the processes that share it start
  python3 -c "from torch_kvq.integrations.trained_cache import converted_folder as c; print(c('/tmp/models/$m.gguf'))" \
    2>&1 | tail -1 | tee -a "$LOG"
done
pids=()
for m in smollm2 gemma3; do
  for k in flashinfer flashinfer-triton flashinfer-xqa; do
    cmd="python3 -m torch_kvq.cli eval --model /tmp/models/$m.gguf --kernel $k --compile kvq ${KV[$m]} --json $OUT/eval_${m}_${k}.json"
    echo "$(date -u +%T) $cmd" | tee -a "$LOG"
    $cmd > "$OUT/eval_${m}_${k}.txt" 2>&1 &
    pids+=($!)
  done
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
echo "$(date -u +%T) all done, status $status" | tee -a "$LOG"
exit $status
