"""The seven quality gates, each shown passing and failing on a synthetic project."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
from ddtree_deploy.checks import (
    gate_compile,
    gate_lint,
    gate_roundtrip,
    gate_series,
    gate_smoke,
    gate_snapshot,
    gate_unit,
)
from ddtree_deploy.checks.base import FAIL, PASS, SKIP, Context
from ddtree_deploy.checks.registry import GATES, cache_path, run_gates, select
from ddtree_deploy.deploy.build.build import build, describe, prepare, write_manifest
from ddtree_deploy.deploy.errors import UsageError
from foundation_support import REPO_ROOT, UPSTREAM, Project, edit, udiff

MOD = "srt/speculative/mod.py"
NOOP = lambda _msg: None  # noqa: E731 - progress sink


def ctx_for(p: Project, **kw) -> Context:
    # repo_root: a directory without checks/sglang_smoke.py unless a test puts one there
    return Context(inputs=p.inputs(), repo_root=kw.pop("repo_root", p.root), tests_dir=p.tests_dir, **kw)


@pytest.fixture
def built(patched_project: Project) -> Project:
    build(patched_project.inputs())
    return patched_project


def test_all_gates_pass_on_a_good_build(built):
    built.tests_dir.mkdir()
    (built.tests_dir / "test_ddtree_utils_ok.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    results = run_gates(ctx_for(built))
    status = {r.number: r.status for r in results}
    assert status == {1: PASS, 2: PASS, 3: PASS, 4: PASS, 5: PASS, 6: SKIP, 7: PASS}
    assert all(r.seconds >= 0 for r in results)
    files = {r.number: r.files for r in results}
    assert files[1] == len(UPSTREAM) and files[2] == 3  # 0001 and 0002 touch three files
    assert files[4] == 4  # two upstream files, the added one and ddtree_utils.py


def test_gate_selection():
    assert [g.NUMBER for g in select(["5", "snap"])] == [1, 5]
    assert [g.NUMBER for g in select(None, ["6", "ddtree"])] == [1, 2, 3, 4, 5]
    assert len(select()) == len(GATES) == 7
    with pytest.raises(UsageError, match="unknown gate"):
        select(["nope"])


def test_gate1_names_the_edited_snapshot_file(built):
    f = built.snapshot_dir / "srt/other.py"
    f.write_text(f.read_text() + "# local edit\n")
    r = gate_snapshot.run(ctx_for(built), NOOP)
    assert r.status == FAIL and any("srt/other.py" in d and "differs" in d for d in r.details)


def test_gate2_fails_on_offset_and_on_bad_header(built):
    path = built.patches_dir / "0002-beta-other.patch"
    text = path.read_text()
    m = re.search(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@", text, re.MULTILINE)
    shifted = text.replace(
        m.group(0), f"@@ -{int(m.group(1)) + 2},{m.group(2)} +{int(m.group(3)) + 2},{m.group(4)} @@", 1
    )
    path.write_text(shifted)
    r = run_gates(ctx_for(built), [gate_series])[0]
    assert r.status == FAIL and "0002-beta-other.patch" in r.summary and "offset" in r.summary
    path.write_text(text.replace("Origin:", "Origen:"))
    r = run_gates(ctx_for(built), [gate_series])[0]
    assert r.status == FAIL and "Origin" in r.summary


def test_gate3_stale_tampered_and_non_reversible_builds(built):
    ctx = ctx_for(built)
    assert gate_roundtrip.run(ctx, NOOP).status == PASS
    # edited after the build: the manifest no longer matches
    target = built.build_dir / "srt/other.py"
    original = target.read_bytes()
    target.write_bytes(original + b"# hand edit\n")
    r = run_gates(ctx, [gate_roundtrip])[0]
    assert r.status == FAIL and "modified after it was made" in r.summary
    target.write_bytes(original)
    # an extra file recorded in the manifest: consistent, but reversing leaves it over
    (built.build_dir / "srt/stray.py").write_text("STRAY = 1\n")
    write_manifest(describe(prepare(built.inputs()), built.build_dir))
    r = gate_roundtrip.run(ctx, NOOP)
    assert r.status == FAIL and r.details == ["srt/stray.py: left over after reversing the series"]
    # inputs changed since the build
    build(built.inputs())
    built.utils.write_text(built.utils.read_text() + "EXTRA = 1\n")
    r = gate_roundtrip.run(ctx, NOOP)
    assert r.status == FAIL and "stale" in r.summary and any("ddtree_utils.py changed" in d for d in r.details)


def test_gate4_reports_syntax_errors_per_python(project):
    mod = UPSTREAM[MOD]
    project.add_patch("0001-broken.patch", udiff(MOD, mod, edit(mod, "def beta(y):", "def beta(y:")))
    build(project.inputs())
    r = gate_compile.run(ctx_for(project, extra_pythons=[str(project.root / "no-such-python")]), NOOP)
    assert r.status == FAIL
    local = "%d.%d.%d" % sys.version_info[:3]
    assert any(d.startswith(f"Python {local}: {MOD}: SyntaxError") for d in r.details)
    assert any("no-such-python does not run" in d for d in r.details)


def test_gate4_probe_finds_local_python(project):
    build(project.inputs())
    pythons, notes = gate_compile.candidates(ctx_for(project))
    assert pythons[0][1] == "%d.%d.%d" % sys.version_info[:3]
    assert any(v.startswith("3.12.") for _, v in pythons) or "python3.12 not present" in notes


LINT_UPSTREAM = textwrap.dedent("""\
    import os
    import json


    def dump(x):
        return json.dumps(x)


    def keep(y):
        return y
    """)


def lint_project(tmp_path: Path, new_text: str, utils: str = "X = 1\n") -> Project:
    p = Project(tmp_path / "lint")
    p.write_snapshot({"srt/m.py": LINT_UPSTREAM})
    p.add_patch("0001-edit.patch", udiff("srt/m.py", LINT_UPSTREAM, new_text))
    p.utils.write_text(utils)
    build(p.inputs())
    return p


def test_gate5_ignores_upstream_noise(tmp_path):
    """`import os` is unused upstream (F401 at line 1); a patch elsewhere does not fail the gate."""
    p = lint_project(tmp_path, edit(LINT_UPSTREAM, "return y", "return y + 1"))
    r = gate_lint.run(ctx_for(p), NOOP)
    assert r.status == PASS, r.details


def test_gate5_flags_undefined_name_on_a_changed_line(tmp_path):
    p = lint_project(tmp_path, edit(LINT_UPSTREAM, "return y", "return y + undefined_thing"))
    r = gate_lint.run(ctx_for(p), NOOP)
    assert r.status == FAIL
    assert len(r.details) == 1 and r.details[0].startswith("srt/m.py:10:") and "F821" in r.details[0]


def test_gate5_flags_an_import_left_unused_by_the_patch(tmp_path):
    """The patch removes json's only use: F401 appears on an unchanged line (line 2)."""
    p = lint_project(tmp_path, edit(LINT_UPSTREAM, "return json.dumps(x)", "return repr(x)"))
    r = gate_lint.run(ctx_for(p), NOOP)
    assert r.status == FAIL
    assert len(r.details) == 1 and r.details[0].startswith("srt/m.py:2:") and "json" in r.details[0]


def test_gate5_lints_ddtree_utils_in_full(tmp_path):
    p = lint_project(tmp_path, edit(LINT_UPSTREAM, "return y", "return y + 1"), utils="import sys\n\nX = 1\n")
    r = gate_lint.run(ctx_for(p), NOOP)
    assert r.status == FAIL and r.details[0].startswith("srt/speculative/ddtree_utils.py:1:")


@pytest.mark.parametrize(("rc", "status"), [(0, PASS), (77, SKIP), (1, FAIL)])
def test_gate6_maps_the_smoke_exit_code(built, tmp_path, rc, status):
    root = tmp_path / "fake_repo"
    (root / "checks").mkdir(parents=True)
    (root / "checks" / "__init__.py").write_text("")
    # A stand-in for the real checks/sglang_smoke.py (which needs the sglang test environment):
    # it checks the arguments the gate passes and exits with the code under test.
    (root / "checks" / "sglang_smoke.py").write_text(
        textwrap.dedent(f"""\
        import pathlib, sys
        assert sys.argv[1] == "--build" and (pathlib.Path(sys.argv[2]) / "BUILD-MANIFEST.json").is_file()
        print("smoke says {rc}")
        sys.exit({rc})
        """)
    )
    r = gate_smoke.run(ctx_for(built, repo_root=root), NOOP)
    assert r.status == status and r.summary == f"smoke says {rc}"
    assert gate_smoke.run(ctx_for(built, repo_root=tmp_path), NOOP).status == SKIP  # no module


def test_gate7_runs_ddtree_utils_tests(built):
    ctx = ctx_for(built)
    assert gate_unit.run(ctx, NOOP).status == SKIP
    built.tests_dir.mkdir()
    (built.tests_dir / "test_ddtree_utils_a.py").write_text("def test_a():\n    assert sum([1, 2]) == 3\n")
    r = gate_unit.run(ctx, NOOP)
    assert r.status == PASS and "1 passed" in r.summary
    (built.tests_dir / "test_ddtree_utils_b.py").write_text("def test_b():\n    assert sorted([2, 1]) == [2, 1]\n")
    r = gate_unit.run(ctx, NOOP)
    assert r.status == FAIL and "1 failed" in r.summary


def test_gate7_runs_the_fast_tier_only(built):
    """Gate 7 deselects the tiers `make test` adds (interp, stat, slow) and keeps smoke tests."""
    built.tests_dir.mkdir()
    (built.tests_dir / "test_ddtree_utils_a.py").write_text(textwrap.dedent("""
        import pytest

        def test_fast():
            assert 1 + 1 == 2

        @pytest.mark.smoke
        def test_smoke():
            assert 2 * 2 == 4

        @pytest.mark.stat
        def test_stat():
            raise AssertionError("a statistical test ran in the gate")

        @pytest.mark.interp
        def test_interp():
            raise AssertionError("an interpreter test ran in the gate")
    """))
    r = gate_unit.run(ctx_for(built), NOOP)
    assert r.status == PASS and "2 passed, 2 deselected" in r.summary, r.summary


def test_gate_results_are_reused_while_their_inputs_are_unchanged(built, tmp_path, monkeypatch):
    """A passing gate 7 is reused (not run) while ddtree_utils.py and its tests keep their bytes;
    an edit of either, a failure, or reuse=False (`--fresh`) runs it; the record is the
    DDTREE_GATE_CACHE file; other gates always run."""
    monkeypatch.setenv("DDTREE_GATE_CACHE", str(tmp_path / "gates.json"))
    ctx = ctx_for(built)
    built.tests_dir.mkdir()
    runs = built.tests_dir / "runs.txt"
    test = built.tests_dir / "test_ddtree_utils_a.py"
    test.write_text(f"def test_a():\n    open({str(runs)!r}, 'a').write('x')\n")

    def gate7(reuse=True):
        (r,) = run_gates(ctx, [gate_unit], reuse=reuse)
        return r, len(runs.read_text()) if runs.exists() else 0

    r, n = gate7()
    assert (r.status, r.reused, n) == (PASS, False, 1)
    r, n = gate7()
    assert (r.status, r.reused, n) == (PASS, True, 1) and r.reused_from and "1 passed" in r.summary
    assert r.to_json()["reused"] is True and r.to_json()["reused_from"] == r.reused_from
    r, n = gate7(reuse=False)  # --fresh
    assert (r.reused, n) == (False, 2)
    built.utils.write_text(built.utils.read_text() + "\nEXTRA = 1\n")  # the module under test changed
    r, n = gate7()
    assert (r.reused, n) == (False, 3)
    record = json.loads((tmp_path / "gates.json").read_text())
    assert list(record) == [f"{ctx.version}/7"]
    test.write_text(test.read_text() + "    assert False\n")  # a failing result is never reused
    r, n = gate7()
    assert (r.status, n) == (FAIL, 4) and json.loads((tmp_path / "gates.json").read_text()) == {}
    (r_snap,) = run_gates(ctx, [gate_snapshot])
    assert not r_snap.reused
    monkeypatch.setenv("DDTREE_GATE_CACHE", "off")
    assert cache_path(ctx) is None


def test_a_crashing_gate_is_a_failure_not_an_abort(built):
    class Broken:
        NUMBER, NAME = 9, "broken"

        @staticmethod
        def run(ctx, step):
            raise RuntimeError("bug in a gate")

    results = run_gates(ctx_for(built), [Broken, gate_snapshot])
    assert [r.status for r in results] == [FAIL, PASS]
    assert "bug in a gate" in results[0].summary


def test_real_repository_build_passes_structural_gates(tmp_path):
    """Gates 1-5 on a fresh build of the repository's own snapshot and series."""
    from ddtree_deploy.deploy.build.build import Inputs

    ctx = Context(inputs=Inputs(build_root=tmp_path / "build"), repo_root=REPO_ROOT)
    build(ctx.inputs)
    results = run_gates(ctx, select(["1", "2", "3", "4", "5"]))
    failures = {r.number: (r.summary, r.details) for r in results if r.status != PASS}
    assert failures == {}
