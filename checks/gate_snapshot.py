"""Gate 1: the snapshot matches its manifest, byte for byte."""

from __future__ import annotations

from ..deploy.build import snapshot as snap
from .base import FAIL, PASS, Context, GateResult, Step

NUMBER, NAME = 1, "snapshot"


def run(ctx: Context, step: Step) -> GateResult:
    snap_dir = ctx.inputs.snapshot_dir
    step(f"hashing {snap_dir}")
    manifest = snap.load_manifest(snap_dir)
    problems = snap.find_problems(snap_dir, manifest)
    n = len(manifest.files)
    if problems:
        return GateResult(
            NUMBER,
            NAME,
            FAIL,
            n,
            f"{len(problems)} file(s) differ from the manifest",
            [p.describe(snap_dir) for p in problems],
        )
    return GateResult(NUMBER, NAME, PASS, n, f"{n} files match sglang {manifest.sglang_version}")
