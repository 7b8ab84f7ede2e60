#!/bin/bash
# One device call (issue 27): train the named train_tiny_pair.py presets side by side on the GPU,
# keep the one with the best offline DFLASH acceptance (tokens per round on held-out prompts,
# T = 0), and lift it into the Qwen3-8B shape (bench/lift_pair.py) at LIFTED for the servers of the
# next call on the same warm machine.
# Usage (repo root, on the GPU machine): bash bench/lift_train.sh OUT [PRESETS] [TIME_LIMIT_S] [LIFTED]
# OUT gets train-PRESET.log per preset, recipes.json (every preset's eval.json + training stages and
# the choice), lift.log and pair-small.tgz (the chosen small pair, for --pair / a later lift).
set -uo pipefail
out=${1:?usage: bench/lift_train.sh OUT [PRESETS] [TIME_LIMIT_S] [LIFTED]}
presets=${2:-lift-a,lift-b,lift-c}; tl=${3:-330}; lifted=${4:-/tmp/lifted}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
pids=()
for p in ${presets//,/ }; do
  rm -rf "/tmp/pair-$p"
  python3 "$here/train_tiny_pair.py" --out "/tmp/pair-$p" --preset "$p" --time-limit "$tl" > "$out/train-$p.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
best=$(python3 - "$presets" "$out/recipes.json" <<'PY'
import json, sys
res, best, acc = {}, None, -1.0
for p in sys.argv[1].split(","):
    try:
        ev = json.load(open(f"/tmp/pair-{p}/eval.json"))
        tl = json.load(open(f"/tmp/pair-{p}/train_log.json"))
    except OSError as exc:
        res[p] = {"error": str(exc)}
        continue
    res[p] = {"eval": ev, "stages": tl["stages"], "truncated": tl["truncated"], "seconds": tl["seconds"], "args": tl["args"]}
    a = ev["dflash"]["measured_accept"]
    print(f"{p}: DFLASH offline accept {a}, " + ", ".join(f"{k} {v['measured_accept']}" for k, v in ev.items()
          if isinstance(v, dict) and k.startswith("ddtree")), file=sys.stderr)
    if a > acc:
        best, acc = p, a
json.dump({"best": best, "recipes": res}, open(sys.argv[2], "w"), indent=1)
print(best or "")
PY
)
[ -n "$best" ] || { echo "no preset finished training" >&2; exit 1; }
echo "chosen: $best" >&2
rm -rf "$lifted"
python3 "$here/lift_pair.py" --pair "/tmp/pair-$best" --out "$lifted" --device cuda 2>&1 | tee "$out/lift.log"
rc=${PIPESTATUS[0]}
tar -czf "$out/pair-small.tgz" -C /tmp "pair-$best/target" "pair-$best/draft" "pair-$best/prompts.jsonl" \
    "pair-$best/eval.json" "pair-$best/split.json" "pair-$best/train_log.json"
du -sh "$lifted"/* 2>/dev/null
exit "$rc"
