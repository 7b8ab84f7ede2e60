"""The import contracts of deploy/ and checks/ (pyproject.toml [tool.importlinter]): the layers
cli > checks | remote > build > config > errors, no import cycle inside a layer, no rich/typer
below the cli. `lint-imports` must keep them on the repository, and must break them on a copy of the
two packages with one forbidden import added (so a contract that checks nothing would fail here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:  # the copy shadows the installed (editable) packages
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run([str(LINT), "--no-cache", str(cwd / "pyproject.toml")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_repository_keeps_every_contract():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in r.stdout, r.stdout[-2000:]


# (module file, import added at its top, the contract it breaks)
BREAKS = [
    ("deploy/remote/lock.py", "from ..cli import ui", "layers"),  # a lower layer reaches up to the cli
    ("deploy/build/pins.py", "from ..remote import facts", "layers"),  # build reaches the remote side
    ("deploy/build/buildinfo.py", "from ...checks import base", "layers"),  # deploy's build layer imports checks
    ("checks/base.py", "from ..deploy.remote import transport", "layers"),  # checks and remote are independent
    ("deploy/config/launch.py", "from . import inventory", "no-cycles"),  # inventory imports launch: a cycle
    ("deploy/remote/health.py", "import rich", "quiet-lower-layers"),  # a lower layer that could print
]


@pytest.mark.parametrize(("path", "line", "contract"), BREAKS, ids=[b[0] + ":" + b[2] for b in BREAKS])
def test_a_forbidden_import_breaks_its_contract(tmp_path, path, line, contract):
    pkg = tmp_path / "ddtree_deploy"
    for name in ("deploy", "checks"):
        shutil.copytree(ROOT / name, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = pkg / path
    text = target.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    target.write_text(head + sep + line + "\n" + rest if sep else line + "\n" + text)
    r = lint(tmp_path, pythonpath=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    name = next(c["name"] for c in CONTRACTS if c["id"] == contract)
    assert f"{name} BROKEN" in r.stdout, r.stdout[-3000:]
