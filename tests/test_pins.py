"""Pins (deploy/build/pins.py): every build-side command per pin, on a synthetic project with two pins
(snapshot/sglang-<V>/ + patches/<V>/series each), and the repository's own pins against their
real SGLang (gate 6, the 0.5.16 test site)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ddtree_deploy.deploy.build import pins
from ddtree_deploy.deploy.build.build import build
from ddtree_deploy.deploy.build.buildinfo import GATES_RECORD, MANIFEST_NAME, load_build
from ddtree_deploy.deploy.build.series import load_series
from ddtree_deploy.deploy.errors import (
    EXIT_OK,
    EXIT_SNAPSHOT,
    EXIT_USAGE,
    ConfigError,
    UsageError,
)
from foundation_support import REPO_ROOT, UPSTREAM, Project, edit, error_lines, udiff

MOD = "srt/speculative/mod.py"
FAST = ["--skip", "6", "--skip", "7"]
OLD, NEW = "0.9.2", "0.10.0"  # numeric order differs from string order: 0.9.2 < 0.10.0


class Pins:
    """Two pins in one synthetic repository; OLD has two patches, NEW one (its own 0001)."""

    def __init__(self, root: Path):
        self.root = root
        self.snapshot_root, self.patches_root = root / "snapshot", root / "patches"
        self.build_root, self.utils = root / "build", root / "ddtree_utils.py"
        root.mkdir(parents=True)
        self.utils.write_text('"""Stand-in ddtree_utils.py."""\n\nBUDGET = 4\n')
        self.p = {}
        for v in (OLD, NEW):
            proj = Project(root, v)
            proj.patches_dir = self.patches_root / v
            proj.write_snapshot(UPSTREAM)
            proj.patches_dir.mkdir(parents=True)
            (proj.patches_dir / "series").write_text(f"# series of {v}\n")
            self.p[v] = proj
        mod = UPSTREAM[MOD]
        mod1 = edit(mod, "return x + 1", "return x + 10")
        self.p[OLD].add_patch("0001-alpha.patch", udiff(MOD, mod, mod1), desc="Alpha (old pin).")
        self.p[OLD].add_patch("0002-beta.patch", udiff(MOD, mod1, edit(mod1, "return y * 2", "return y * 20")),
                              desc="Beta (old pin).")
        self.p[NEW].add_patch("0001-alpha.patch", udiff(MOD, mod, edit(mod, "return x + 1", "return x + 7")),
                              desc="Alpha (new pin).")

    def args(self) -> list[str]:
        return ["--snapshot-root", str(self.snapshot_root), "--patches-root", str(self.patches_root),
                "--build-dir", str(self.build_root), "--ddtree-utils", str(self.utils)]

    def build_dir(self, v: str) -> Path:
        return self.build_root / f"sglang-{v}"


@pytest.fixture
def two(tmp_path) -> Pins:
    return Pins(tmp_path / "repo")


def test_pins_are_the_snapshot_dirs_in_version_order(two):
    got = pins.list_pins(two.snapshot_root, two.patches_root)
    assert [p.version for p in got] == [OLD, NEW]
    assert [p.patches_dir for p in got] == [two.patches_root / OLD, two.patches_root / NEW]
    assert pins.select(NEW, two.snapshot_root, two.patches_root)[0].snapshot_dir == two.snapshot_root / f"sglang-{NEW}"
    with pytest.raises(UsageError, match=f"no pin '1.0' \\(pins: {OLD}, {NEW}\\)"):
        pins.select("1.0", two.snapshot_root, two.patches_root)
    with pytest.raises(ConfigError, match="no pins"):
        pins.select(None, two.root / "nothing", two.patches_root)


def test_the_repository_pins():
    got = [p.version for p in pins.list_pins()]
    assert "0.5.13.post1" in got and "0.5.16" in got
    assert all((REPO_ROOT / "patches" / v / "series").is_file() for v in got)


def test_patch_builds_every_pin_with_its_own_series_and_gates(two, ddtree):
    r = ddtree("patch", *two.args(), *FAST, "--json")
    assert r.returncode == EXIT_OK, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and [d["pin"] for d in doc["pins"]] == [OLD, NEW]
    assert "build" not in doc  # several pins: no single build at the top
    for d in doc["pins"]:
        v = d["pin"]
        info = load_build(two.build_dir(v))
        assert d["build"]["build_id"] == info.build_id and info.sglang_version == v
        assert info.patches == load_series(two.patches_root / v).names
        rec = json.loads((two.build_dir(v) / GATES_RECORD).read_text())
        assert rec["build_id"] == info.build_id and set(rec["gates"]) == {"1", "2", "3", "4", "5"}
        assert [g["gate"] for g in d["gates"]] == [1, 2, 3, 4, 5] and all(g["status"] == "pass" for g in d["gates"])
        assert f"sglang {v}" in r.stderr
    old, new = (two.build_dir(v) / MOD for v in (OLD, NEW))
    assert "return x + 10" in old.read_text() and "return y * 20" in old.read_text()
    assert "return x + 7" in new.read_text() and "return y * 2\n" in new.read_text()


def test_the_pin_is_part_of_the_build_id(two):
    """The same files built for two pins (identical series): two build ids."""
    (two.patches_root / NEW / "0001-alpha.patch").unlink()
    for name in ("0001-alpha.patch", "0002-beta.patch"):
        (two.patches_root / NEW / name).write_bytes((two.patches_root / OLD / name).read_bytes())
    (two.patches_root / NEW / "series").write_text("0001-alpha.patch\n0002-beta.patch\n")
    infos = [build(p.inputs(two.build_root, two.utils)).info for p in pins.list_pins(two.snapshot_root, two.patches_root)]
    files = [{r: f.sha256 for r, f in i.files.items()} for i in infos]
    assert files[0] == files[1] and infos[0].build_id != infos[1].build_id


def test_patch_one_pin_leaves_the_other_alone(two, ddtree):
    r = ddtree("patch", "--pin", NEW, *two.args(), *FAST, "--json")
    assert r.returncode == EXIT_OK, r.stderr
    doc = json.loads(r.stdout)
    assert [d["pin"] for d in doc["pins"]] == [NEW] and doc["build"]["sglang_version"] == NEW  # one pin: also on top
    assert not two.build_dir(OLD).exists()
    r = ddtree("patch", "--pin", "7.7", *two.args(), *FAST)
    assert r.returncode == EXIT_USAGE and f"pins: {OLD}, {NEW}" in error_lines(r.stderr)[0]


def test_an_empty_series_is_skipped_over_every_pin_and_built_when_named(two, ddtree):
    (two.patches_root / NEW / "0001-alpha.patch").unlink()
    (two.patches_root / NEW / "series").write_text("# nothing yet\n")
    r = ddtree("patch", *two.args(), *FAST, "--json")
    assert r.returncode == EXIT_OK, r.stderr
    doc = json.loads(r.stdout)
    skipped = [d for d in doc["pins"] if "skipped" in d]
    assert [d["pin"] for d in skipped] == [NEW] and "lists no patch" in skipped[0]["skipped"]
    assert f"sglang {NEW}: skipped" in r.stderr and not two.build_dir(NEW).exists()
    r = ddtree("check", *two.args(), *FAST)  # check skips it the same way
    assert r.returncode == EXIT_OK and f"sglang {NEW}: skipped" in r.stderr
    r = ddtree("patch", "--pin", NEW, *two.args(), *FAST, "--json")
    assert r.returncode == EXIT_OK, r.stderr
    info = load_build(two.build_dir(NEW))
    assert info.patches == [] and (two.build_dir(NEW) / MOD).read_text() == UPSTREAM[MOD]
    assert (two.build_dir(NEW) / "srt/speculative/ddtree_utils.py").read_bytes() == two.utils.read_bytes()


def test_a_broken_pin_does_not_stop_the_others_and_sets_the_exit_code(two, ddtree):
    p = two.patches_root / NEW / "0001-alpha.patch"
    p.write_text(p.read_text().replace("-    return x + 1", "-    return x + 99"))
    r = ddtree("patch", *two.args(), *FAST, "--json")
    assert r.returncode == 3, r.stderr  # the patch does not apply: exit 3, as with one pin
    doc = json.loads(r.stdout)
    by = {d["pin"]: d for d in doc["pins"]}
    assert by[OLD]["ok"] is True and by[NEW]["ok"] is False and by[NEW]["exit_code"] == 3
    assert doc["ok"] is False and doc["exit_code"] == 3 and "0001-alpha.patch" in doc["error"]
    assert load_build(two.build_dir(OLD)).sglang_version == OLD and not two.build_dir(NEW).exists()


def test_check_per_pin_names_the_failing_pin(two, ddtree):
    build(pins.select(OLD, two.snapshot_root, two.patches_root)[0].inputs(two.build_root, two.utils))
    build(pins.select(NEW, two.snapshot_root, two.patches_root)[0].inputs(two.build_root, two.utils))
    (two.build_dir(NEW) / MOD).write_text("tampered\n")
    r = ddtree("check", *two.args(), *FAST, "--json")
    assert r.returncode == 1
    by = {d["pin"]: d for d in json.loads(r.stdout)["pins"]}
    assert by[OLD]["ok"] is True and by[NEW]["ok"] is False
    (line,) = error_lines(r.stderr)
    assert f"sglang {NEW}: 3 (round trip)" in line and OLD not in line
    r = ddtree("check", "--pin", OLD, *two.args(), *FAST)
    assert r.returncode == EXIT_OK, r.stderr


def test_gate_7_runs_once_for_every_pin(two, tmp_path):
    """The ddtree_utils tests do not depend on the pin: one pytest run, its result recorded per pin."""
    from ddtree_deploy.checks import registry
    from ddtree_deploy.deploy.cli.build_cmds import _gate_pins

    tests = tmp_path / "tests"
    tests.mkdir()
    runs = tmp_path / "runs"
    (tests / "test_ddtree_utils_once.py").write_text(
        f"def test_counted():\n    with open({str(runs)!r}, 'a') as f:\n        f.write('x')\n")
    every = pins.list_pins(two.snapshot_root, two.patches_root)
    for p in every:
        build(p.inputs(two.build_root, two.utils))
    results = _gate_pins(every, registry.select(["1", "7"]), two.build_root, two.utils, [], tests_dir=tests)
    assert runs.read_text() == "x"
    for p in every:
        (unit,) = [r for r in results[p.version] if r.number == 7]
        assert unit.status == "pass"
        rec = json.loads((two.build_dir(p.version) / GATES_RECORD).read_text())
        assert rec["gates"]["7"]["status"] == "pass" and rec["gates"]["1"]["status"] == "pass"


def test_series_per_pin(two, ddtree):
    r = ddtree("series", *two.args()[:4], "--json")
    assert r.returncode == EXIT_OK, r.stderr
    doc = {d["pin"]: d for d in json.loads(r.stdout)["pins"]}
    assert [p["patch"] for p in doc[OLD]["patches"]] == ["0001-alpha.patch", "0002-beta.patch"]
    assert [p["description"] for p in doc[NEW]["patches"]] == ["Alpha (new pin)."]
    r = ddtree("series", "--pin", NEW, *two.args()[:4])
    assert r.returncode == EXIT_OK and f"sglang {NEW}" in r.stderr and "Alpha (new pin)." in r.stderr
    assert "Beta (old pin)." not in r.stderr
    r = ddtree("patch", "--patches-dir", str(two.patches_root / OLD), *two.args(), *FAST)
    assert r.returncode == EXIT_USAGE and "give --pin" in error_lines(r.stderr)[0]


def test_refresh_needs_the_pin_only_when_the_patch_is_ambiguous(two, ddtree):
    for p in pins.list_pins(two.snapshot_root, two.patches_root):
        build(p.inputs(two.build_root, two.utils))
    f = two.build_dir(OLD) / MOD
    f.write_text(f.read_text().replace("return y * 20", "return y * 200"))
    before = {p: p.read_bytes() for p in two.patches_root.rglob("*.patch")}
    r = ddtree("refresh", "0001", *two.args())  # both series have a 0001
    assert r.returncode == EXIT_USAGE
    assert f"several pins ({OLD}, {NEW}): give --pin" in error_lines(r.stderr)[0]
    assert {p: p.read_bytes() for p in two.patches_root.rglob("*.patch")} == before
    r = ddtree("refresh", "0002-beta.patch", *two.args(), "--json")  # only the old pin has it
    assert r.returncode == EXIT_OK, r.stderr
    doc = json.loads(r.stdout)
    assert doc["pin"] == OLD and doc["changed"] is True
    assert "+    return y * 200" in (two.patches_root / OLD / "0002-beta.patch").read_text()
    r = ddtree("refresh", "--pin", NEW, "0001", *two.args(), "--json")  # nothing edited in the new pin
    assert r.returncode == EXIT_OK and json.loads(r.stdout)["pin"] == NEW
    r = ddtree("refresh", "0009", *two.args())
    assert r.returncode == EXIT_USAGE and "in no pin's series" in error_lines(r.stderr)[0]


def test_snapshot_verify_per_pin(two, ddtree):
    r = ddtree("snapshot", "verify", "--snapshot-root", str(two.snapshot_root), "--json")
    assert r.returncode == EXIT_OK and [d["pin"] for d in json.loads(r.stdout)["pins"]] == [OLD, NEW]
    bad = two.snapshot_root / f"sglang-{NEW}" / MOD
    bad.write_text(bad.read_text() + "# edited\n")
    r = ddtree("snapshot", "verify", "--snapshot-root", str(two.snapshot_root), "--json")
    assert r.returncode == EXIT_SNAPSHOT and str(bad) in error_lines(r.stderr)[0]
    by = {d["pin"]: d for d in json.loads(r.stdout)["pins"]}
    assert by[OLD]["problems"] == [] and by[NEW]["problems"] == [{"path": MOD, "kind": "modified"}]
    r = ddtree("snapshot", "verify", "--pin", OLD, "--snapshot-root", str(two.snapshot_root))
    assert r.returncode == EXIT_OK, r.stderr


# --- the real SGLang of each pin ------------------------------------------------------------------

SITE_0516 = pins.sglang_site("0.5.16")
needs_0516 = pytest.mark.skipif(
    SITE_0516 is None, reason=f"no sglang 0.5.16 test site in {pins.sites_root()} (scripts/install_sglang_env.sh)"
)


def test_site_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv(pins.SITES_ENV, str(tmp_path))
    assert pins.sglang_site("1.2.3") is None
    (tmp_path / "1.2.3" / "sglang").mkdir(parents=True)
    (tmp_path / "1.2.3" / "sglang" / "__init__.py").write_text("")
    assert pins.sglang_site("1.2.3") == tmp_path / "1.2.3"
    env = pins.sglang_env("1.2.3", env={"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path / "1.2.3"), "/x"])
    assert "PYTHONPATH" not in pins.sglang_env("4.5", env={})


@pytest.mark.sglang
@pytest.mark.slow
@needs_0516
def test_the_0516_site_imports_on_cpu():
    """sglang 0.5.16 from its site (ahead of the venv's 0.5.13.post1), TRITON_INTERPRET=1."""
    code = (
        "import importlib, importlib.metadata as m, sglang\n"
        "for n in ['sglang.srt.server_args', 'sglang.srt.speculative.dflash_worker_v2',\n"
        "          'sglang.srt.speculative.dflash_info_v2', 'sglang.srt.managers.schedule_batch']:\n"
        "    importlib.import_module(n)\n"
        "print(m.version('sglang'), sglang.__file__)\n"
    )
    env = dict(pins.sglang_env("0.5.16"), TRITON_INTERPRET="1", SGLANG_LOGGING_LEVEL="WARNING")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, where = proc.stdout.split()[-2:]
    assert version == "0.5.16" and Path(where).resolve().is_relative_to(SITE_0516.resolve())


@pytest.mark.sglang
@pytest.mark.slow
@needs_0516
def test_gate_6_uses_the_sglang_of_the_pin(tmp_path, ddtree):
    """The repository's 0.5.16 pin (its series, or the snapshot alone while it is empty) is
    smoke-tested against the real sglang 0.5.16; the same build against the venv's sglang
    0.5.13.post1 is skipped with the reason, never passed. About 60 s on 2 busy cores: it builds
    the 0.5.16 pin (patches and gates 1-6, gate 6 importing the real sglang 0.5.16 in its own
    interpreter), then runs the smoke against the other pin's sglang as well."""
    from ddtree_deploy.checks import sglang_smoke

    r = ddtree("patch", "--pin", "0.5.16", "--build-dir", str(tmp_path), "--skip", "7", "--json")
    assert r.returncode == EXIT_OK, r.stderr[-3000:]
    (smoke,) = [g for g in json.loads(r.stdout)["gates"] if g["gate"] == 6]
    assert smoke["status"] == "pass" and "into sglang 0.5.16" in smoke["summary"], smoke
    assert "spec-v2 tree round matches the reference" in smoke["summary"], smoke
    bdir = tmp_path / "sglang-0.5.16"
    assert json.loads((bdir / MANIFEST_NAME).read_text())["sglang_version"] == "0.5.16"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO_ROOT)  # the venv's own sglang (0.5.13.post1), not the pin's
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "checks" / "sglang_smoke.py"), "--build", str(bdir)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == sglang_smoke.SKIPPED, proc.stdout + proc.stderr[-2000:]
    assert "the build is for 0.5.16" in proc.stdout

    # a 0.5.16 build whose KV move reads the wrong verify slot fails the round probe
    info = bdir / "srt/speculative/ddtree_utils.py"  # kv_path_locs, the round pieces' home
    text = info.read_text()
    good = "    return slots[:, :k], slots[:, :n].gather(1, path[:, :k].to(torch.int64))\n"
    assert good in text
    info.write_text(text.replace(good, "    return slots[:, :k], slots[:, :n].gather(1, path[:, :k].to(torch.int64).flip(1))\n"))
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "checks" / "sglang_smoke.py"), "--build", str(bdir)], cwd=REPO_ROOT,
                          env=pins.sglang_env("0.5.16"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == sglang_smoke.FAILED, proc.stdout + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("sglang smoke FAILED") and "kv move_kv" in summary, summary
