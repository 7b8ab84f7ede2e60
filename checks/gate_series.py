"""Gate 2: every patch has a valid DEP-3 header and applies in order with zero fuzz and no offset."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ..deploy.build.build import assemble, prepare
from ..deploy.build.series import patch_files
from .base import PASS, Context, GateResult, Step

NUMBER, NAME = 2, "series"


def run(ctx: Context, step: Step) -> GateResult:
    step("parsing the series and headers")
    p = prepare(ctx.inputs)  # headers, names, order, snapshot integrity
    files = {c.path for e in p.series.entries for c in patch_files(e.path)}
    work = Path(tempfile.mkdtemp(prefix="ddtree-gate-series-"))
    try:
        assemble(p, work, allow_offset=False, with_utils=False, on_patch=lambda e: step(f"applying {e.name}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = len(p.series.entries)
    return GateResult(
        NUMBER,
        NAME,
        PASS,
        len(files),
        f"{n} patch(es) apply exactly, headers valid" if n else "empty series (snapshot only)",
    )
