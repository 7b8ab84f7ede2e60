"""`ddtree-deploy patch` build: contents, manifest, determinism, atomicity, and every bad input."""

from __future__ import annotations

import hashlib
import json

import pytest
from ddtree_deploy.deploy.build import build as build_mod
from ddtree_deploy.deploy.build.build import Inputs, build
from ddtree_deploy.deploy.build.buildinfo import (
    MANIFEST_NAME,
    compute_build_id,
    load_build,
)
from ddtree_deploy.deploy.build.series import SHIPPED_UTILS
from ddtree_deploy.deploy.errors import EXIT_PATCH, EXIT_SNAPSHOT, EXIT_USAGE
from ddtree_deploy.deploy.build.series import SHIPPED_FILES, SHIPPED_MODULES
from foundation_support import REPO_ROOT, UPSTREAM, edit, error_lines, udiff

MOD = "srt/speculative/mod.py"


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_empty_series_builds_snapshot_plus_ddtree_utils(project):
    result = build(project.inputs())
    files = project.tree_bytes(project.build_dir)
    expected = {rel: text.encode() for rel, text in UPSTREAM.items()}
    expected[SHIPPED_UTILS] = project.utils.read_bytes()
    manifest = json.loads(files.pop(MANIFEST_NAME))
    assert files == expected
    assert manifest["patches"] == [] and manifest["sglang_version"] == project.version
    assert manifest["files"][SHIPPED_UTILS]["pristine_sha256"] is None
    assert manifest["files"][MOD] == {
        "sha256": sha(expected[MOD]),
        "size": len(expected[MOD]),
        "pristine_sha256": sha(expected[MOD]),
    }
    assert manifest["snapshot_manifest_sha256"] == sha((project.snapshot_dir / "MANIFEST.json").read_bytes())
    assert manifest["build_id"] == compute_build_id({r: sha(b) for r, b in expected.items()}, project.version)
    assert load_build(project.build_dir).build_id == result.info.build_id


def test_series_is_applied_in_order(patched_project):
    result = build(patched_project.inputs())
    want = edit(
        edit(edit(UPSTREAM[MOD], "return x + 1", "return x + 10"), "return z - 3", "return z - 30"),
        "return y * 2",
        "return y * 20",
    )
    assert (patched_project.build_dir / MOD).read_text() == want
    assert "VALUE_20 = 200\n" in (patched_project.build_dir / "srt/other.py").read_text()
    info = load_build(patched_project.build_dir)
    assert info.patches == ["0001-alpha-gamma.patch", "0002-beta-other.patch"]
    assert info.files["srt/speculative/added.py"].pristine_sha256 is None
    assert info.files[MOD].pristine_sha256 == sha(UPSTREAM[MOD].encode()) != info.files[MOD].sha256
    assert result.warnings == []


def test_build_is_byte_deterministic_and_replaces_atomically(patched_project, tmp_path):
    first = build(patched_project.inputs())
    one = patched_project.tree_bytes()
    again = build(patched_project.inputs())
    assert again.replaced and not first.replaced
    assert patched_project.tree_bytes() == one  # same bytes, no leftovers beside the build
    other = Inputs(
        patched_project.snapshot_dir, patched_project.patches_dir, tmp_path / "elsewhere", patched_project.utils
    )
    build(other)
    assert patched_project.tree_bytes(tmp_path / "elsewhere") == one


def _edit_snapshot(p):
    f = p.snapshot_dir / "srt/other.py"
    f.write_text(f.read_text().replace("VALUE_1 = 1", "VALUE_1 = 11"))
    return EXIT_SNAPSHOT, "srt/other.py"


def _missing_patch_file(p):
    (p.patches_dir / "0002-beta-other.patch").unlink()
    return EXIT_USAGE, "0002-beta-other.patch"


def _reordered(p):
    (p.patches_dir / "series").write_text("0002-beta-other.patch\n0001-alpha-gamma.patch\n")
    return EXIT_USAGE, "0001-alpha-gamma.patch"


def _unlisted(p):
    (p.patches_dir / "series").write_text("0001-alpha-gamma.patch\n")
    return EXIT_USAGE, "0002-beta-other.patch"


def _nonexistent_entry(p):
    with open(p.patches_dir / "series", "a") as f:
        f.write("0003-not-there.patch\n")
    return EXIT_USAGE, "0003-not-there.patch"


def _fuzz(p):
    """0002's first hunk needs fuzz: a context line of it differs from what 0001 leaves."""
    path = p.patches_dir / "0002-beta-other.patch"
    path.write_text(path.read_text().replace(' """Second function."""', ' """Second function!"""', 1))
    return EXIT_PATCH, "0002-beta-other.patch"


def _bad_header(p):
    path = p.patches_dir / "0001-alpha-gamma.patch"
    path.write_text(path.read_text().replace("Forwarded: not-needed\n", ""))
    return EXIT_USAGE, "0001-alpha-gamma.patch"


def _deleting_patch(p):
    p.add_patch(
        "0003-delete.patch",
        "--- a/srt/other.py\n+++ /dev/null\n@@ -1,40 +0,0 @@\n" + "".join(f"-VALUE_{i} = {i}\n" for i in range(40)),
    )
    return EXIT_USAGE, "0003-delete.patch"


def _no_utils(p):
    p.utils.unlink()
    return EXIT_USAGE, "ddtree_utils.py"


@pytest.mark.parametrize(
    "breakage",
    [
        _edit_snapshot,
        _missing_patch_file,
        _reordered,
        _unlisted,
        _nonexistent_entry,
        _fuzz,
        _bad_header,
        _deleting_patch,
        _no_utils,
    ],
)
def test_bad_input_fails_clearly_and_leaves_build_as_it_was(patched_project, ddtree, breakage):
    build(patched_project.inputs())
    before = patched_project.tree_bytes()
    code, name = breakage(patched_project)
    r = ddtree("patch", "--no-check", *patched_project.cli_args())
    assert r.returncode == code, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and name in lines[0], r.stderr
    assert patched_project.tree_bytes() == before


def test_failure_after_patching_leaves_no_half_build(patched_project, monkeypatch):
    """Even a crash at the last step (writing the manifest) leaves build/ exactly as it was."""
    build(patched_project.inputs())
    before = patched_project.tree_bytes()

    def boom(info):  # injected failure: the real writer cannot be made to fail otherwise
        raise OSError("disk full")

    monkeypatch.setattr(build_mod, "write_manifest", boom)
    with pytest.raises(OSError):
        build(patched_project.inputs())
    assert patched_project.tree_bytes() == before


def test_leftovers_of_a_killed_build_are_removed(patched_project):
    build(patched_project.inputs())
    before = patched_project.tree_bytes()
    leftover = patched_project.build_root / f".{patched_project.build_dir.name}.tmp-abc123" / "srt"
    leftover.mkdir(parents=True)
    (leftover / "half.py").write_text("half applied\n")
    build(patched_project.inputs())
    assert patched_project.tree_bytes() == before


def test_patch_may_not_ship_its_own_ddtree_utils(project):
    project.add_patch(
        "0001-utils.patch",
        udiff("srt/speculative/x.py", None, "X = 1\n").replace("srt/speculative/x.py", SHIPPED_UTILS),
    )
    with pytest.raises(Exception, match="shipped from ddtree_utils.py"):
        build(project.inputs())
    assert not project.build_root.exists() or project.tree_bytes() == {}


def _shipped(root) -> set[str]:
    return {rel for rel in SHIPPED_FILES if (root / rel).is_file()}


def test_a_build_ships_the_modules_its_tree_imports(project):
    """ddtree_utils.py always; another SHIPPED_MODULES sibling only when a patched file, or a
    module already shipped, imports it (closure); the tests' oracles never."""
    side = project.utils.parent
    for name in SHIPPED_MODULES[1:] + ("ddtree_reference.py",):
        (side / name).write_text(f'"""Stand-in {name}."""\n')
    build(project.inputs())
    assert _shipped(project.build_dir) == {SHIPPED_UTILS}

    project.add_patch(
        "0001-use-serving.patch",
        udiff("srt/speculative/user.py", None, "from sglang.srt.speculative import ddtree_serving\n"),
    )
    build(project.inputs())
    serving = "srt/speculative/ddtree_serving.py"
    assert _shipped(project.build_dir) == {SHIPPED_UTILS, serving}
    assert (project.build_dir / serving).read_bytes() == (side / "ddtree_serving.py").read_bytes()

    project.utils.write_text("try:\n    from . import ddtree_triton\nexcept ImportError:\n    pass\n")
    build(project.inputs())
    budget = "srt/speculative/ddtree_budget.py"
    assert _shipped(project.build_dir) == set(SHIPPED_FILES) - {budget}  # nothing imports it yet
    project.add_patch(
        "0002-use-budget.patch",
        udiff("srt/speculative/user2.py", None, "from sglang.srt.speculative.ddtree_budget import OFF\n"),
    )
    build(project.inputs())
    assert _shipped(project.build_dir) == set(SHIPPED_FILES)
    assert not list(project.build_dir.rglob("ddtree_reference.py"))

    (side / "ddtree_serving.py").unlink()
    with pytest.raises(Exception, match="ddtree_serving.py: missing"):
        build(project.inputs())


def test_each_pin_ships_exactly_what_its_patches_import(tmp_path):
    """For every pin of the repository: the shipped modules are ddtree_utils.py and the
    siblings some other file of the build names in an import statement (a plain text scan
    here, independent of the builder's AST reading); ddtree_reference.py is never shipped."""
    import re

    from ddtree_deploy.deploy.build import pins

    for pin in pins.select(None):
        dest = tmp_path / pin.version
        dest.mkdir()
        build_mod.assemble(build_mod.prepare(pin.inputs()), dest)
        code = {
            q: "\n".join(l for l in q.read_text().splitlines() if re.match(r"\s*(from|import)\s", l)
                         or re.match(r"\s+ddtree_\w+,?$", l))
            for q in dest.rglob("*.py")
        }
        want = {SHIPPED_UTILS} | {
            rel for rel in SHIPPED_FILES
            if any(re.search(rf"\b{rel.rsplit('/', 1)[1][:-3]}\b", text) for q, text in code.items()
                   if not q.as_posix().endswith(rel))
        }  # fmt: skip
        assert _shipped(dest) == want, pin.version
        assert not list(dest.rglob("ddtree_reference.py"))


def test_real_repository_series_builds_and_reverses(tmp_path):
    """The repository's snapshot + patches/series + ddtree_utils.py build cleanly (outside build/)."""
    inputs = Inputs(build_root=tmp_path / "build")
    result = build(inputs)
    info = load_build(result.info.root)
    assert (info.root / SHIPPED_UTILS).read_bytes() == (REPO_ROOT / "ddtree_utils.py").read_bytes()
    snapshot = json.loads((inputs.snapshot_dir / "MANIFEST.json").read_text())["files"]
    for rel, f in info.files.items():
        assert f.pristine_sha256 == snapshot.get(rel)
    assert result.warnings == [], "patches should apply without offsets"
    from ddtree_deploy.deploy.build.series import apply_series, load_series

    tree = result.info.root
    (tree / MANIFEST_NAME).unlink()
    (tree / SHIPPED_UTILS).unlink()
    apply_series(tree, load_series(inputs.patches_dir).entries, reverse=True)
    for rel, digest in snapshot.items():
        assert sha((tree / rel).read_bytes()) == digest
