"""Gate 7: the unit tests of ddtree_utils (tests/test_ddtree_utils*.py), run with pytest."""

from __future__ import annotations


from .base import FAIL, PASS, SKIP, Context, GateResult, Step

NUMBER, NAME = 7, "ddtree_utils tests"


def run(ctx: Context, step: Step) -> GateResult:
    files = sorted(ctx.tests.glob("test_ddtree_utils*.py"))
    if not files:
        return GateResult(NUMBER, NAME, SKIP, 0, f"no {ctx.tests}/test_ddtree_utils*.py")
    step(f"pytest {' '.join(f.name for f in files)}")
    proc = ctx.run_python("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *map(str, files))
    if proc is None:
        return GateResult(NUMBER, NAME, FAIL, len(files), f"timed out after {ctx.timeout_s:.0f} s")
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    summary = lines[-1].strip("= ") if lines else f"pytest exit code {proc.returncode}"
    if proc.returncode == 0:
        return GateResult(NUMBER, NAME, PASS, len(files), summary)
    return GateResult(NUMBER, NAME, FAIL, len(files), summary, lines[-30:] + proc.stderr.strip().splitlines()[-5:])
