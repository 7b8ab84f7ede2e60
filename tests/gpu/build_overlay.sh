#!/bin/bash
# Build the patched sglang files of one pin (snapshot/sglang-PIN + patches/PIN/series +
# ddtree_utils.py and the ddtree_*.py modules the build imports, as committed at REV, default
# HEAD) into OUT/srt, the same files as `ddtree-deploy patch` builds, ready to be copied over an
# installed sglang package of that version:
#   cp -r OUT/srt/. SITE/sglang/srt/
# Usage: [PIN=0.5.13.post1] tests/gpu/build_overlay.sh [OUT] [REV]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/.gpu/overlay}
rev=${2:-HEAD}
pin=${PIN:-0.5.13.post1}
src=$(mktemp -d); trap 'rm -rf "$src"' EXIT
# ddtree_utils.py and the sibling modules a build may ship (deploy/build/series.py SHIPPED_MODULES)
mods=$(git -C "$root" ls-tree --name-only "$rev" -- ddtree_utils.py ddtree_triton.py ddtree_serving.py ddtree_budget.py)
git -C "$root" archive "$rev" snapshot patches $mods | tar -x -C "$src"
rm -rf "$out"; mkdir -p "$out"
cp -r "$src/snapshot/sglang-$pin/srt" "$out/"
{ grep -v '^\s*#' "$src/patches/$pin/series" || true; } | { grep -v '^\s*$' || true; } | while read -r p; do
  (cd "$out" && patch -p1 -s --no-backup-if-mismatch -F0 < "$src/patches/$pin/$p")
done
cp "$src/ddtree_utils.py" "$out/srt/speculative/ddtree_utils.py"
# as deploy/build.ship_modules: a sibling ships when a file of the overlay imports it by name
for m in ddtree_serving ddtree_budget ddtree_triton; do  # triton last: ddtree_utils (copied) imports it
  if [ -f "$src/$m.py" ] && grep -rqE "^[[:space:]]*(from|import)[[:space:]].*\b$m\b|^[[:space:]]+$m,?\$" --include=*.py "$out/srt"; then
    cp "$src/$m.py" "$out/srt/speculative/$m.py"
  fi
done
git -C "$root" rev-parse "$rev" > "$out/BUILD-REV"
echo "overlay: $out (sglang $pin, $(cat "$out/BUILD-REV"))"
