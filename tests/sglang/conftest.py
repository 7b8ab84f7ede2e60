"""CPU tests against the real sglang package with the DDTree build laid over it.

Fixtures:
  sglang_overlay   (session) the build laid over a copy of the installed sglang, first on
                   sys.path, TRITON_INTERPRET=1; sglang is imported from it once per session.
                   Request it BEFORE importing anything from sglang (import inside the test).
  tiny_models      (session) config dirs of a tiny Qwen3 target and DFlash draft (block size 16).

The build (pin 0.5.13.post1) is assembled fresh from snapshot + patches/0.5.13.post1/series + ddtree_utils.py into a temp dir
(set DDTREE_BUILD_DIR=<dir> to test an existing build instead). Tests here are marked `sglang`
and skip when sglang is not installed in this Python.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from ddtree_deploy.checks.sglang_smoke import find_installed_sglang, make_overlay

HERE = Path(__file__).resolve().parent


def _load_fixtures_module():
    spec = importlib.util.spec_from_file_location("ddtree_sglang_fixtures", HERE / "fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[spec.name] = mod  # tests: `import ddtree_sglang_fixtures as fixtures`
    return mod


fixtures = _load_fixtures_module()


class Overlay(NamedTuple):
    root: Path  # on sys.path; holds root/sglang
    build_dir: Path  # the build laid over the installed package
    installed: Path  # the installed sglang package dir (never modified)


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.sglang)


def _assemble_build(dest: Path) -> Path:
    from ddtree_deploy.deploy.build import build as b

    b.assemble(b.prepare(b.Inputs()), dest)
    return dest


@pytest.fixture(scope="session")
def sglang_overlay(tmp_path_factory) -> Overlay:
    installed = find_installed_sglang()
    if installed is None:
        pytest.skip("sglang==0.5.13.post1 is not installed (scripts/install_sglang_env.sh)")
    root = tmp_path_factory.mktemp("sglang-overlay").resolve()
    loaded = sys.modules.get("sglang")
    if loaded is not None and root not in Path(loaded.__file__).resolve().parents:
        pytest.fail(f"sglang was imported from {loaded.__file__} before the overlay fixture ran")
    if os.environ.get("DDTREE_BUILD_DIR"):
        build_dir = Path(os.environ["DDTREE_BUILD_DIR"])
        if not (build_dir / "srt").is_dir():
            pytest.fail(f"DDTREE_BUILD_DIR={build_dir} is not a build directory (no srt/)")
    else:
        build_dir = _assemble_build(tmp_path_factory.mktemp("ddtree-build"))
    make_overlay(build_dir, root, installed)
    os.environ["TRITON_INTERPRET"] = "1"  # before sglang (and triton) are imported
    sys.path.insert(0, str(root))
    import sglang

    assert root in Path(sglang.__file__).resolve().parents, sglang.__file__
    return Overlay(root, build_dir, installed)


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """prepare_server_args() calls logging.basicConfig(force=True); undo it after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    return fixtures.write_model_dirs(tmp_path_factory.mktemp("tiny-models"), block_size=16)
