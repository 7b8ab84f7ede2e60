#!/usr/bin/env python3
"""Gate SGLang's MultiPlatformOp dispatch for the float32 greedy check (bench/f32_greedy_run.sh).

Neither pin's sgl_kernel RMSNorm takes float32, so a float32 server stops at graph capture. With
this gate in ``sglang/srt/layers/utils/multi_platform.py`` (a copy of the site on the GPU machine,
never a shipped build), a server started with ``DDTREE_NATIVE_OPS=1`` runs every MultiPlatformOp
(RMSNorm, SiluAndMul, RoPE, ...) through its ``forward_native``, the torch implementation SGLang
uses on CPU; other servers are unchanged.

    python3 bench/native_ops_gate.py /tmp/site/sglang/srt/layers/utils/multi_platform.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ANCHOR = "    def dispatch_forward(self):\n"
GATE = ("        if __import__('os').environ.get('DDTREE_NATIVE_OPS') == '1':\n"
        "            return self.forward_native\n")


def gate(source: str) -> str:
    """``source`` with the gate as the first statement of ``dispatch_forward``; idempotent."""
    if ANCHOR + GATE in source:
        return source
    if source.count(ANCHOR) != 1:
        raise ValueError(f"expected one `{ANCHOR.strip()}` in multi_platform.py, found {source.count(ANCHOR)}")
    return source.replace(ANCHOR, ANCHOR + GATE)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        path.write_text(gate(path.read_text()))
    except (OSError, ValueError) as exc:
        print(f"native_ops_gate: {path}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
