#!/usr/bin/env bash
# Issue 32's GPU kernels on a bare H200 in one device call (carry .whl and .jit as for gpu_run.sh):
#
#   bash scripts/gpu_k32.sh                                  # tests, then both benchmarks
#   KVQ_TESTS_TIMEOUT=560 bash scripts/gpu_k32.sh tests      # the tests alone, with more time
#   bash scripts/gpu_k32.sh paths writes                     # the benchmarks alone
#
# 1. ``tests``: the GPU tests of the per-(token, head) cache write, the TMA decode over
#    per-(token, head) caches (both schedules, CUDA graphs) and FlashInferKernel's per-(token, head)
#    layers (Triton decode, compact-scratch prefill on fa2 / fa3, the unfused fp32 form), plus the
#    FP8 Triton decode and cache-write tests the shared code touches; interrupted after
#    KVQ_TESTS_TIMEOUT (default 300 s) so that the benchmarks still run in the call's 600 s.
#    Log: $OUT/gpu_test_log_k32.txt (and gpu_suite.txt: a record of this subset, not the gate).
# 2. ``paths``: per-layer decode at 32 x 16k, Llama-3.1-8B and Gemma-3-12B global shapes: bf16,
#    FP8 per tensor (FlashInfer tensor cores, our Triton) and the two per-(token, head) modes,
#    as % of copy bandwidth with code and scale bytes ($OUT/bench_fp8_decode_paths.json).
# 3. ``writes``: the fused cache write per mode ($OUT/bench_kv_write.json).
set -uo pipefail
cd "$(dirname "$0")/.."
export KVQ_GPU_TESTS="${KVQ_GPU_TESTS:-tests/attention/test_kv_write_per_token_head.py \
tests/attention/triton_programs/test_triton_decode_per_token_head.py tests/attention/test_flashinfer_per_token_head.py \
tests/attention/triton_programs/test_triton_decode_tma.py tests/attention/triton_programs/test_triton_decode_balanced.py \
tests/attention/triton_programs/test_triton_helpers.py tests/attention/test_kv_write.py}"
export KVQ_TEST_LOG=${KVQ_TEST_LOG:-gpu_test_log_k32.txt}
export KVQ_TESTS_TIMEOUT=${KVQ_TESTS_TIMEOUT:-300}
export KVQ_PATHS_ARGS="${KVQ_PATHS_ARGS:---quick --rounds 5 --paths fi_tc_bf16,fi_tc_fp8,triton_tma,triton_int8_per_token_head,triton_fp8_per_token_head}"
exec bash scripts/gpu_run.sh ${*:-tests paths writes}
