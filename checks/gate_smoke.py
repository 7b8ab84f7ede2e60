"""Gate 6: import and behaviour smoke of the patched modules against the real sglang package of
the build's pin.

Runs `<python> <repo>/checks/sglang_smoke.py --build <build>` (written with the patch series; exit 0 ok,
1 failure, 77 skipped when no sglang test environment of that version exists) with the pin's
sglang site first on PYTHONPATH when it has one (deploy.build.pins.sglang_env: `<venv>/sglang-sites/<V>/`,
installed by scripts/install_sglang_env.sh). Skipped when that module is absent.
"""

from __future__ import annotations

from pathlib import Path

from ..deploy.build.buildinfo import MANIFEST_NAME
from ..deploy.build.pins import sglang_env
from .base import FAIL, PASS, SKIP, Context, GateResult, Step

NUMBER, NAME = 6, "sglang smoke"
SKIPPED_RC = 77


def _last(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def inputs(ctx: Context) -> tuple[list, list[str]]:
    """What decides this gate's result (for reuse): the build (its manifest, checked against the
    files), the smoke script and its fixtures, the repository's ddtree modules, and which sglang
    site and Python run it."""
    info = ctx.build()  # ConfigError when the build's files differ from its manifest
    site = sglang_env(info.sglang_version, ctx.python).get("PYTHONPATH", "")
    dists = sorted(p.name for part in site.split(":") if part for p in Path(part).glob("sglang-*.dist-info"))
    files = [info.root / MANIFEST_NAME, ctx.repo_root / "checks" / "sglang_smoke.py",
             ctx.repo_root / "tests" / "sglang" / "fixtures.py", *sorted(ctx.repo_root.glob("ddtree_*.py"))]
    return files, [info.build_id, site, *dists, ctx.python]


def run(ctx: Context, step: Step) -> GateResult:
    module = ctx.repo_root / "checks" / "sglang_smoke.py"
    if not module.is_file():
        return GateResult(NUMBER, NAME, SKIP, 0, "checks/sglang_smoke.py not present")
    info = ctx.build()
    n = sum(1 for r, f in info.files.items() if f.sha256 != f.pristine_sha256)
    step(f"importing the patched modules with the real sglang {info.sglang_version}")
    env = sglang_env(info.sglang_version, ctx.python)
    proc = ctx.run_python(str(module), "--build", str(info.root), env=env)
    if proc is None:
        return GateResult(NUMBER, NAME, FAIL, n, f"timed out after {ctx.timeout_s:.0f} s")
    out = proc.stdout + proc.stderr
    if proc.returncode == SKIPPED_RC:
        return GateResult(NUMBER, NAME, SKIP, n, _last(out) or "no sglang test environment")
    if proc.returncode == 0:
        return GateResult(NUMBER, NAME, PASS, n, _last(proc.stdout) or "smoke passed")
    tail = [ln for ln in out.strip().splitlines() if ln.strip()][-20:]
    return GateResult(NUMBER, NAME, FAIL, n, _last(out) or f"exit code {proc.returncode}", tail)
