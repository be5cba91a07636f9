# Sourced by gpu_run.sh (eval) and gpu_eval_rows.sh: join_models LOG joins the trained models'
# GGUF parts carried into /tmp/xfer (NAME.p0, NAME.p1, ...) into /tmp/models/NAME and checks
# them against /tmp/xfer/SHA256SUMS; non-zero when a sum does not match.
join_models() {
  mkdir -p /tmp/models && cp /tmp/xfer/SHA256SUMS /tmp/models/ || return 1
  for f in $(awk '{print $2}' /tmp/models/SHA256SUMS); do
    [ -f /tmp/models/$f ] || cat $(ls /tmp/xfer/$f.p* | sort) > /tmp/models/$f
  done
  (cd /tmp/models && sha256sum -c SHA256SUMS) 2>&1 | tee -a "$1"
  return ${PIPESTATUS[0]}
}
