#!/bin/bash
# One 0.5.16 site archive that holds xgrammar too, inside the device's 64 MiB carry limit, so the
# 0.5.16 matrix is one device call instead of two (docs/GPU_RUN.md, docs/TESTING.md ninth session).
# Usage: tests/gpu/pack_site016.sh SITE_TAR_XZ XGRAMMAR_WHEEL OUT_TAR_XZ
#   e.g. tests/gpu/pack_site016.sh .gpu/wh016/sglang-site.tar.xz .gpu/xgrammar/xgrammar-*.whl .gpu/w16x/site.tar.xz
# What is left out (none of it is imported by the server): xgrammar's static library
# lib/libxgrammar.a (65 MB) and the debug info of its bindings (50 of 53 MB), and jedi (IPython's
# optional completer, 33 MB). The result was 48 MB for sglang 0.5.16 + xgrammar 0.2.1.
set -euo pipefail
[ $# -eq 3 ] || { sed -n 2,8p "$0" >&2; exit 2; }
site=$(realpath "$1"); wheel=$(realpath "$2"); out=$3
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/site" "$tmp/whl"
tar -xJf "$site" -C "$tmp/site"
python3 -m zipfile -e "$wheel" "$tmp/whl"
cp -r "$tmp/whl"/. "$tmp/site/"
rm -f "$tmp/site/xgrammar/lib/libxgrammar.a"
find "$tmp/site/xgrammar" -name '*.so' -exec strip --strip-debug {} +
rm -rf "$tmp/site/jedi" "$tmp/site"/jedi-*.dist-info
mkdir -p "$(dirname "$out")"
(cd "$tmp/site" && tar -cf - . | xz -9 -T0 > "$tmp/out.tar.xz")
mv "$tmp/out.tar.xz" "$out"
ls -la "$out"
size=$(stat -c %s "$out")
[ "$size" -lt $((60 * 1024 * 1024)) ] || { echo "warning: $out is $size bytes: with the overlay it may not fit the 64 MiB carry" >&2; }
