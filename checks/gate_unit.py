"""Gate 7: the fast tier of ddtree_utils' tests (tests/test_ddtree_utils*.py), run with pytest.

The fast tier is every test there except the tiers `make test` adds: the Triton interpreter
beyond one smoke case per kernel (`interp`), statistical tests (`stat`) and `slow` ones; the
smoke cases (tests/test_ddtree_utils_smoke.py) keep every kernel in the gate. About half a
minute on 2 cores; `make test` runs the whole suite.
"""

from __future__ import annotations

import importlib.metadata
import sys

from .base import FAIL, PASS, SKIP, Context, GateResult, Step

NUMBER, NAME = 7, "ddtree_utils tests"
FAST_TIER = "not (interp or stat or slow or ssh or gpu)"


def _files(ctx: Context) -> list:
    return sorted(ctx.tests.glob("test_ddtree_utils*.py"))


def inputs(ctx: Context) -> tuple[list, list[str]]:
    """What decides this gate's result (for reuse): the module under test, the test files and
    their conftest, the tier, the interpreter and the versions of the libraries it runs on."""
    versions = []
    for dist in ("torch", "triton", "pytest", "hypothesis", "scipy"):
        try:
            versions.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist} absent")
    files = [ctx.inputs.ddtree_utils, *sorted(ctx.repo_root.glob("ddtree_*.py")), ctx.tests / "conftest.py", *_files(ctx)]
    return files, [FAST_TIER, ctx.python, sys.version, *versions]


def run(ctx: Context, step: Step) -> GateResult:
    files = _files(ctx)
    if not files:
        return GateResult(NUMBER, NAME, SKIP, 0, f"no {ctx.tests}/test_ddtree_utils*.py")
    step(f"pytest -m '{FAST_TIER}' {' '.join(f.name for f in files)}")
    proc = ctx.run_python("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", FAST_TIER, *map(str, files))
    if proc is None:
        return GateResult(NUMBER, NAME, FAIL, len(files), f"timed out after {ctx.timeout_s:.0f} s")
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    summary = lines[-1].strip("= ") if lines else f"pytest exit code {proc.returncode}"
    if proc.returncode == 0:
        return GateResult(NUMBER, NAME, PASS, len(files), f"fast tier: {summary}")
    return GateResult(NUMBER, NAME, FAIL, len(files), summary, lines[-30:] + proc.stderr.strip().splitlines()[-5:])
