"""The series file, DEP-3 headers, zero-fuzz application with git apply, and generated diffs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from ddtree_deploy.deploy.build.series import (
    apply_patch,
    check_header,
    diff_file,
    load_series,
    parse_header,
    patch_files,
    split_header,
)
from ddtree_deploy.deploy.build.snapshot import PINNED_VERSION
from ddtree_deploy.deploy.errors import (
    EXIT_PATCH,
    EXIT_USAGE,
    ConfigError,
    PatchApplyError,
)
from foundation_support import HEADER, REPO_ROOT, UPSTREAM, edit, udiff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MOD = "srt/speculative/mod.py"


def tree_from_snapshot(project, dest: Path) -> Path:
    shutil.copytree(project.snapshot_dir, dest)
    (dest / "MANIFEST.json").unlink()
    return dest


# --- the series file -------------------------------------------------------------------------


def test_series_with_comments_blank_lines_and_real_repo(patched_project):
    series = patched_project.patches_dir / "series"
    series.write_text("# header comment\n\n0001-alpha-gamma.patch   # inline comment\n  \n0002-beta-other.patch\n")
    s = load_series(patched_project.patches_dir)
    assert s.names == ["0001-alpha-gamma.patch", "0002-beta-other.patch"]
    assert [e.line for e in s.entries] == [3, 5]
    assert s.index_of("0002") == 1 and s.index_of("0001-alpha-gamma") == 0
    real = load_series(REPO_ROOT / "patches" / PINNED_VERSION)  # the repository's own series parses
    assert all(e.path.is_file() for e in real.entries)


@pytest.mark.parametrize(
    ("series_text", "message"),
    [
        ("0002-beta-other.patch\n0001-alpha-gamma.patch\n", "out of order"),
        ("0001-alpha-gamma.patch\n0001-alpha-gamma.patch\n0002-beta-other.patch\n", "listed twice"),
        ("0001-alpha-gamma.patch\n0002-beta-other.patch\n0003-missing.patch\n", "does not exist"),
        ("0001-alpha-gamma.patch\n", "not listed"),
        ("0001-alpha-gamma.patch -p1\n0002-beta-other.patch\n", "one patch file name per line"),
        ("alpha.patch\n", "not a patch name"),
        ("../0001-alpha-gamma.patch\n", "not a patch name"),
    ],
)
def test_bad_series_is_a_one_line_usage_error(patched_project, series_text, message):
    (patched_project.patches_dir / "series").write_text(series_text)
    with pytest.raises(ConfigError) as exc:
        load_series(patched_project.patches_dir)
    assert exc.value.exit_code == EXIT_USAGE
    assert message in exc.value.message and "\n" not in exc.value.message
    assert "series" in exc.value.message or ".patch" in exc.value.message


def test_missing_series_file(project):
    (project.patches_dir / "series").unlink()
    with pytest.raises(ConfigError, match="series file missing"):
        load_series(project.patches_dir)


def test_series_hash_covers_order_and_contents(patched_project):
    s = load_series(patched_project.patches_dir)
    before = s.sha256()
    p = patched_project.patches_dir / "0002-beta-other.patch"
    p.write_text(p.read_text().replace("Change beta", "Change Beta"))
    assert load_series(patched_project.patches_dir).sha256() != before


# --- headers ---------------------------------------------------------------------------------


def test_header_fields_and_subject_alias(patched_project):
    fields = check_header(patched_project.patches_dir / "0001-alpha-gamma.patch")
    assert fields["Description"].startswith("Change alpha and gamma")
    assert "continuation line" in fields["Description"]
    assert fields["Last-Update"] == "2026-01-15"
    header = HEADER.format(desc="x").replace("Description:", "Subject:")
    assert parse_header(header)["Description"].splitlines()[0] == "x"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("Origin: vendor, https://example.invalid/ddtree\n", ""), "Origin"),
        (("Forwarded: not-needed\n", "Forwarded:  \n"), "Forwarded"),
        (("Description: Change", "Summary: Change"), "Description (or Subject)"),
        (("Last-Update: 2026-01-15", "Last-Update: 2026-13-01"), "not a date"),
        (("Last-Update: 2026-01-15", "Last-Update: 15/01/2026"), "not a date"),
        (("Last-Update: 2026-01-15\n", ""), "Last-Update"),
    ],
)
def test_bad_header_names_patch_and_field(patched_project, change, message):
    path = patched_project.patches_dir / "0001-alpha-gamma.patch"
    path.write_text(path.read_text().replace(*change, 1))
    with pytest.raises(ConfigError) as exc:
        check_header(path)
    assert message in exc.value.message and path.name in exc.value.message


def test_patch_files_counts_and_layout_checks(patched_project, tmp_path):
    changes = {c.path: c for c in patch_files(patched_project.patches_dir / "0001-alpha-gamma.patch")}
    assert set(changes) == {MOD, "srt/speculative/added.py"}
    assert (changes[MOD].added, changes[MOD].removed) == (2, 2)
    assert changes["srt/speculative/added.py"].new and changes["srt/speculative/added.py"].added == 3
    bad = tmp_path / "0009-bad.patch"
    bad.write_text(
        HEADER.format(desc="x") + udiff(MOD, UPSTREAM[MOD], UPSTREAM[MOD] + "#\n").replace("a/srt", "srt", 1)
    )
    with pytest.raises(ConfigError, match="must start with a/"):
        patch_files(bad)
    utils = tmp_path / "0010-utils.patch"
    utils.write_text(HEADER.format(desc="x") + udiff("srt/speculative/ddtree_utils.py", None, "X = 1\n"))
    with pytest.raises(ConfigError, match="shipped from ddtree_utils.py"):
        patch_files(utils)
    empty = tmp_path / "0011-empty.patch"
    empty.write_text(HEADER.format(desc="x"))
    with pytest.raises(PatchApplyError, match="no diff"):
        patch_files(empty)


# --- applying --------------------------------------------------------------------------------


def test_apply_exact_and_reverse(patched_project, tmp_path):
    tree = tree_from_snapshot(patched_project, tmp_path / "t")
    p1 = patched_project.patches_dir / "0001-alpha-gamma.patch"
    assert apply_patch(tree, p1) == []
    text = (tree / MOD).read_text()
    assert "return x + 10" in text and "return z - 30" in text
    assert (tree / "srt/speculative/added.py").read_text() == '"""Added by the series."""\n\nNEW = True\n'
    apply_patch(tree, p1, reverse=True)
    assert (tree / MOD).read_text() == UPSTREAM[MOD]
    assert not (tree / "srt/speculative/added.py").exists()


def test_context_mismatch_names_patch_file_and_hunk_and_leaves_tree(patched_project, tmp_path):
    """A patch that would need fuzz: the second hunk's context no longer matches."""
    tree = tree_from_snapshot(patched_project, tmp_path / "t")
    original = edit(UPSTREAM[MOD], '"""Third function."""', '"""Third function (edited)."""')
    (tree / MOD).write_text(original)
    before = {p: p.read_bytes() for p in tree.rglob("*") if p.is_file()}
    with pytest.raises(PatchApplyError) as exc:
        apply_patch(tree, patched_project.patches_dir / "0001-alpha-gamma.patch")
    msg = exc.value.message
    assert exc.value.exit_code == EXIT_PATCH
    assert "0001-alpha-gamma.patch" in msg and MOD in msg and "hunk #2" in msg and "\n" not in msg
    assert {p: p.read_bytes() for p in tree.rglob("*") if p.is_file()} == before


def test_offset_is_refused_unless_allowed(patched_project, tmp_path):
    tree = tree_from_snapshot(patched_project, tmp_path / "t")
    (tree / MOD).write_text("# one more line on top\n" + UPSTREAM[MOD])
    patch = patched_project.patches_dir / "0001-alpha-gamma.patch"
    with pytest.raises(PatchApplyError, match=r"hunk #1 of srt/speculative/mod.py .*offset of 1 line"):
        apply_patch(tree, patch)
    assert (tree / MOD).read_text().startswith("# one more line on top\n")
    warnings = apply_patch(tree, patch, allow_offset=True)
    assert len(warnings) == 2 and "refresh 0001-alpha-gamma.patch" in warnings[0]
    assert "return z - 30" in (tree / MOD).read_text()


def test_missing_target_file_and_existing_new_file(patched_project, tmp_path):
    tree = tree_from_snapshot(patched_project, tmp_path / "t")
    (tree / "srt/speculative/added.py").write_text("already here\n")
    with pytest.raises(PatchApplyError, match="added.py: already exists"):
        apply_patch(tree, patched_project.patches_dir / "0001-alpha-gamma.patch")
    (tree / MOD).unlink()
    (tree / "srt/speculative/added.py").unlink()
    with pytest.raises(PatchApplyError, match="mod.py: No such file"):
        apply_patch(tree, patched_project.patches_dir / "0001-alpha-gamma.patch")


def test_apply_inside_a_git_work_tree_still_patches(patched_project, tmp_path):
    """git apply inside a repository subdirectory would silently skip paths; we must not."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    tree = tree_from_snapshot(patched_project, repo / "build" / "tree")
    apply_patch(tree, patched_project.patches_dir / "0001-alpha-gamma.patch")
    assert "return x + 10" in (tree / MOD).read_text()


# --- diffs -----------------------------------------------------------------------------------


def test_diff_file_format(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "srt").mkdir(parents=True)
    (new / "srt").mkdir(parents=True)
    (old / "srt/x.py").write_text(UPSTREAM[MOD])
    (new / "srt/x.py").write_text(edit(UPSTREAM[MOD], "x + 1", "x + 2"))
    (new / "srt/n.py").write_text("N = 1\n")
    d = diff_file(old, new, "srt/x.py")
    assert d.splitlines()[:3] == ["diff --git a/srt/x.py b/srt/x.py", "--- a/srt/x.py", "+++ b/srt/x.py"]
    assert "index " not in d and "-    return x + 1" in d and "+    return x + 2" in d
    n = diff_file(old, new, "srt/n.py")
    assert "--- /dev/null" in n and "+++ b/srt/n.py" in n and "new file mode" in n
    assert diff_file(old, old, "srt/x.py") == ""


lines = st.lists(st.sampled_from(["a", "b", "c", "def f():", "    return 1", "", "# x"]), max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(old=lines, new=lines)
def test_diff_then_apply_roundtrips(tmp_path_factory, old, new):
    """Property: applying diff_file(old, new) to old gives new, and reversing it gives old."""
    base = tmp_path_factory.mktemp("rt")
    a, b, work = base / "a", base / "b", base / "w"
    for root, content in ((a, old), (b, new), (work, old)):
        (root / "srt").mkdir(parents=True)
        (root / "srt/f.py").write_text("".join(f"{ln}\n" for ln in content))
    d = diff_file(a, b, "srt/f.py")
    if old == new:
        assert d == ""
        return
    patch = base / "0001-p.patch"
    patch.write_text(split_header(HEADER.format(desc="p"))[0] + d)
    apply_patch(work, patch)
    assert (work / "srt/f.py").read_bytes() == (b / "srt/f.py").read_bytes()
    apply_patch(work, patch, reverse=True)
    assert (work / "srt/f.py").read_bytes() == (a / "srt/f.py").read_bytes()
