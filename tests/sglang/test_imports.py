"""Every module the build touches imports from the overlay, on top of the real sglang package."""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

import pytest
from ddtree_deploy.checks.sglang_smoke import build_files, module_name

REPO = Path(__file__).resolve().parents[2]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_patched_module_imports_from_the_overlay(sglang_overlay):
    names = [n for n in map(module_name, build_files(sglang_overlay.build_dir)) if n]
    assert "sglang.srt.server_args" in names and "sglang.srt.speculative.ddtree_utils" in names
    for name in names:
        mod = importlib.import_module(name)
        path = Path(mod.__file__).resolve()
        assert sglang_overlay.root in path.parents, f"{name} imported from {path}"
        rel = path.relative_to(sglang_overlay.root / "sglang").as_posix()
        assert path.read_bytes() == (sglang_overlay.build_dir / rel).read_bytes(), name


def test_shipped_ddtree_utils_is_the_repository_module(sglang_overlay):
    import importlib

    from sglang.srt.speculative import ddtree_utils

    assert _sha256(Path(ddtree_utils.__file__)) == _sha256(REPO / "ddtree_utils.py")
    assert callable(ddtree_utils.build_tree) and callable(ddtree_utils.compile_tree)
    # the sibling modules the build ships are the repository's too, and the kernels module is
    # the one ddtree_utils launches from (relative import inside sglang)
    for name in ("ddtree_triton", "ddtree_serving"):
        mod = importlib.import_module(f"sglang.srt.speculative.{name}")
        assert _sha256(Path(mod.__file__)) == _sha256(REPO / f"{name}.py"), name
    assert ddtree_utils.ddtree_triton.__name__ == "sglang.srt.speculative.ddtree_triton"


def test_overlay_leaves_the_installed_package_untouched(sglang_overlay):
    # The overlay hard-links into site-packages; replaced files must have been unlinked, never
    # written through. The installed copies must still be the pristine upstream bytes.
    manifest = json.loads((REPO / "snapshot/sglang-0.5.13.post1/MANIFEST.json").read_text())
    for rel, sha in manifest["files"].items():
        assert _sha256(sglang_overlay.installed / rel) == sha, rel
    assert not (sglang_overlay.installed / "srt/speculative/ddtree_utils.py").exists()


@pytest.mark.parametrize("rel", ["srt/server_args.py", "srt/speculative/spec_info.py"])
def test_patched_files_differ_from_upstream(sglang_overlay, rel):
    assert _sha256(sglang_overlay.root / "sglang" / rel) != _sha256(sglang_overlay.installed / rel)
