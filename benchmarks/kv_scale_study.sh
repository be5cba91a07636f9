#!/usr/bin/env bash
# Why did amax/448 FP8 k/v scales come out worse than scale 1.0 (issue 31)? The measurements of
# docs/accuracy.md's calibration section, on CPU in fp32 (reference kernel, eager): calibration
# statistics from the calibration split, scales made several ways from them, then one kvq eval
# per model over every config (4 eval windows of $WINDOW tokens, default 512, prefill perplexity).
# Usage: bash benchmarks/kv_scale_study.sh MODEL   (smollm2-135m or gemma3-270m)
# Writes benchmarks/results/kv_scale_study/<model>/: scale files, statistics, eval.json / .txt.
# A statistics file already there is reused (the model pass is the slow part).
set -euo pipefail
cd "$(dirname "$0")/.."
m=$1
WINDOW=${WINDOW:-512}
CAL="kvq calibrate"
out=benchmarks/results/kv_scale_study/$m
mkdir -p "$out"
# two calibration samples: 2 texts of 2048 tokens (as the issue's run: "two other Brown texts"),
# and 4 texts of 1024
[ -f "$out/stats_2x2048.json" ] || $CAL --model "$m" --windows 2 --window 2048 --no-pow2 \
  --out "$out/a_amax.safetensors" --stats-json "$out/stats_2x2048.json"
[ -f "$out/stats_4x1024.json" ] || $CAL --model "$m" --windows 4 --window 1024 \
  --out "$out/b_amax_pow2.safetensors" --stats-json "$out/stats_4x1024.json"
A=(--stats-from "$out/stats_2x2048.json")
$CAL "${A[@]}" --out "$out/a_amax.safetensors" --no-pow2
$CAL "${A[@]}" --out "$out/a_amax_x1.41.safetensors" --multiplier 1.41 --no-pow2
$CAL "${A[@]}" --out "$out/a_amax_pow2.safetensors"
$CAL --stats-from "$out/stats_4x1024.json" --out "$out/b_amax_pow2.safetensors"
kv=(--kv scale1=fp8)
for mult in 1.19 1.41 1.68; do kv+=(--kv "scale$mult=fp8:scale=$mult"); done
for f in a_amax a_amax_x1.41 a_amax_pow2 b_amax_pow2; do
  kv+=(--kv "$f=fp8:scales=$out/$f.safetensors")
done
kvq eval --model "$m" --window "$WINDOW" --windows 4 \
  --decode-tokens 0 --new-tokens 0 "${kv[@]}" --json "$out/eval.json" | tee "$out/eval.txt"
