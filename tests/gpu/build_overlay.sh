#!/bin/bash
# Build the patched sglang files (snapshot + patches/series + ddtree_utils.py) into OUT/srt,
# ready to be copied over an installed sglang package: cp -r OUT/srt/. SITE/sglang/srt/
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/.gpu/overlay}
rm -rf "$out"; mkdir -p "$out"
cp -r "$root/snapshot/sglang-0.5.13.post1/srt" "$out/"
grep -v '^\s*#' "$root/patches/series" | grep -v '^\s*$' | while read -r p; do
  (cd "$out" && patch -p1 -s --no-backup-if-mismatch -F0 < "$root/patches/$p")
done
cp "$root/ddtree_utils.py" "$out/srt/speculative/ddtree_utils.py"
echo "overlay: $out"
