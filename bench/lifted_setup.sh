# Sourced by the device scripts (bench/lifted_auto_run.sh, bench/lifted_profile_run.sh,
# bench/f32_greedy_run.sh).
#   device_setup OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR
# extracts the SGLang site into /tmp/site with the overlay on top and the small trained pair into
# /tmp/px, and sets: small (the small pair's folder), pin (PIN, default 0.5.16), common (the
# server flags of every device run; PREFILL_GRAPHS below) and graph_bs (the pin's name of the decode-graph batch flag);
# PYTHONPATH is /tmp/site.
#   lifted_setup OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR
# does the same, then lifts the small pair into /tmp/lifted (Qwen3-8B shape).
# Both return non-zero on a failed step.
device_setup() {
  local out=$1 site=$2 pair_tar=$3 overlay=$4
  mkdir -p "$out" /tmp/site /tmp/px
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  tar -xJf "$site" -C /tmp/site && tar -xJf "$pair_tar" -C /tmp/px && cp -r "$overlay/srt/." /tmp/site/sglang/srt/ || return 1
  small=$(ls -d /tmp/px/*/ | head -1)
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  pin_flags
}

lifted_setup() {
  local out=$1 here
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  device_setup "$@" || return 1
  python3 "$here/lift_pair.py" --pair "$small" --out /tmp/lifted --device cuda > "$out/lift.log" 2>&1 || { tail "$out/lift.log"; return 1; }
  echo "lifted $small at $(date +%T)"
}

# pin (PIN, default 0.5.16), common and graph_bs as device_setup sets them (no GPU needed).
pin_flags() {
  pin=${PIN:-0.5.16}
  common="--skip-tokenizer-init --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.9 --random-seed 0"
  # Prefill runs eager in every run up to the thirteenth session (as on 0.5.13.post1, where the
  # piecewise graph was turned off); PREFILL_GRAPHS=1 keeps 0.5.16's default prefill graph
  # (breakable), for 1, 2, 4, ... PREFILL_GRAPH_MAX tokens (default 512). The default sizes start
  # at 4 and a replay may pad at most 2x, so the 1-token prefill of a prompt already in the radix
  # cache (every timed request of a level) ran eager: 50 of 52 eager prefills in the fourteenth
  # session's call 2.
  if [ "$pin" = 0.5.16 ]; then graph_bs=--cuda-graph-max-bs-decode
    if [ "${PREFILL_GRAPHS:-0}" = 1 ]; then
      local max=${PREFILL_GRAPH_MAX:-512} sizes="" t=1
      while [ "$t" -le "$max" ]; do sizes+=" $t"; t=$((t * 2)); done
      common+=" --cuda-graph-max-bs-prefill $max --cuda-graph-bs-prefill$sizes"
    else common+=" --cuda-graph-backend-prefill disabled"; fi
  else common+=" --disable-piecewise-cuda-graph"; graph_bs=--cuda-graph-max-bs; fi
}
