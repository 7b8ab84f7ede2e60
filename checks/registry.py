"""The ordered list of quality gates and the loop that runs them."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable

from ..deploy.build.buildinfo import GATES_RECORD, load_build, record_verdict
from ..deploy.errors import DDTreeDeployError, UsageError
from . import (
    gate_compile,
    gate_lint,
    gate_roundtrip,
    gate_series,
    gate_smoke,
    gate_snapshot,
    gate_unit,
)
from .base import FAIL, Context, GateResult, Step

GATES = (gate_snapshot, gate_series, gate_roundtrip, gate_compile, gate_lint, gate_smoke, gate_unit)


def _match(names: list[str]) -> list:
    chosen = []
    for n in names:
        hits = [g for g in GATES if n == str(g.NUMBER) or g.NAME.startswith(n.lower())]
        if not hits:
            known = ", ".join(f"{g.NUMBER}={g.NAME}" for g in GATES)
            raise UsageError(f"unknown gate {n!r} (known: {known})")
        chosen += [g for g in hits if g not in chosen]
    return chosen


def select(names: list[str] | None = None, skip: list[str] | None = None) -> list:
    """The gates to run: all, or those named by number or (a prefix of) name, minus `skip`."""
    chosen = _match(names) if names else list(GATES)
    skipped = _match(skip) if skip else []
    return sorted((g for g in chosen if g not in skipped), key=lambda g: g.NUMBER)


def run_gates(
    ctx: Context, gates=None, *, on_start: Callable[[object], None] | None = None, step: Step = lambda _msg: None
) -> list[GateResult]:
    """Run every gate (each independent of the others' results); a raised error is a failure."""
    results = []
    for gate in gates or GATES:
        if on_start:
            on_start(gate)
        t0 = time.monotonic()
        try:
            result = gate.run(ctx, step)
        except DDTreeDeployError as exc:
            result = GateResult(
                gate.NUMBER, gate.NAME, FAIL, 0, exc.message, exc.detail.splitlines()[-20:] if exc.detail else []
            )
        except Exception as exc:  # a crashing gate must not hide the others
            result = GateResult(
                gate.NUMBER, gate.NAME, FAIL, 0, f"internal error: {exc!r}", traceback.format_exc().splitlines()[-10:]
            )
        result.seconds = time.monotonic() - t0
        results.append(result)
    return results


def record_gates(build_dir, results: list[GateResult]) -> dict | None:
    """Merge these gate results into the build's GATES.json (results of other gates are kept
    while the build id is the same). Returns the record, or None when there is no valid build."""
    try:
        build = load_build(build_dir)
    except DDTreeDeployError:
        return None
    path = build.root / GATES_RECORD
    rec = {"build_id": build.build_id, "gates": {}}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            if old.get("build_id") == build.build_id:
                rec["gates"] = dict(old.get("gates", {}))
        except ValueError:
            pass
    for r in results:
        rec["gates"][str(r.number)] = {"name": r.name, "status": r.status, "summary": r.summary}
    rec["ok"] = record_verdict(rec, build.build_id)[0]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return rec
