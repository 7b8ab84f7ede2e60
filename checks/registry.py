"""The ordered list of quality gates and the loop that runs them."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

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
from .base import FAIL, PASS, Context, GateResult, Step

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


# -- reuse of passing results --------------------------------------------------------------------
# A gate that declares `inputs(ctx) -> (files, strings)` (the slow ones: 6 and 7) is not run again
# while the sha256 of those files' bytes and strings equals the key of its last pass. Only passes
# are reused; any change of an input, a failure, or `--fresh` runs it. The record is one JSON file,
# `.cache/gate-results.json` in the repository, or $DDTREE_GATE_CACHE (`off`: never reuse).
GATE_CACHE_ENV = "DDTREE_GATE_CACHE"


def cache_path(ctx: Context) -> Path | None:
    where = os.environ.get(GATE_CACHE_ENV, "")
    if where.lower() == "off":
        return None
    return Path(where) if where else ctx.repo_root / ".cache" / "gate-results.json"


def input_key(gate, ctx: Context) -> str | None:
    """sha256 of what decides the gate's result, or None when it declares nothing (always runs)."""
    if not hasattr(gate, "inputs"):
        return None
    files, strings = gate.inputs(ctx)
    h = hashlib.sha256(f"gate {gate.NUMBER} {gate.NAME} {ctx.version}\n".encode())
    for s in strings:
        h.update(f"{s}\n".encode())
    for f in files:
        f = Path(f)
        h.update(f"{f}\0".encode())
        h.update(f.read_bytes() if f.is_file() else b"<absent>")
    return h.hexdigest()


def _load_cache(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}  # a damaged record only costs a rerun


def _save_cache(path: Path | None, cache: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def run_gates(
    ctx: Context,
    gates=None,
    *,
    on_start: Callable[[object], None] | None = None,
    step: Step = lambda _msg: None,
    reuse: bool = True,
) -> list[GateResult]:
    """Run every gate (each independent of the others' results); a raised error is a failure.
    With `reuse`, a gate whose inputs are unchanged since its last pass is not run again: its
    result comes back with `reused_from` set (the time it ran)."""
    results = []
    path = cache_path(ctx) if reuse else None
    cache = _load_cache(path)
    for gate in gates or GATES:
        if on_start:
            on_start(gate)
        t0 = time.monotonic()
        slot = f"{ctx.version}/{gate.NUMBER}"
        try:
            key = input_key(gate, ctx) if path is not None else None
        except Exception:  # inputs it cannot read: the gate itself will say what is wrong
            key = None
        hit = cache.get(slot) if key else None
        if hit and hit.get("key") == key:
            results.append(GateResult(gate.NUMBER, gate.NAME, PASS, hit.get("files", 0), hit.get("summary", ""),
                                      reused_from=hit.get("at", "?")))
            continue
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
        if key and result.status == PASS:
            at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            cache[slot] = {"key": key, "files": result.files, "summary": result.summary, "at": at}
            _save_cache(path, {**_load_cache(path), slot: cache[slot]})
        elif key:
            cache.pop(slot, None)
            _save_cache(path, {k: v for k, v in _load_cache(path).items() if k != slot})
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
