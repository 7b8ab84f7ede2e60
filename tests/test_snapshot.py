"""The vendored snapshot: verification, imports from a wheel or an installed package, drift checks."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import shutil
import zipfile
from pathlib import Path

import pytest
from ddtree_deploy.deploy.build import snapshot as snap
from ddtree_deploy.deploy.errors import (
    EXIT_SNAPSHOT,
    EXIT_USAGE,
    ConfigError,
    SnapshotError,
    UsageError,
)
from foundation_support import REPO_ROOT, UPSTREAM, error_lines, sha

REAL = snap.snapshot_dir_for(snap.PINNED_VERSION, REPO_ROOT / "snapshot")


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}\n"


def make_wheel(dest: Path, version: str, files: dict[str, str], tamper: str | None = None) -> Path:
    """A real wheel archive holding sglang/<files> and a RECORD (optionally wrong for `tamper`)."""
    wheel = dest / f"sglang-{version}-py3-none-any.whl"
    record = ""
    with zipfile.ZipFile(wheel, "w") as zf:
        for rel, text in files.items():
            zf.writestr(f"sglang/{rel}", text)
            record += _record_line(f"sglang/{rel}", (text + "# other\n" if rel == tamper else text).encode())
        zf.writestr(f"sglang-{version}.dist-info/RECORD", record)
    return wheel


def make_site(dest: Path, version: str, files: dict[str, str]) -> Path:
    """An installed sglang: site/sglang/... plus site/sglang-V.dist-info/RECORD."""
    site = dest / "site-packages"
    record = ""
    for rel, text in {"__init__.py": "", **files}.items():
        p = site / "sglang" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        record += _record_line(f"sglang/{rel}", text.encode())
    info = site / f"sglang-{version}.dist-info"
    info.mkdir()
    (info / "RECORD").write_text(record)
    return site


# --- the real vendored snapshot --------------------------------------------------------------


def test_real_snapshot_matches_its_manifest():
    manifest = snap.verify(REAL)
    assert manifest.sglang_version == snap.PINNED_VERSION
    assert set(snap.DEFAULT_FILES) <= set(manifest.files)
    for rel, digest in manifest.files.items():
        assert hashlib.sha256((REAL / rel).read_bytes()).hexdigest() == digest
    assert manifest.wheel_name.startswith(f"sglang-{snap.PINNED_VERSION}-")


def _installed_site() -> Path | None:
    """site-packages of the installed sglang distribution (not an overlay earlier on sys.path)."""
    try:
        return Path(importlib.metadata.distribution("sglang").locate_file(""))
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.skipif(_installed_site() is None, reason="sglang is not installed here")
def test_real_snapshot_equals_the_installed_upstream_package(ddtree):
    """The installed sglang==0.5.13.post1 (its files checked against RECORD) has the same bytes."""
    site = _installed_site()
    source = snap.site_packages_source(site)
    if source.version != snap.PINNED_VERSION:
        pytest.skip(f"installed sglang is {source.version}")
    assert snap.compare_with_source(source, REAL) == []
    r = ddtree("snapshot", "import", "--from-site-packages", site, "--check", "--snapshot-dir", REAL, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["drifted"] == []


def test_registry_wheel_reproduces_the_snapshot(tmp_path, ddtree):
    """`snapshot import` from the registry (pip download, cached in .cache/wheels) rewrites every
    file of a copy of the snapshot with the same bytes and the same manifest."""
    try:
        snap.download_wheel(snap.PINNED_VERSION)
    except ConfigError as exc:  # no network and no cached wheel
        pytest.skip(str(exc))
    copy = tmp_path / "snap"
    shutil.copytree(REAL, copy)
    for rel in snap.load_manifest(copy).files:
        (copy / rel).unlink()
    r = ddtree("snapshot", "import", "--version", snap.PINNED_VERSION, "--snapshot-dir", copy, "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(r.stdout)["updated"]) == sorted(snap.load_manifest(REAL).files)
    assert (copy / "MANIFEST.json").read_bytes() == (REAL / "MANIFEST.json").read_bytes()
    snap.verify(copy)


# --- verification errors ---------------------------------------------------------------------


def test_hand_edited_file_is_named_with_exit_code_4(project, ddtree):
    target = project.snapshot_dir / "srt/other.py"
    target.write_text(target.read_text().replace("VALUE_3 = 3", "VALUE_3 = 4"))
    with pytest.raises(SnapshotError) as exc:
        snap.verify(project.snapshot_dir)
    assert exc.value.exit_code == EXIT_SNAPSHOT
    assert "srt/other.py" in exc.value.message
    r = ddtree("snapshot", "verify", "--snapshot-dir", project.snapshot_dir)
    assert r.returncode == EXIT_SNAPSHOT
    (line,) = error_lines(r.stderr)
    assert "srt/other.py" in line and "differs" in line


def test_missing_and_unlisted_files_are_reported(project):
    (project.snapshot_dir / "srt/other.py").unlink()
    (project.snapshot_dir / "srt/stray.py").write_text("x = 1\n")
    problems = {(p.relpath, p.kind) for p in snap.find_problems(project.snapshot_dir)}
    assert problems == {("srt/other.py", "missing"), ("srt/stray.py", "unlisted")}
    with pytest.raises(SnapshotError, match="and 1 more"):
        snap.verify(project.snapshot_dir)


def test_malformed_or_missing_manifest_is_a_usage_error(project, ddtree):
    mpath = project.snapshot_dir / "MANIFEST.json"
    mpath.write_text("{not json")
    with pytest.raises(ConfigError, match="malformed"):
        snap.load_manifest(project.snapshot_dir)
    mpath.unlink()
    r = ddtree("snapshot", "verify", "--snapshot-dir", project.snapshot_dir)
    assert r.returncode == EXIT_USAGE
    assert "MANIFEST.json" in error_lines(r.stderr)[0]


def test_verify_json_lists_problems(project, cli):
    (project.snapshot_dir / "srt/speculative/mod.py").write_text("changed\n")
    r = cli("snapshot", "verify", "--snapshot-dir", project.snapshot_dir, "--json")
    assert isinstance(r.exception, SnapshotError)
    assert json.loads(r.stdout)["problems"] == [{"path": "srt/speculative/mod.py", "kind": "modified"}]


# --- imports ---------------------------------------------------------------------------------


def test_import_from_wheel_is_incremental(tmp_path):
    wheel = make_wheel(tmp_path, "1.2.3", UPSTREAM)
    dest = tmp_path / "snapshot" / "sglang-1.2.3"
    first = snap.import_files(snap.wheel_source(wheel), dest, ["srt/other.py"])
    assert first.added == ["srt/other.py"]
    second = snap.import_files(snap.wheel_source(wheel), dest, ["sglang/srt/speculative/mod.py"])
    assert second.added == ["srt/speculative/mod.py"]
    manifest = snap.verify(dest)
    assert manifest.files == {rel: sha(text) for rel, text in UPSTREAM.items()}
    assert manifest.wheel_name == wheel.name
    assert manifest.wheel_sha256 == hashlib.sha256(wheel.read_bytes()).hexdigest()
    # re-import without --file refreshes the manifest's files and changes nothing
    again = snap.import_files(snap.wheel_source(wheel), dest)
    assert sorted(again.unchanged) == sorted(UPSTREAM) and not again.added and not again.updated


def test_import_refuses_bytes_that_contradict_record(tmp_path):
    wheel = make_wheel(tmp_path, "1.2.3", UPSTREAM, tamper="srt/other.py")
    dest = tmp_path / "snap"
    with pytest.raises(SnapshotError, match="RECORD"):
        snap.import_files(snap.wheel_source(wheel), dest, ["srt/other.py"])
    assert not dest.exists()  # nothing written


def test_import_errors_are_clear(tmp_path):
    wheel = make_wheel(tmp_path, "1.2.3", UPSTREAM)
    dest = tmp_path / "snap"
    with pytest.raises(UsageError, match="not in"):
        snap.import_files(snap.wheel_source(wheel), dest, ["srt/nope.py"])
    with pytest.raises(UsageError, match="bad snapshot path"):
        snap.import_files(snap.wheel_source(wheel), dest, ["../etc/passwd"])
    snap.import_files(snap.wheel_source(wheel), dest, ["srt/other.py"])
    other = make_wheel(tmp_path, "2.0.0", UPSTREAM)
    with pytest.raises(UsageError, match="new pin"):
        snap.import_files(snap.wheel_source(other), dest)


def test_cli_import_from_site_packages_and_drift_check(tmp_path, ddtree):
    site = make_site(tmp_path, "3.4.5", UPSTREAM)
    root = tmp_path / "snapshot"
    args = ["snapshot", "import", "--version", "3.4.5", "--from-site-packages", site, "--snapshot-root", root]
    r = ddtree(*args, "--file", "srt/other.py", "--file", "srt/speculative/mod.py", "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(r.stdout)["added"]) == sorted(UPSTREAM)
    snap.verify(root / "sglang-3.4.5")
    assert ddtree(*args, "--check").returncode == 0
    # A host that edited its installed file: the drift check names it (exit 4) and writes nothing.
    installed = site / "sglang/srt/other.py"
    installed.write_text(installed.read_text() + "HOTFIX = 1\n")
    before = (root / "sglang-3.4.5" / "MANIFEST.json").read_bytes()
    r = ddtree(*args, "--check")
    assert r.returncode == EXIT_SNAPSHOT and "srt/other.py" in error_lines(r.stderr)[0]
    # importing from it is refused too: the file contradicts the package's RECORD
    r = ddtree(*args)
    assert r.returncode == EXIT_SNAPSHOT and "RECORD" in error_lines(r.stderr)[0]
    assert (root / "sglang-3.4.5" / "MANIFEST.json").read_bytes() == before
    # wrong version requested
    r = ddtree("snapshot", "import", "--version", "9.9", "--from-site-packages", site, "--snapshot-root", root)
    assert r.returncode == EXIT_USAGE and "3.4.5" in error_lines(r.stderr)[0]


def test_cli_import_from_local_wheel(tmp_path, cli):
    wheel = make_wheel(tmp_path, "1.0.0", UPSTREAM)
    r = cli(
        "snapshot",
        "import",
        "--version",
        "1.0.0",
        "--wheel",
        wheel,
        "--snapshot-root",
        tmp_path / "s",
        "--file",
        "srt/other.py",
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["added"] == ["srt/other.py"]
    assert snap.load_manifest(tmp_path / "s" / "sglang-1.0.0").wheel_name == wheel.name


def test_new_pin_imports_the_files_of_the_current_pin(tmp_path, cli):
    """A new version's snapshot starts with the files the current snapshot holds."""
    current = snap.load_manifest(REAL).files
    wheel = make_wheel(tmp_path, "7.0.0", {rel: f"# {rel} in 7.0.0\n" for rel in current})
    r = cli("snapshot", "import", "--version", "7.0.0", "--wheel", wheel, "--snapshot-root", tmp_path / "s", "--json")
    assert r.exit_code == 0, r.output
    assert sorted(json.loads(r.stdout)["added"]) == sorted(current)
    assert snap.verify(tmp_path / "s" / "sglang-7.0.0").sglang_version == "7.0.0"


def test_version_from_package_files_without_dist_info(tmp_path):
    site = make_site(tmp_path, "1.1.1", UPSTREAM)
    shutil.rmtree(site / "sglang-1.1.1.dist-info")
    (site / "sglang" / "version.py").write_text(
        "try:\n    from sglang._version import __version__\nexcept ImportError:\n    __version__ = '0.0.0.dev0'\n"
    )
    (site / "sglang" / "_version.py").write_text("__version__ = version = '1.1.1'\n")
    assert snap.site_packages_source(site).version == "1.1.1"
    (site / "sglang" / "_version.py").unlink()
    with pytest.raises(UsageError, match="cannot tell"):
        snap.site_packages_source(site / "sglang")
