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

# pin (PIN, default 0.5.16), common and graph_bs as device_setup sets them (no GPU needed), from
# bench/pin_flags.py (the flags of every device script, per pin). Prefill runs eager in every run
# up to the thirteenth session; PREFILL_GRAPHS=1 keeps 0.5.16's own prefill graph (breakable) for
# 1, 2, 4, ... PREFILL_GRAPH_MAX tokens (default 512; 0.5.13.post1 keeps prefill eager).
pin_flags() {
  local max=0 assign
  [ "${PREFILL_GRAPHS:-0}" = 1 ] && max=${PREFILL_GRAPH_MAX:-512}
  assign=$(python3 "$(dirname "${BASH_SOURCE[0]}")/pin_flags.py" --shell --pin "${PIN:-0.5.16}" --prefill-graph-max "$max") || return 1
  eval "$assign"
}
