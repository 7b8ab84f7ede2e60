"""push / plan / status pick the build of the pin matching each host's installed SGLang version
(deploy.build.pins), against real test hosts over real sshd: ct200 (sglang 0.5.13.post1, the bed's),
`pin16`, whose service python sees the real sglang 0.5.16 test site, and `pin14`, a real sglang
0.5.14 install (a version without a pin), which is refused with the list of pins."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import deploy_testbed as tb
import pytest
from ddtree_deploy.deploy.build import pins
from ddtree_deploy.deploy.build.build import Inputs, build
from ddtree_deploy.deploy.build.buildinfo import sha256_file
from ddtree_deploy.deploy.build.series import load_series
from deploy_cli import host_toml, run_cli

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(600)]

PIN16, UNPINNED = "0.5.16", "0.5.14"
FIXTURE_FILE = "srt/speculative/dflash_info_v2.py"
FIXTURE_HEADER = textwrap.dedent("""\
    Description: Test-bed fixture series for the 0.5.16 pin (used while its real series is empty).
    Origin: vendor, ddtree-deploy tests
    Forwarded: not-needed
    Last-Update: 2026-12-02
    ---
    """)


def fixture_series(dest: Path, snapshot_dir: Path) -> Path:
    """One patch adding a marker line to dflash_info_v2.py (a diff made here with difflib)."""
    import difflib

    old = (snapshot_dir / FIXTURE_FILE).read_text()
    new = old + '\nDDTREE_DEPLOY_TEST_PIN = "0.5.16"  # test-bed fixture series\n'
    diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{FIXTURE_FILE}", f"b/{FIXTURE_FILE}"))
    dest.mkdir(parents=True)
    (dest / "0001-test-pin-marker.patch").write_text(FIXTURE_HEADER + f"diff --git a/{FIXTURE_FILE} b/{FIXTURE_FILE}\n" + diff)
    (dest / "series").write_text("0001-test-pin-marker.patch\n")
    return dest


@pytest.fixture(scope="module")
def pin_builds(builds, tmp_path_factory):
    """A build root holding one build per pin: the bed's 0.5.13.post1 build, and the 0.5.16 pin's
    (the repository's snapshot with its series, or with the fixture series while that is empty)."""
    root = tmp_path_factory.mktemp("pin-builds")
    good = builds["good"]
    shutil.copytree(good.root, pins.build_dir(good.sglang_version, root))
    (pin,) = pins.select(PIN16)
    series_dir = pin.patches_dir
    if not load_series(series_dir).entries:
        series_dir = fixture_series(root.parent / "pin16-series", pin.snapshot_dir)
    b16 = build(Inputs(pin.snapshot_dir, series_dir, root)).info
    assert b16.sglang_version == PIN16 and b16.root == pins.build_dir(PIN16, root)
    return {"root": root, "0.5.13.post1": good, PIN16: b16}


def _host_toml(ssh, h) -> str:
    argv = ", ".join(f'"{a}"' for a in ["/usr/bin/env", "DDTREE_TEST_SERVICE_ENV=1", *tb.service_argv(h)])
    return textwrap.dedent(f"""\
        [hosts.{h.name}]
        address = "127.0.0.1"
        port = {ssh.port}
        user = "root"
        identity_file = "{ssh.client_key}"
        known_hosts = "{ssh.known_hosts}"
        connect_timeout_s = 5
        python = "{h.python}"
        import_check = false
        state_dir = "{h.state}"
        keep_releases = 3
        command_timeout_s = 120
        restart = {{ strategy = "pidfile", pidfile = "{h.root}/run/service.pid", command = [{argv}], chdir = "{h.root}", log_file = "{h.root}/run/service.log" }}

        [hosts.{h.name}.health]
        url = "http://127.0.0.1:{h.port}"
        deadline_s = 240
        interval_s = 0.5
        expect_algorithm = "{h.algorithm}"
        smoke = {{ text = "The capital of France is", max_new_tokens = 6 }}
        """)


@pytest.fixture(scope="module")
def pin_hosts(bed, tmp_path_factory):
    site16 = pins.sglang_site(PIN16)
    if site16 is None:
        pytest.skip(f"no sglang {PIN16} test site in {pins.sites_root()} (scripts/install_sglang_env.sh)")
    try:
        site14 = tb.sglang_site(UNPINNED)
    except Exception as exc:  # noqa: BLE001 - no wheel reachable: say so
        pytest.skip(f"cannot install sglang {UNPINNED} for the unpinned test host: {exc}")
    root = tmp_path_factory.mktemp("pin-hosts")
    hosts = {"pin16": tb.make_host("pin16", root / "pin16", site16, "DFLASH"),
             "pin14": tb.make_host("pin14", root / "pin14", site14, "DFLASH")}
    inv = root / "hosts.toml"
    ct200 = host_toml(bed["ssh"], bed["hosts"]["ct200"], bed["supervisor"], import_check=False)
    inv.write_text(ct200 + "\n" + "\n".join(_host_toml(bed["ssh"], h) for h in hosts.values()))
    yield {"inventory": inv, **hosts}
    for h in hosts.values():
        tb.sh("start-stop-daemon", "--stop", "--quiet", "--pidfile", str(h.root / "run" / "service.pid"),
              "--retry", "TERM/10/KILL/5", "--remove-pidfile", "--oknodo", check=False)


@pytest.fixture
def env(cli_env, pin_hosts, pin_builds):
    """No --build anywhere: the builds come from the pins' build root."""
    e = dict(cli_env, DDTREE_DEPLOY_HOSTS=str(pin_hosts["inventory"]), DDTREE_DEPLOY_BUILD_ROOT=str(pin_builds["root"]))
    e.pop("DDTREE_DEPLOY_BUILD", None)
    return e


def test_one_push_ships_each_host_the_build_of_its_pin(bed, pin_hosts, pin_builds, site_cache, env):
    ct200, h16 = bed["hosts"]["ct200"], pin_hosts["pin16"]
    b13, b16 = pin_builds["0.5.13.post1"], pin_builds[PIN16]
    assert set(b13.files) != set(b16.files)  # the two pins ship different file sets
    tb.reset_host(ct200, b13, site_cache)
    before13, before16 = tb.tree_digest(ct200.sglang), tb.tree_digest(h16.sglang)
    r = run_cli(["push", "ct200", "pin16", "--json"], env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["build_id"] is None  # no single build: one per pin
    res = {o["host"]: o for o in doc["results"]}
    for host, build, version in (("ct200", b13, "0.5.13.post1"), ("pin16", b16, PIN16)):
        extra = res[host]["extra"]
        assert (extra["build_id"], extra["sglang_version"]) == (build.build_id, version)
        assert (extra["rolled_back"], extra["restarts"], extra["recovered"]) == (False, 1, [])
    assert all(o["ok"] and o["changed"] for o in res.values())
    for h, before, b in ((ct200, before13, b13), (h16, before16, b16)):
        want = dict(before)
        want.update({rel: sha256_file(b.path_of(rel)) for rel in b.files})
        assert tb.tree_digest(h.sglang) == want
    assert f"pins: {', '.join(p.version for p in pins.list_pins())}" in r.stderr
    st = json.loads(run_cli(["status", "pin16", "--json"], env).stdout)
    assert st["healthy"] and st["sglang_version"] == PIN16 and st["build_id"] == b16.build_id
    assert set(st["files"].values()) == {"current"}
    p = run_cli(["plan", "pin16", "--json"], env)
    assert p.returncode == 0 and json.loads(p.stdout)["noop"] is True
    again = run_cli(["push", "pin16", "--json"], env)  # already there: nothing to do
    assert again.returncode == 0 and not json.loads(again.stdout)["results"][0]["changed"]


def test_a_host_whose_version_has_no_pin_is_refused_with_the_pins(pin_hosts, env):
    h = pin_hosts["pin14"]
    before = tb.tree_digest(h.sglang)
    listed = ", ".join(p.version for p in pins.list_pins())
    assert UNPINNED not in listed
    for cmd in (["push", "pin14"], ["plan", "pin14"]):
        r = run_cli([*cmd, "--json"], env)
        assert r.returncode == 6, r.stderr
        msg = json.loads(r.stdout).get("error") or json.loads(r.stdout)["results"][0]["message"]
        assert f"remote SGLang is {UNPINNED}, which has no pin (pins: {listed})" in msg
    assert tb.tree_digest(h.sglang) == before and not (h.state / "releases").exists()
    st = run_cli(["status", "pin14", "--json"], env)  # status still reports the host, without a build
    doc = json.loads(st.stdout)
    assert doc["sglang_version"] == UNPINNED and "build_id" not in doc


def test_an_explicit_build_of_another_pin_is_refused(pin_hosts, pin_builds, env):
    h = pin_hosts["pin14"]
    r = run_cli(["push", "pin14", "--build", str(pin_builds[PIN16].root), "--json"], env)
    assert r.returncode == 6, r.stderr
    assert f"the build is for {PIN16}" in json.loads(r.stdout)["results"][0]["message"]
    assert not (h.state / "releases").exists()


def test_a_pin_without_a_build_says_how_to_make_it(pin_hosts, env, tmp_path):
    r = run_cli(["push", "pin16", "--json"], dict(env, DDTREE_DEPLOY_BUILD_ROOT=str(tmp_path)))
    assert r.returncode == 2, r.stderr
    assert f"run `ddtree-deploy patch --pin {PIN16}`" in json.loads(r.stdout)["results"][0]["message"]
