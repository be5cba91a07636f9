#!/usr/bin/env bash
# One warm H200, several device calls in a row: long jobs run in the background (setsid, so they
# outlive the call that starts them) while later calls carry the trained models' GGUF parts in.
# Each call must follow the last within the machine's 30 s idle window, or all of this is lost.
#
#   bash scripts/gpu_streak.sh gate COMMIT     # call 1 (carry .whl, .xfer): the GPU gate
#                                              # (gpu_run.sh tests jitpack cachesize) from a copy of the tree
#   bash scripts/gpu_streak.sh part            # calls 2..N (carry .xfer or .x2, .x3...): stash
#                                              # the carried parts
#   bash scripts/gpu_streak.sh evalrows        # kvq eval rows (gpu_eval_rows.sh) in the background
#   bash scripts/gpu_streak.sh job NAME CMD    # CMD in the background in the gate's copy of the tree
#                                              # (copied now if there is none): benchmarks first
#   bash scripts/gpu_streak.sh side TAR CMD    # another tree (a .tar.gz carried in .xfer/) running
#                                              # CMD in the background (a branch's GPU tests)
#   bash scripts/gpu_streak.sh wait S [JOB..]  # wait up to S seconds for the jobs, then bring
#                                              # back what they wrote (one .tar.gz per job) in $OUT
#
# Jobs write to /tmp/streak/<job>/ (their $OUT) and touch /tmp/streak/<job>.done when finished.
# Every call prints each job's state and the last lines of its log (STREAK_TAIL_LINES, 4, of the
# last STREAK_TAIL_BYTES, 600).
set -uo pipefail
cd "$(dirname "$0")/.."
S=/tmp/streak
mkdir -p $S /tmp/xfer
for d in .xfer .x[0-9]*; do  # the parts this call carried (.xfer, .x1, .x2...; gpu_run.sh eval)
  [ -d "$d" ] && cp -r "$d/." /tmp/xfer/
done

copy_tree() {  # this call's tree into /tmp/gate, without the carried parts
  mkdir -p /tmp/gate && tar --exclude=./.xfer --exclude="./.x[0-9]*" -cf - . | tar -xf - -C /tmp/gate
}

launch() {  # $1: job name, $2: folder to run in, rest: the command
  local job=$1 dir=$2; shift 2
  mkdir -p $S/$job
  (cd "$dir" && OUT=$S/$job setsid nohup bash -c "$*; touch $S/$job.done" \
    > $S/$job/nohup.log 2>&1 < /dev/null &)
  echo "started $job in $dir: $*"
}

report() {
  for d in $S/*/; do
    job=$(basename "$d")
    state=running; [ -f $S/$job.done ] && state=done
    echo "--- $job: $state ($(date -u +%T))"
    tail -c "${STREAK_TAIL_BYTES:-600}" "$d/nohup.log" 2>/dev/null | tr '\r' '\n' \
      | tail -"${STREAK_TAIL_LINES:-4}"
  done
  ls /tmp/xfer | tr '\n' ' '; echo
}

case ${1:-} in
  gate)
    rm -rf /tmp/gate && copy_tree
    launch gate /tmp/gate "KVQ_COMMIT=$2 KVQ_PYTEST_WORKERS=${KVQ_PYTEST_WORKERS:-4} bash scripts/gpu_run.sh tests jitpack cachesize" ;;
  part) ;;
  job)
    [ -d /tmp/gate/torch_kvq ] || copy_tree
    launch "$2" /tmp/gate "$3" ;;
  evalrows)
    launch evalrows /tmp/gate "bash scripts/gpu_eval_rows.sh" ;;
  side)
    rm -rf /tmp/side && mkdir -p /tmp/side && tar -xzf "/tmp/xfer/$2" -C /tmp/side
    cp -r /tmp/gate/.whl /tmp/side/ 2>/dev/null
    launch side /tmp/side "$3" ;;
  wait)
    secs=$2; shift 2
    end=$((SECONDS + secs))
    for job in "$@"; do
      while [ ! -f $S/$job.done ] && [ $SECONDS -lt $end ]; do sleep 5; done
    done
    report
    for job in "$@"; do  # FlashInfer's module parts come back as they are (15 MiB each)
      [ -f $S/$job.done ] || continue
      tar -czf "$OUT/$job.tar.gz" --exclude='flashinfer_jit.tar.xz.part-*' -C $S "$job"
      cp $S/$job/flashinfer_jit.tar.xz.part-* "$OUT/" 2>/dev/null
      echo "$job -> $(cd "$OUT" && ls | tr '\n' ' ')"
    done
    exit 0 ;;
  *) echo "usage: gpu_streak.sh gate COMMIT | part | evalrows | job NAME CMD | side TAR CMD | wait S [JOB..]"; exit 2 ;;
esac
report
