#!/usr/bin/env bash
# Set up a bare H200 (the device tool's machine) from the carried wheels, run the GPU tests and
# the benchmarks, and write logs and JSON results to $OUT.
#
#   KVQ_COMMIT=<hash> bash scripts/gpu_run.sh   # tests attn xqa model: the GPU gate, then benchmarks
#   bash scripts/gpu_run.sh tests attn xqa   # any subset, in that order
#   KVQ_GPU_TESTS=tests/attention/test_flashinfer_kernel.py KVQ_PYTEST_K="not slow" bash scripts/gpu_run.sh tests
#   KVQ_PYTEST_M="gpu and not slow" bash scripts/gpu_run.sh tests   # a subset of the GPU tests
#   KVQ_PYTEST_WORKERS=4 ...   # pytest-xdist workers: FlashInfer's JIT builds then overlap; without
#                              # a full .jit/ the serial suite does not fit one 600 s call (run 31
#                              # of 2026-12-01: 385 of 394 in 600 s)
#   KVQ_TESTS_TIMEOUT=420 ...  # interrupt the tests (and rest) then, so later steps (jitpack) still run
#   bash scripts/gpu_run.sh tests rest     # ... and run the GPU tests the interrupted step did not
#                              # reach (in a later call: carry its gpu_test_log.txt and gpu_suite.txt
#                              # in and set KVQ_REST_LOG / KVQ_REST_RECORD); gpu_suite.txt then
#                              # records both parts (scripts/gate_rest.py)
#
# The GPU gate: ``tests`` runs every GPU test (``-m gpu``, slow included) unless told otherwise and
# writes $OUT/gpu_suite.txt: ``commit <hash>`` ($KVQ_COMMIT, else ``git rev-parse HEAD``: the
# device machine's copy of .git need not be the tree's HEAD), a sha256 of torch_kvq/'s
# files (``python3 scripts/tree_sha.py torch_kvq`` here must print the same), date, GPU, torch,
# flashinfer and CUDA versions, the command and pytest's closing line. Commit it as
# benchmarks/results/gpu_suite.txt; it counts only with a clean tree at that commit.
#   KVQ_MODEL_ARGS="--ctx 16384 --steps 10" bash scripts/gpu_run.sh model
#   bash scripts/gpu_run.sh paths            # the package's quantized decode paths per layer vs copy bandwidth (KVQ_PATHS_ARGS)
#   bash scripts/gpu_run.sh writes           # the fused cache write per layer vs copy bandwidth (KVQ_WRITES_ARGS)
#   KVQ_SCALE_ARGS="--models llama-3.1-8b" bash scripts/gpu_run.sh scale   # decode at real scale
#   KVQ_TTFT_ARGS="--models llama-3.1-8b" bash scripts/gpu_run.sh ttft   # TTFT 8 x 16k per prefill option
#   bash scripts/gpu_run.sh hostprof         # cProfile of a CUDA-graph decode step (not in the default)
#   bash scripts/gpu_run.sh tc4              # tc4's decode per layer vs copy bandwidth: Llama head 128 at
#                                            # 16k and 32k, Gemma-3's head 256 (KVQ_TC4_ARGS: both shapes' flags)
#   bash scripts/gpu_run.sh copies           # the HF map test's model copies, every prefill attend compared
#                                            # (scripts/hf_copies_diff.py; KVQ_COPIES_ARGS)
#   bash scripts/gpu_run.sh runcopies        # the graph runner's map test's copies, per step and page
#                                            # (scripts/runner_copies_diff.py; KVQ_RUNCOPIES_ARGS)
#   bash scripts/gpu_run.sh diag             # in parallel, each to $OUT/diag_<name>.txt, within
#                                            # KVQ_DIAG_TIMEOUT s (default 420): the eager map capture
#                                            # tests; runner_copies_diff.py FF --trace: int4 eager and
#                                            # compiled, each also --poison; tc4 compiled (and with
#                                            # KVQ_DIAG_HF=1 hf_copies_diff.py's tc4 FTFZ)
#   bash scripts/gpu_run.sh cpusuite         # the CPU suite (README command) on this image's torch, GPU hidden
#   KVQ_EVAL_ARGS="--model /tmp/models/gemma3.gguf --kernel flashinfer" bash scripts/gpu_run.sh eval
#       # kvq eval on the GPU (docs/accuracy.md). The trained models' GGUFs are larger than one
#       # call carries: carry .xfer/ (parts NAME.p0, NAME.p1... of each GGUF, their SHA256SUMS, the
#       # Brown eval texts in .xfer/corpus) in consecutive calls, each starting with
#       # `mkdir -p /tmp/xfer && cp -r .xfer/. /tmp/xfer/`; this step joins each GGUF into
#       # /tmp/models, checks the sums and runs kvq eval (corpus: $TORCH_KVQ_CORPUS=/tmp/xfer/corpus)
#   bash scripts/gpu_run.sh tests jitpack    # ... then pack the FlashInfer modules built here
#   bash scripts/gpu_run.sh cachesize        # the Triton and Inductor caches' sizes (whole; a hit's files as xz)
#   KVQ_CMD="python3 scripts/hf_copies_diff.py int4_per_token_head" bash scripts/gpu_run.sh cmd
#       # any command after the set-up (FlashInfer installed, .jit restored, PYTHONPATH set)
#
# FlashInfer compiles its kernels on first use (minutes on a bare machine). ``jitpack`` packs the
# modules built so far into $OUT/flashinfer_jit.tar.xz.part-N (one xz archive in 15 MiB parts:
# a file over 16 MiB does not come back) with a STAMP (flashinfer, torch and nvcc versions);
# copied into .jit/ here and carried (carry=[".whl", ".jit"]; .whl + .jit + the tree <= 64 MiB),
# a later run installs them as FlashInfer's AOT modules when the STAMP matches, and builds only
# what is missing:
#   rm -f .jit/flashinfer_jit.tar.xz* && cp <files_at>/flashinfer_jit.tar.xz.part-* .jit/
#
# Needs .whl/ (carried): flashinfer_python-0.6.18.post1 and apache_tvm_ffi (flashinfer's other
# requirements are either on the image or not imported by the kernels used here).
# Outputs: $OUT/gpu_suite.txt and $OUT/gpu_test_log.txt (pytest -m gpu; name set by KVQ_TEST_LOG), $OUT/run_log.txt (everything else),
# $OUT/{bench_decode_attention,xqa_accuracy,bench_model_decode,profile_graph_step}.json,
# $OUT/cpu_suite_log.txt (cpusuite).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG="$OUT/run_log.txt"
export PYTHONUNBUFFERED=1
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-16}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  "$CUDA_HOME/bin/nvcc" --version | tail -2
  if [ -d .whl ]; then  # a later call on the same warm machine may leave .whl behind
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  elif [ ! -d /tmp/site/flashinfer ]; then echo "no .whl carried and nothing in /tmp/site"; exit 1; fi
} 2>&1 | tee -a "$LOG" || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)" 2>&1 | tee -a "$LOG"
stamp() {
  python3 -c "import torch, flashinfer; print('flashinfer', flashinfer.__version__, 'torch', torch.__version__)"
  "$CUDA_HOME/bin/nvcc" --version | tail -1; echo "arch $FLASHINFER_CUDA_ARCH_LIST"
}
jit_parts=$(ls .jit/flashinfer_jit.tar.xz.part-* 2>/dev/null || ls .jit/flashinfer_jit.tar.xz 2>/dev/null)
if [ -n "$jit_parts" ]; then  # one archive, or parts of one (files come back <= 16 MiB each)
  rm -rf /tmp/jit && mkdir -p /tmp/jit && cat $jit_parts | tar -xJf - -C /tmp/jit
  if [ "$(cat /tmp/jit/STAMP)" = "$(stamp)" ]; then
    mkdir -p /tmp/site/flashinfer/data/aot && cp -r /tmp/jit/aot/. /tmp/site/flashinfer/data/aot/
    echo "prebuilt FlashInfer modules from .jit: $(ls /tmp/jit/aot | wc -l)" | tee -a "$LOG"
  else
    echo "ignoring .jit: built for $(tr '\n' ' ' < /tmp/jit/STAMP) not $(stamp | tr '\n' ' ')" | tee -a "$LOG"
  fi
fi
suite_record() {  # $1: the pytest command, $2: its log
  echo "commit ${KVQ_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "torch_kvq sha256 $(python3 scripts/tree_sha.py torch_kvq)"
  echo "date $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "gpu $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  python3 -c "import sys, torch, flashinfer, triton; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('flashinfer', flashinfer.__version__, 'triton', triton.__version__)"
  echo "nvcc $("$CUDA_HOME/bin/nvcc" --version | tail -1)"
  echo "command $1"
  echo "result $(grep -E '^=+ .*(passed|failed|error).* =+$' "$2" | tail -1)"
}
status=0
for step in ${*:-tests attn xqa model}; do
  echo "=== $step $(date -u +%T)" | tee -a "$LOG"
  case $step in
    tests) marks=${KVQ_PYTEST_M:-gpu}
           workers=${KVQ_PYTEST_WORKERS:+-n $KVQ_PYTEST_WORKERS}
           cmd="python3 -m pytest -m \"$marks\" -k \"${KVQ_PYTEST_K:-}\" $workers ${KVQ_GPU_TESTS:-tests/}"
           # KVQ_TESTS_TIMEOUT=<s>: interrupt pytest (SIGINT: it still prints its summary) so the
           # steps after it run within the device's 600 s per call
           ${KVQ_TESTS_TIMEOUT:+timeout -s INT -k 20 $KVQ_TESTS_TIMEOUT} \
           python3 -m pytest -m "$marks" -v -rfEs --durations=20 -p no:cacheprovider --continue-on-collection-errors \
             $workers -k "${KVQ_PYTEST_K:-}" ${KVQ_GPU_TESTS:-tests/} 2>&1 | tee "$OUT/${KVQ_TEST_LOG:-gpu_test_log.txt}"
           rc=${PIPESTATUS[0]}
           suite_record "$cmd" "$OUT/${KVQ_TEST_LOG:-gpu_test_log.txt}" > "$OUT/gpu_suite.txt"
           cat "$OUT/gpu_suite.txt" | tee -a "$LOG"
           (exit $rc) ;;
    rest) # the GPU tests an interrupted ``tests`` step did not reach: its log is $KVQ_REST_LOG and
          # its record $KVQ_REST_RECORD (default: this call's; from an earlier call, carry them in);
          # writes gpu_test_log_rest.txt and gpu_suite.txt for both parts (scripts/gate_rest.py);
          # KVQ_TESTS_TIMEOUT interrupts it as it does ``tests`` (the record then counts what it missed)
          prev_log=${KVQ_REST_LOG:-$OUT/gpu_test_log.txt}; prev_rec=${KVQ_REST_RECORD:-$OUT/gpu_suite.txt}
          python3 scripts/gate_rest.py missing "$prev_log" > "$OUT/tests_not_reached.txt"
          workers=${KVQ_PYTEST_WORKERS:+-n $KVQ_PYTEST_WORKERS}
          if ! grep -q "::" "$OUT/tests_not_reached.txt"; then
            echo "rest: $prev_log reports every GPU test" | tee -a "$LOG"; (exit 0)
          else
            n_rest=$(grep -c '::' "$OUT/tests_not_reached.txt")
            echo "rest: $n_rest GPU tests not reached" | tee -a "$LOG"
            cp "$prev_rec" "$OUT/gpu_suite_part1.txt"
            ${KVQ_TESTS_TIMEOUT:+timeout -s INT -k 20 $KVQ_TESTS_TIMEOUT} \
            python3 -m pytest -m gpu -v -rfEs --durations=20 -p no:cacheprovider $workers \
              $(grep "::" "$OUT/tests_not_reached.txt") 2>&1 | tee "$OUT/gpu_test_log_rest.txt"
            rc=${PIPESTATUS[0]}
            python3 scripts/gate_rest.py merge "$OUT/gpu_suite_part1.txt" "$OUT/gpu_test_log_rest.txt" \
              "python3 -m pytest -m gpu $workers <the $n_rest tests of tests_not_reached.txt>" \
              "$OUT/tests_not_reached.txt" > "$OUT/gpu_suite.txt"
            cat "$OUT/gpu_suite.txt" | tee -a "$LOG"
            (exit $rc)
          fi ;;
    attn) python3 benchmarks/bench_decode_attention.py 2>&1 | tee -a "$LOG" ;;
    xqa) python3 benchmarks/xqa_accuracy.py 2>&1 | tee -a "$LOG" ;;
    model) python3 benchmarks/bench_model_decode.py ${KVQ_MODEL_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    paths) python3 benchmarks/bench_fp8_decode_paths.py ${KVQ_PATHS_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    writes) python3 benchmarks/bench_kv_write.py ${KVQ_WRITES_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    scale) python3 benchmarks/bench_decode_at_scale.py ${KVQ_SCALE_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    ttft) python3 benchmarks/bench_prefill_at_scale.py ${KVQ_TTFT_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    hostprof) python3 benchmarks/profile_graph_step.py ${KVQ_HOSTPROF_ARGS:-} 2>&1 | tee -a "$LOG" ;;
    tc4) for shape in "llama --ctxs 16384 32768" gemma_global; do
           python3 benchmarks/bench_decode_tc4.py $shape ${KVQ_TC4_ARGS:---page 32 --splits 4}
         done 2>&1 | tee -a "$LOG" "$OUT/tc4_per_layer.txt" ;;
    copies) python3 scripts/hf_copies_diff.py ${KVQ_COPIES_ARGS:-tc4_per_token_head --copies FTFZ --attend} \
              2>&1 | grep -v -i warn | tee -a "$LOG" "$OUT/hf_copies.txt" ;;
    runcopies) python3 scripts/runner_copies_diff.py ${KVQ_RUNCOPIES_ARGS:---attend} \
                 2>&1 | grep -v -i warn | tee -a "$LOG" "$OUT/runner_copies.txt" ;;
    diag) diag() { local name=$1; shift
                   timeout -s INT "${KVQ_DIAG_TIMEOUT:-420}" python3 "$@" 2>&1 | grep -v -i warn > "$OUT/diag_$name.txt"
                   echo "rc ${PIPESTATUS[0]} $(date -u +%T)" >> "$OUT/diag_$name.txt"; }
          rcd="scripts/runner_copies_diff.py --copies FF --trace"
          diag int4_eager $rcd int4_per_token_head --eager & diag int4_eager_poison $rcd int4_per_token_head --eager --poison &
          diag int4 $rcd int4_per_token_head & diag int4_poison $rcd int4_per_token_head --poison &
          diag tc4 $rcd tc4_per_token_head &
          diag eager -m pytest -m gpu -q -rfE -p no:cacheprovider tests/attention/test_graph_runner.py -k eager &
          [ -n "${KVQ_DIAG_HF:-}" ] && diag hf scripts/hf_copies_diff.py tc4_per_token_head --copies FTFZ --attend &
          wait
          for f in "$OUT"/diag_*.txt; do echo "##### $f"; tail -c 1200 "$f"; done | tee -a "$LOG" ;;
    jitpack) jit=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_JIT_DIR)")
             rm -rf /tmp/jitpack && mkdir -p /tmp/jitpack/aot && stamp > /tmp/jitpack/STAMP
             for so in "$jit"/*/*.so /tmp/site/flashinfer/data/aot/*/*.so; do
               [ -f "$so" ] || continue
               dst=/tmp/jitpack/aot/$(basename "$(dirname "$so")"); mkdir -p "$dst" && cp "$so" "$dst/"
             done
             du -sh /tmp/jitpack/aot | tee -a "$LOG"
             # in parts of 15 MiB: a file over 16 MiB does not come back from the device
             tar -C /tmp/jitpack -cf - STAMP aot | xz -T0 -6 \
               | split -b 15M -d -a 1 - "$OUT/flashinfer_jit.tar.xz.part-"
             ls -la "$OUT"/flashinfer_jit.tar.xz.part-* | tee -a "$LOG" ;;
    cachesize) # what carrying the compile caches would cost (what they buy: docs/contributing.md):
               # Triton's (our kernels) and Inductor's (its graphs and kernels), whole, and what a
               # cache hit reads (cubin, json, best_config, fxgraph/, aotautograd/) as xz
               for d in "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" \
                        "$(python3 -c 'from torch._inductor.runtime.cache_dir_utils import cache_dir; print(cache_dir())')"; do
                 [ -d "$d" ] || { echo "$d: no such folder"; continue; }
                 (cd "$d" && find . -type f \( -name '*.cubin' -o -name '*.json' -o -name '*.best_config' \
                   -o -path './fxgraph/*' -o -path './aotautograd/*' \) -print0 \
                   | tar --null -T - -cf -) | timeout 60 xz -T0 -6 > /tmp/cachesize.xz
                 [ $? = 124 ] && stopped="+ (xz stopped at 60 s)" || stopped=""
                 echo "$d: $(du -sh "$d" | cut -f1), $(find "$d" -type f | wc -l) files, a hit's files as xz $(stat -c %s /tmp/cachesize.xz)$stopped bytes"
               done 2>&1 | tee -a "$LOG" ;;
    eval) . scripts/join_models.sh && join_models "$LOG" || { status=1; continue; }
          TORCH_KVQ_CORPUS=${TORCH_KVQ_CORPUS:-/tmp/xfer/corpus} TORCH_KVQ_CACHE=/tmp/kvqcache TORCH_KVQ_PROGRESS=1 \
            python3 -m torch_kvq.cli eval ${KVQ_EVAL_ARGS:-} --json "$OUT/eval_gpu.json" \
            --plot "$OUT/eval_gpu.png" 2>&1 | tee -a "$LOG" "$OUT/eval_gpu.txt" ;;
    cmd) bash -c "$KVQ_CMD" 2>&1 | tee -a "$LOG" ;;  # any command after the set-up
    cpusuite) CUDA_VISIBLE_DEVICES= python3 -m pytest -q -m "not gpu and not slow" -p no:cacheprovider \
                -n "${KVQ_CPU_WORKERS:-14}" -rfEs tests/ 2>&1 | tail -40 | tee "$OUT/cpu_suite_log.txt" ;;
    *) echo "unknown step $step (expected tests, rest, attn, xqa, model, paths, writes, scale, ttft, hostprof, tc4, copies, runcopies, diag, cachesize, eval, cpusuite, cmd, jitpack)" | tee -a "$LOG"; status=2; continue ;;
  esac
  rc=${PIPESTATUS[0]}
  echo "=== $step exit $rc $(date -u +%T)" | tee -a "$LOG"
  [ "$rc" -ne 0 ] && status=1
done
exit $status
