"""Gate 3: the build is current, and reverse-applying the series to it gives the snapshot back."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ..deploy.build import snapshot as snap
from ..deploy.build.build import prepare, shipped_sources, tree_files
from ..deploy.build.buildinfo import METADATA_NAMES, sha256_file
from ..deploy.build.series import SHIPPED_FILES, SHIPPED_UTILS, apply_series
from .base import FAIL, PASS, Context, GateResult, Step

NUMBER, NAME = 3, "round trip"


def staleness(ctx: Context, info, p) -> list[str]:
    """Why the build does not correspond to the current inputs ([] when it does)."""
    why = []
    if info.series_sha256 != p.series.sha256():
        why.append("the series or a patch changed since the build")
    if info.snapshot_manifest_sha256 != snap.manifest_sha256(ctx.inputs.snapshot_dir):
        why.append("the snapshot manifest changed since the build")
    for source, rel in shipped_sources(ctx.inputs):  # ddtree_utils.py always, the others if shipped
        shipped = info.files.get(rel)
        if shipped is None and rel != SHIPPED_UTILS:
            continue
        if shipped is None or not source.is_file() or shipped.sha256 != sha256_file(source):
            why.append(f"{source.name} changed since the build")
    return why


def run(ctx: Context, step: Step) -> GateResult:
    step("loading the build")
    info = ctx.build()
    p = prepare(ctx.inputs)
    stale = staleness(ctx, info, p)
    if stale:
        return GateResult(NUMBER, NAME, FAIL, len(info.files), "build is stale: run `ddtree-deploy patch`", stale)
    work = Path(tempfile.mkdtemp(prefix="ddtree-gate-roundtrip-")) / "tree"
    try:
        shutil.copytree(info.root, work)
        for name in METADATA_NAMES:
            (work / name).unlink(missing_ok=True)
        for rel in SHIPPED_FILES:
            (work / rel).unlink(missing_ok=True)
        apply_series(
            work,
            p.series.entries,
            reverse=True,
            allow_offset=True,
            on_patch=lambda e: step(f"reverse-applying {e.name}"),
        )
        step("comparing with the snapshot")
        got, want = set(tree_files(work)), set(p.manifest.files)
        details = [f"{rel}: left over after reversing the series" for rel in sorted(got - want)]
        details += [f"{rel}: missing after reversing the series" for rel in sorted(want - got)]
        details += [
            f"{rel}: differs from the snapshot after reversing the series"
            for rel in sorted(got & want)
            if sha256_file(work / rel) != p.manifest.files[rel]
        ]
    finally:
        shutil.rmtree(work.parent, ignore_errors=True)
    if details:
        return GateResult(NUMBER, NAME, FAIL, len(want), f"{len(details)} file(s) do not round-trip", details)
    return GateResult(NUMBER, NAME, PASS, len(want), f"build {info.build_id} reverses to the snapshot byte for byte")
