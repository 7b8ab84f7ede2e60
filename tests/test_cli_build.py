"""The build-side CLI (patch, check, series, refresh) end to end on a synthetic project."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from ddtree_deploy.deploy.build.build import build
from ddtree_deploy.deploy.build.refresh import refresh
from ddtree_deploy.deploy.build.series import (
    check_header,
    load_series,
    parse_header,
    split_header,
)
from ddtree_deploy.deploy.build.snapshot import PINNED_VERSION
from ddtree_deploy.deploy.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ConfigError
from foundation_support import REPO_ROOT, UPSTREAM, edit, error_lines, udiff

MOD = "srt/speculative/mod.py"
FAST = ["--skip", "6", "--skip", "7"]  # gate 6 would run the real sglang smoke; gate 7 the repo's tests


def test_patch_json_reports_build_and_gates(patched_project, cli):
    r = cli("patch", *patched_project.cli_args(), *FAST, "--json")
    assert r.exit_code == EXIT_OK, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is True
    assert doc["build"]["build_dir"] == str(patched_project.build_dir)
    assert doc["build"]["patches"] == ["0001-alpha-gamma.patch", "0002-beta-other.patch"]
    assert [g["gate"] for g in doc["gates"]] == [1, 2, 3, 4, 5]
    assert all(g["status"] == "pass" for g in doc["gates"])
    manifest = json.loads((patched_project.build_dir / "BUILD-MANIFEST.json").read_text())
    assert manifest["build_id"] == doc["build"]["build_id"]


def test_patch_no_check_then_check_table(patched_project, ddtree):
    r = ddtree("patch", "--no-check", *patched_project.cli_args())
    assert r.returncode == EXIT_OK and "built" in r.stderr and r.stdout == ""
    r = ddtree("check", *patched_project.cli_args(), *FAST)
    assert r.returncode == EXIT_OK, r.stderr
    for name in ("snapshot", "series", "round trip", "py_compile", "lint (changed lines)"):
        assert name in r.stderr
    assert "Quality gates" in r.stderr and r.stdout == ""


def test_check_failure_exits_1_with_json_and_names_the_gate(patched_project, ddtree):
    build(patched_project.inputs())
    (patched_project.build_dir / MOD).write_text("tampered\n")
    r = ddtree("check", *patched_project.cli_args(), *FAST, "--json")
    assert r.returncode == EXIT_FAILED
    doc = json.loads(r.stdout)
    failed = {g["gate"] for g in doc["gates"] if g["status"] == "fail"}
    assert failed == {3, 4, 5} and doc["ok"] is False  # every gate that reads the build refuses it
    (line,) = error_lines(r.stderr)
    assert "3 (round trip)" in line


def test_check_without_a_build_says_what_to_do(patched_project, ddtree):
    r = ddtree("check", *patched_project.cli_args(), "--gate", "3")
    assert r.returncode == EXIT_FAILED and "run `ddtree-deploy patch` first" in r.stderr


def test_check_unknown_gate_is_a_usage_error(patched_project, ddtree):
    r = ddtree("check", *patched_project.cli_args(), "--gate", "bogus")
    assert r.returncode == EXIT_USAGE and "unknown gate" in error_lines(r.stderr)[0]


def test_series_lists_patches_files_and_counts(patched_project, cli, ddtree):
    r = cli("series", "--patches-dir", patched_project.patches_dir, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [p["patch"] for p in doc["patches"]] == ["0001-alpha-gamma.patch", "0002-beta-other.patch"]
    for p in doc["patches"]:  # +/- counts against a direct count of the patch's lines
        body = split_header((patched_project.patches_dir / p["patch"]).read_text())[1].splitlines()
        assert sum(f["added"] for f in p["files"]) == sum(
            1 for ln in body if ln.startswith("+") and not ln.startswith("+++")
        )
        assert sum(f["removed"] for f in p["files"]) == sum(
            1 for ln in body if ln.startswith("-") and not ln.startswith("---")
        )
    assert doc["patches"][0]["description"] == "Change alpha and gamma; add a module."
    human = ddtree("series", "--patches-dir", patched_project.patches_dir)
    assert human.returncode == 0 and "0002-beta-other.patch" in human.stderr and "srt/other.py" in human.stderr


# --- refresh ---------------------------------------------------------------------------------


def _edit_build(p, rel, old, new):
    f = p.build_dir / rel
    f.write_text(edit(f.read_text(), old, new))
    return f.read_bytes()


def test_refresh_captures_an_edit_and_rebuild_reproduces_it(patched_project, cli):
    build(patched_project.inputs())
    edited = _edit_build(patched_project, MOD, "return x + 10", "return x + 100")
    r = cli("refresh", "0001", *patched_project.cli_args(), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["changed"] is True and doc["broken"] is None and doc["uncaptured"] == []
    patch = patched_project.patches_dir / "0001-alpha-gamma.patch"
    fields = check_header(patch)
    assert fields["Last-Update"] == dt.datetime.now(dt.timezone.utc).date().isoformat()
    assert fields["Description"].startswith("Change alpha and gamma")
    assert "+    return x + 100" in patch.read_text() and "index " not in patch.read_text()
    build(patched_project.inputs())
    assert (patched_project.build_dir / MOD).read_bytes() == edited
    assert (patched_project.build_dir / "srt/speculative/added.py").is_file()


def test_refresh_is_idempotent(patched_project):
    """The first refresh rewrites difflib's format as git's; a second one changes nothing."""
    build(patched_project.inputs())
    patch = patched_project.patches_dir / "0002-beta-other.patch"
    first = refresh(patched_project.inputs(), "0002-beta-other.patch")
    assert first.changed and patch.read_text().count("diff --git a/") == 2
    before = patch.read_bytes()
    again = refresh(patched_project.inputs(), "0002-beta-other.patch")
    assert not again.changed and patch.read_bytes() == before


def test_refresh_reports_a_later_patch_that_shifts_then_refreshing_it_fixes_the_series(patched_project, ddtree):
    build(patched_project.inputs())
    edited = _edit_build(patched_project, MOD, "return x + 10\n", "y = x * 2\n    return x + 10 + y\n")
    r = ddtree("refresh", "0001-alpha-gamma.patch", *patched_project.cli_args())
    assert r.returncode == EXIT_USAGE
    (line,) = error_lines(r.stderr)
    assert "0002-beta-other.patch" in line and "offset" in line
    r = ddtree("refresh", "0002-beta-other.patch", *patched_project.cli_args())
    assert r.returncode == 0, r.stderr
    r = ddtree("patch", *patched_project.cli_args(), *FAST)
    assert r.returncode == 0, r.stderr
    assert (patched_project.build_dir / MOD).read_bytes() == edited


def test_refresh_add_file_and_uncaptured_edits(patched_project):
    build(patched_project.inputs())
    new = patched_project.build_dir / "srt/speculative/extra.py"
    new.write_text("EXTRA = 2\n")
    _edit_build(patched_project, "srt/other.py", "VALUE_30 = 30", "VALUE_30 = 300")
    r = refresh(patched_project.inputs(), "0001", add_files=["srt/speculative/extra.py"])
    assert r.changed and "srt/speculative/extra.py" in r.files
    assert r.uncaptured == ["srt/other.py"]  # that edit sits in 0002's file and was not refreshed
    r2 = refresh(patched_project.inputs(), "0002")
    assert r2.changed and r2.uncaptured == []
    build(patched_project.inputs())
    assert (patched_project.build_dir / "srt/speculative/extra.py").read_text() == "EXTRA = 2\n"
    assert "VALUE_30 = 300\n" in (patched_project.build_dir / "srt/other.py").read_text()
    assert parse_header(split_header((patched_project.patches_dir / "0001-alpha-gamma.patch").read_text())[0])["Origin"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["0009"], "not in"),
        (["0001", "--add-file", "srt/speculative/ddtree_utils.py"], "shipped from ddtree_utils.py"),
        (["0001", "--add-file", "srt/nothing.py"], "not in the build tree"),
    ],
)
def test_refresh_bad_arguments(patched_project, ddtree, args, message):
    build(patched_project.inputs())
    series_before = {p.name: p.read_bytes() for p in patched_project.patches_dir.iterdir()}
    r = ddtree("refresh", *args, *patched_project.cli_args())
    assert r.returncode == EXIT_USAGE and message in error_lines(r.stderr)[0]
    assert {p.name: p.read_bytes() for p in patched_project.patches_dir.iterdir()} == series_before


def test_refresh_needs_a_build(patched_project):
    with pytest.raises(ConfigError, match="no build"):
        refresh(patched_project.inputs(), "0001")
    assert load_series(patched_project.patches_dir).names  # series untouched


def test_refresh_of_a_patch_whose_changes_were_reverted_is_refused(patched_project):
    build(patched_project.inputs())
    f = patched_project.build_dir / "srt/other.py"
    f.write_text(UPSTREAM["srt/other.py"])
    _edit_build(patched_project, MOD, "return y * 20", "return y * 2")
    with pytest.raises(ConfigError, match="would be empty"):
        refresh(patched_project.inputs(), "0002")


def test_defaults_are_the_repository_directories(ddtree, tmp_path):
    """Run from another directory with no path options: the repository's series and snapshot."""
    pins = sorted(p.name.removeprefix("sglang-") for p in (REPO_ROOT / "snapshot").glob("sglang-*"))
    assert PINNED_VERSION in pins
    r = ddtree("series", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = {d["pin"]: d for d in json.loads(r.stdout)["pins"]}
    assert sorted(doc) == pins
    for pin, d in doc.items():
        assert [p["patch"] for p in d["patches"]] == load_series(REPO_ROOT / "patches" / pin).names
    r = ddtree("snapshot", "verify", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert sorted(d["pin"] for d in doc["pins"]) == pins and all(d["problems"] == [] for d in doc["pins"])


def test_human_output_shows_brackets_literally(project, ddtree):
    """Data shown in tables (descriptions, notes) is text, not rich markup."""
    mod = UPSTREAM[MOD]
    project.add_patch(
        "0001-b.patch", udiff(MOD, mod, edit(mod, "return x + 1", "return x[idx]")), desc="Index with x[idx] [wip]"
    )
    r = ddtree("series", "--patches-dir", project.patches_dir)
    assert r.returncode == 0 and "Index with x[idx] [wip]" in r.stderr
    assert ddtree("patch", "--no-check", *project.cli_args()).returncode == 0
    r = ddtree("check", *project.cli_args(), "--gate", "5")
    assert r.returncode == EXIT_FAILED
    assert "F821 Undefined name `idx`" in r.stderr
