"""Shared fixtures. `project` / `patched_project`: a small synthetic project in tmp_path (see
tests/foundation_support.py); `cli`: Typer's CliRunner on the real app; `ddtree`: the installed
console script in a subprocess (real exit codes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# Without a GPU, Triton kernels (ddtree_utils' fused tree kernels, sglang's helpers) run in
# Triton's interpreter. Triton reads this when it is first imported, so it is set here, before
# any test module imports it. The GPU tests run with --noconftest and compile for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Gate results are reused across runs only where a test asks for it (tests/test_checks.py): the
# CLI and the gates that tests start run every gate (checks/registry.py, DDTREE_GATE_CACHE).
os.environ.setdefault("DDTREE_GATE_CACHE", "off")

import pytest
from foundation_support import UPSTREAM, Project, edit, udiff


class _InstalledNamesOnly:
    """The project's folders deploy/ and checks/ are the packages ddtree_deploy.deploy and
    ddtree_deploy.checks; pytest runs in the repository root, where `import deploy` would load the
    same files a second time as other modules (two copies of every class and global). Refuse it."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in ("deploy", "checks"):
            raise ImportError(f"import ddtree_deploy.{name}, not {name} (the installed package name)", name=name)


sys.meta_path.insert(0, _InstalledNamesOnly)


# -- tiers (pyproject's markers; `make test-fast` deselects interp, stat, ssh and slow) ------------
# A ddtree_utils test whose source names the Triton backend or a kernel runs that kernel in Triton's
# interpreter here: it is marked `interp` automatically, so new kernel tests land in the right tier.
# `smoke` tests (one small case per kernel, tests/test_ddtree_utils_smoke.py) stay in the fast tier
# and are what gate 7 runs of the interpreter.
_INTERP_SIGNS = ('"triton"', "'triton'", "_triton(", "_kernel[")


def pytest_collection_modifyitems(config, items):
    import inspect

    for item in items:
        if not item.path.name.startswith("test_ddtree_utils") or item.get_closest_marker("smoke"):
            continue
        fn = getattr(item, "function", None)
        try:
            src = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            src = ""
        if "triton" in item.name or any(sign in src for sign in _INTERP_SIGNS):
            item.add_marker(pytest.mark.interp)


@pytest.fixture
def project(tmp_path: Path) -> Project:
    """Snapshot of UPSTREAM, an empty series, a tiny ddtree_utils.py; nothing built yet."""
    proj = Project(tmp_path / "proj")
    proj.write_snapshot(UPSTREAM)
    proj.patches_dir.mkdir(parents=True)
    (proj.patches_dir / "series").write_text("# empty series\n")
    proj.utils.write_text('"""Stand-in for the real ddtree_utils.py in synthetic builds."""\n\nBUDGET = 4\n')
    return proj


@pytest.fixture
def patched_project(project: Project) -> Project:
    """`project` with two patches: 0001 edits mod.py (alpha, gamma) and adds a new file;
    0002 edits mod.py (beta) and other.py."""
    mod = UPSTREAM["srt/speculative/mod.py"]
    mod1 = edit(edit(mod, "return x + 1", "return x + 10"), "return z - 3", "return z - 30")
    new_file = '"""Added by the series."""\n\nNEW = True\n'
    project.add_patch(
        "0001-alpha-gamma.patch",
        udiff("srt/speculative/mod.py", mod, mod1) + udiff("srt/speculative/added.py", None, new_file),
        desc="Change alpha and gamma; add a module.",
    )
    mod2 = edit(mod1, "return y * 2", "return y * 20")
    other = UPSTREAM["srt/other.py"]
    project.add_patch(
        "0002-beta-other.patch",
        udiff("srt/speculative/mod.py", mod1, mod2)
        + udiff("srt/other.py", other, edit(other, "VALUE_20 = 20", "VALUE_20 = 200")),
        desc="Change beta and one value.",
    )
    return project


@pytest.fixture(scope="session")
def cli():
    """Typer's CliRunner on the real app (commands registered once)."""
    from ddtree_deploy.deploy import cli as deploy_cli
    from typer.testing import CliRunner

    deploy_cli._register()

    class Runner:
        def __init__(self):
            self.runner = CliRunner()

        def __call__(self, *args: str):
            return self.runner.invoke(deploy_cli.app, [str(a) for a in args])

    return Runner()


@pytest.fixture(scope="session")
def ddtree():
    """Run the installed console script in a subprocess: the real entry point and exit codes.
    Wide COLUMNS so rich does not wrap the one-line error message."""
    import os
    import shutil
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "ddtree-deploy"
    exe = str(exe) if exe.exists() else shutil.which("ddtree-deploy")
    assert exe, "the ddtree-deploy console script is not installed (pip install -e .)"
    env = dict(os.environ, COLUMNS="400", NO_COLOR="1")

    def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([exe, *map(str, args)], check=False, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)

    return run
