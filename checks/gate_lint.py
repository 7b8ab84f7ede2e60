"""Gate 5: pyflakes-class lint (ruff --select F) of the lines the build changes.

Upstream noise does not count: a diagnostic fails the gate only when it sits on a line the series
added or changed, or when the build has more diagnostics of that kind (code and message) than the
pristine file (e.g. an import left unused by a patch). Files added by the build are linted in full.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from ..deploy.build.series import run_git
from ..deploy.errors import ConfigError
from .base import FAIL, PASS, Context, GateResult, Step

NUMBER, NAME = 5, "lint (changed lines)"
_HUNK_RE = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", re.MULTILINE)


def ruff_exe() -> str:
    local = Path(sys.executable).parent / "ruff"
    exe = str(local) if local.is_file() else shutil.which("ruff")
    if not exe:
        raise ConfigError("ruff not found: install the test extras (pip install -e .[test])")
    return exe


def ruff(paths: list[Path]) -> dict[str, list[dict]]:
    """{resolved path: [diagnostic]} for `ruff check --select F`, ignoring any project config."""
    if not paths:
        return {}
    proc = subprocess.run(
        [
            ruff_exe(),
            "check",
            "--isolated",
            "--no-cache",
            "--select",
            "F",
            "--target-version",
            "py310",
            "--output-format",
            "json",
            "--exit-zero",
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise ConfigError(f"ruff failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    out: dict[str, list[dict]] = {}
    for d in json.loads(proc.stdout or "[]"):
        out.setdefault(str(Path(d["filename"]).resolve()), []).append(d)
    return out


def changed_lines(old: Path, new: Path) -> set[int]:
    """Line numbers of `new` that differ from `old` (git diff -U0 hunks)."""
    proc = run_git(["diff", "--no-index", "--no-color", "-U0", "--", str(old), str(new)], new.parent)
    lines: set[int] = set()
    for m in _HUNK_RE.finditer(proc.stdout):
        start, count = int(m.group(1)), int(m.group(2) or 1)
        lines.update(range(start, start + count))
        if count == 0:  # pure deletion: blame the line after it
            lines.add(start + 1)
    return lines


def _key(d: dict) -> tuple[str, str]:
    return d.get("code") or "?", d["message"]


def run(ctx: Context, step: Step) -> GateResult:
    info = ctx.build()
    snap_dir = Path(ctx.inputs.snapshot_dir)
    touched = sorted(r for r, f in info.files.items() if r.endswith(".py") and f.sha256 != f.pristine_sha256)
    step(f"ruff on {len(touched)} changed file(s)")
    new_diags = ruff([info.root / r for r in touched])
    old_diags = ruff([snap_dir / r for r in touched if info.files[r].pristine_sha256])
    problems = []
    for rel in touched:
        diags = new_diags.get(str((info.root / rel).resolve()), [])
        if info.files[rel].pristine_sha256 is None:
            flagged = diags
        else:
            old = snap_dir / rel
            extra = Counter(map(_key, diags)) - Counter(map(_key, old_diags.get(str(old.resolve()), [])))
            lines = changed_lines(old, info.root / rel)
            flagged = []
            for d in diags:
                if d["location"]["row"] in lines or extra[_key(d)] > 0:
                    if d["location"]["row"] not in lines:
                        extra[_key(d)] -= 1
                    flagged.append(d)
        problems += [
            f"{rel}:{d['location']['row']}:{d['location']['column']}: {d.get('code')} {d['message']}"
            for d in sorted(flagged, key=lambda d: (d["location"]["row"], d["location"]["column"]))
        ]
    if problems:
        return GateResult(NUMBER, NAME, FAIL, len(touched), f"{len(problems)} new diagnostic(s)", problems)
    return GateResult(NUMBER, NAME, PASS, len(touched), "no new pyflakes-class diagnostics")
