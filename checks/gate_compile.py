"""Gate 4: `py_compile` of every shipped Python file, with each Python the hosts may run
(the local one always; python3.12 where present; more via --python)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

from .base import FAIL, PASS, Context, GateResult, Step

NUMBER, NAME = 4, "py_compile"

_COMPILE = r"""
import os, py_compile, sys, tempfile
root, rels = sys.argv[1], sys.argv[2:]
with tempfile.TemporaryDirectory() as out:
    for i, rel in enumerate(rels):
        try:
            py_compile.compile(os.path.join(root, rel), cfile=os.path.join(out, f"{i}.pyc"), dfile=rel, doraise=True)
        except py_compile.PyCompileError as exc:
            print(f"{rel}: {exc.exc_type_name}: {exc.exc_value}")
"""
_VERSION = "import sys; print('%d.%d.%d' % sys.version_info[:3])"


def probe(exe: str) -> str | None:
    """The version of a Python interpreter, or None when it does not run (e.g. a dead pyenv shim)."""
    try:
        proc = subprocess.run([exe, "-c", _VERSION], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def candidates(ctx: Context) -> tuple[list[tuple[str, str]], list[str]]:
    """([(exe, version)], notes): the local Python, python3.12 if any runs, and --python extras."""
    found: dict[str, str] = {}
    notes = []

    def add(exe: str) -> bool:
        version = probe(exe)
        if version and version not in found.values():
            found[exe] = version
        return version is not None

    add(ctx.python)
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    p312 = [w for w in [shutil.which("python3.12")] if w] + sorted(glob.glob(f"{pyenv}/versions/3.12*/bin/python3.12"))
    if not any(add(exe) for exe in p312):
        notes.append("python3.12 not present")
    for exe in ctx.extra_pythons:
        if not add(exe):
            notes.append(f"{exe} does not run")
    return list(found.items()), notes


def run(ctx: Context, step: Step) -> GateResult:
    info = ctx.build()
    rels = sorted(r for r in info.files if r.endswith(".py"))
    pythons, notes = candidates(ctx)
    details, status = list(notes), PASS
    for exe, version in pythons:
        step(f"py_compile with Python {version}")
        proc = subprocess.run(
            [exe, "-c", _COMPILE, str(info.root), *rels],
            capture_output=True,
            text=True,
            timeout=ctx.timeout_s,
            check=False,
        )
        errors = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        if proc.returncode != 0 and not errors:
            errors = [f"Python {version} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"]
        if errors:
            status = FAIL
            details += [f"Python {version}: {e}" for e in errors]
    versions = ", ".join(v for _, v in pythons)
    summary = f"compiled with Python {versions}" + (f" ({'; '.join(notes)})" if notes else "")
    if status == FAIL:
        summary = f"syntax errors with Python {versions}"
    return GateResult(NUMBER, NAME, status, len(rels), summary, details)
