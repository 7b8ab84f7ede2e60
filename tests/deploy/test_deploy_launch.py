"""The launch flags travel with the release ([hosts.X.launch], deploy/config/launch.py, deploy/remote/envfile.py).

Two hosts of their own (so the shared ct200 / gpu-b keep their fixed flags): `ct-launch` (loopback
sshd, a unit for the systemctl shim with `EnvironmentFile=-<env>` and `$SGLANG_SPEC_ARGS` on its
exec line, the pristine env file says DFLASH) and `gpu-launch` (ssh_config alias through ProxyJump
into the network namespace, a real supervisord whose program sources the env file in a `sh -c`
wrapper; no env file before the first push: no speculative decoding). The stub service validates
its flags against the installed sglang: pristine SGLang refuses `--speculative-algorithm DDTREE`
and the `--speculative-ddtree-*` flags, so a healthy service after a rollback proves the flags came
back with the files. Every scenario checks the package tree and the env file byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

import deploy_testbed as tb
import pytest
from ddtree_deploy.deploy.build.buildinfo import sha256_file
from ddtree_deploy.deploy.config import launch
from ddtree_deploy.deploy.config.inventory import load_inventory
from ddtree_deploy.deploy.errors import ConfigError
from deploy_cli import VENV_BIN, host_toml, run_cli

ENV_REL = "etc/sglang/ddtree.env"
DDTREE_ARGS = "--speculative-algorithm DDTREE --speculative-ddtree-budget 7"
PRISTINE_ENV = b'# site settings\nCUDA_VISIBLE_DEVICES=0\nSGLANG_SPEC_ARGS="--speculative-algorithm DFLASH"\n'


def results(r: subprocess.CompletedProcess) -> dict[str, dict]:
    return {o["host"]: o for o in json.loads(r.stdout)["results"]}


def expected_after(before: dict[str, str], build) -> dict[str, str]:
    out = dict(before)
    out.update({rel: sha256_file(build.path_of(rel)) for rel in build.files})
    return out


def env_bytes(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def status(host: str, env: dict) -> dict:
    r = run_cli(["status", host, "--json"], env)
    return json.loads(r.stdout)


# -- no hosts needed --------------------------------------------------------------------------------
def test_env_file_render_and_parse():
    """The managed variable is replaced in place, every other line kept, idempotent; what systemd
    and sh read back is the flag string; the algorithm of a state's flags (NONE without any)."""
    out = launch.render_env(PRISTINE_ENV + b"OTHER=1\nSGLANG_SPEC_ARGS=dup\n", "SGLANG_SPEC_ARGS", DDTREE_ARGS)
    assert launch.render_env(out, "SGLANG_SPEC_ARGS", DDTREE_ARGS) == out
    env = launch.parse_env(out)
    assert env == {"CUDA_VISIBLE_DEVICES": "0", "SGLANG_SPEC_ARGS": DDTREE_ARGS, "OTHER": "1"}
    assert out.decode().count("SGLANG_SPEC_ARGS=") == 1 and out.startswith(b"# site settings\nCUDA_VISIBLE_DEVICES=0\n")
    shell = subprocess.run(["sh", "-c", 'set -a; . /dev/stdin; set +a; printf "%s|" $SGLANG_SPEC_ARGS'], input=out,
                           capture_output=True, check=True)
    assert shell.stdout.decode().split("|")[:-1] == DDTREE_ARGS.split()
    assert launch.algorithm_of(launch.parse_env(PRISTINE_ENV)["SGLANG_SPEC_ARGS"]) == "DFLASH"
    assert launch.algorithm_of(launch.parse_env(out)["SGLANG_SPEC_ARGS"]) == "DDTREE"
    assert launch.algorithm_of(launch.parse_env(None).get("SGLANG_SPEC_ARGS")) == "NONE"
    fresh = launch.render_env(None, "SGLANG_SPEC_ARGS", DDTREE_ARGS)
    assert launch.parse_env(fresh) == {"SGLANG_SPEC_ARGS": DDTREE_ARGS}
    with pytest.raises(ValueError, match="spans several lines"):
        launch.render_env(b'SGLANG_SPEC_ARGS="--speculative-algorithm \\\n DFLASH"\n', "SGLANG_SPEC_ARGS", DDTREE_ARGS)
    assert launch.store_rel("/etc/sglang/ddtree.env") == "@abs/etc/sglang/ddtree.env"
    assert launch.store_rel("srt/x.py") == "srt/x.py"


INV = """\
[hosts.gpu]
address = "10.0.0.5"
python = "/opt/sglang/bin/python"
restart = { strategy = "systemd", unit = "sglang.service" }
[hosts.gpu.launch]
env_file = "/etc/sglang/ddtree.env"
"""


@pytest.mark.parametrize(("extra", "words"), [
    ('ddtree_args = "--speculative-algorithm DFLASH"', "hosts.gpu.launch.ddtree_args: must say `--speculative-algorithm DDTREE`"),
    ('ddtree_args = "--speculative-ddtree-budget 63"', "must turn DDTREE on"),
    ('ddtree_args = "--speculative-algorithm DDTREE --speculative-ddtree-budget 2048"', "--speculative-ddtree-budget needs an integer 1..1023, got '2048'"),
    ('ddtree_args = "--speculative-algorithm DDTREE --speculative-ddtree-budget auto --speculative-num-draft-tokens 16"',
     "auto chooses the verify width per round; drop --speculative-num-draft-tokens"),
    ('ddtree_args = "--speculative-algorithm DDTREE --speculative-ddtree-budgit 7"', "unknown DDTREE flag --speculative-ddtree-budgit"),
    ('ddtree_args = "--speculative-algorithm DDTREE --speculative-draft-model-path \\"/m/a b\\""', "cannot carry safely"),
    ('ddtree_args = "--speculative-algorithm DDTREE --speculative-ddtree-budget 7 --speculative-num-draft-tokens 16"',
     "must be --speculative-ddtree-budget + 1 = 8"),
    ('variable = "SPEC-ARGS"', "hosts.gpu.launch.variable: must be a shell/systemd variable name"),
    ('env_file2 = "x"', "hosts.gpu.launch.env_file2: Extra inputs are not permitted"),
])
def test_launch_inventory_refused(tmp_path, extra, words):
    p = tmp_path / "hosts.toml"
    p.write_text(INV + extra + "\n")
    with pytest.raises(ConfigError) as exc:
        load_inventory(p)
    assert words in exc.value.message and exc.value.exit_code == 2


def test_launch_inventory_defaults_and_cli_exit_2(tmp_path):
    p = tmp_path / "hosts.toml"
    p.write_text(INV)
    lc = load_inventory(p).get("gpu").launch
    assert (lc.env_file, lc.variable, lc.ddtree_args) == ("/etc/sglang/ddtree.env", "SGLANG_SPEC_ARGS", None)
    # no ddtree_args: the server's own default where the build's pin serves auto (auto at TP 1), b63
    # elsewhere
    assert lc.args_for("0.5.16") == "--speculative-algorithm DDTREE"
    assert lc.args_for("0.5.13.post1") == "--speculative-algorithm DDTREE --speculative-ddtree-budget 63"
    for version in launch.DDTREE_AUTO_PINS + ("0.5.13.post1",):
        assert launch.auto_budget_refusal(lc.args_for(version), version) is None
    p.write_text(INV.replace('"/etc/sglang/ddtree.env"', '"etc/ddtree.env"'))
    r = subprocess.run([str(VENV_BIN / "ddtree-deploy"), "plan", "gpu", "-i", str(p), "--json"], capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "hosts.gpu.launch.env_file: must be an absolute path" in r.stderr
    assert json.loads(r.stdout)["exit_code"] == 2
    # the expectation follows the flags: an explicit health.expect_algorithm beside [launch] is refused
    p.write_text(INV.replace("[hosts.gpu.launch]", '[hosts.gpu.health]\nexpect_algorithm = "DDTREE"\n[hosts.gpu.launch]'))
    with pytest.raises(ConfigError, match="remove health.expect_algorithm"):
        load_inventory(p)


# -- the hosts --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lbed(bed, builds, site_cache, algorithm, tmp_path_factory):
    if algorithm != "DDTREE":
        pytest.skip("the build at hand has no DDTREE (fallback build): nothing to turn on")
    root = tmp_path_factory.mktemp("launch")
    ssh = bed["ssh"]
    sd = tb.make_host("ct-launch", root / "ct-launch", site_cache, "NONE")
    sv = tb.make_host("gpu-launch", root / "gpu-launch", site_cache, "NONE")
    sd_env, sv_env = sd.root / ENV_REL, sv.root / ENV_REL
    sd_env.parent.mkdir(parents=True)
    sd_env.write_bytes(PRISTINE_ENV)  # gpu-launch has none (and no /etc/sglang): no speculative flags
    tb.setup_systemd(sd, env_file=sd_env)
    conf = tb.setup_supervisor(sv, ssh.ns, env_file=sv_env)

    def body(env: Path) -> str:
        return f'env_file = "{env}"\nddtree_args = "{DDTREE_ARGS}"'

    inv = root / "hosts.toml"
    inv.write_text(host_toml(ssh, sd, None, kind="ct200", import_check=False, launch=body(sd_env)) + "\n"
                   + host_toml(ssh, sv, conf, kind="gpu-b", import_check=False, launch=body(sv_env)))
    # both services run pristine SGLang with the flags they had before the tool came
    tb.sh(str(sd.root / "bin" / "systemctl"), "start", "sglang")
    tb.sh(str(VENV_BIN / "supervisorctl"), "-c", str(conf), "start", "sglang")
    tb.wait_healthy(sd)
    tb.wait_healthy(sv, ssh.ns)
    yield {"ct-launch": sd, "gpu-launch": sv, "env": {"ct-launch": sd_env, "gpu-launch": sv_env}, "inventory": inv,
           "supervisor": conf}
    tb.sh(str(sd.root / "bin" / "systemctl"), "stop", "sglang", check=False)
    tb.sh(str(VENV_BIN / "supervisorctl"), "-c", str(conf), "shutdown", check=False)


@pytest.fixture
def lenv(lbed, cli_env):
    return dict(cli_env, DDTREE_DEPLOY_HOSTS=str(lbed["inventory"]))


def server_info(h) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{h.port}/get_server_info", timeout=10) as r:
        return json.loads(r.read())


def test_pristine_sglang_refuses_ddtree_flags(lbed, tmp_path):
    """The stub service on pristine SGLang refuses DDTREE and the DDTREE flags, as the real
    launch_server does: the reason `rollback` must bring the previous flags back."""
    h = lbed["ct-launch"]
    for args, words in ((["--speculative-algorithm", "DDTREE"], "Unknown speculative algorithm name: DDTREE"),
                        (["--speculative-algorithm", "DFLASH", "--speculative-ddtree-budget", "7"],
                         "unrecognized arguments: --speculative-ddtree-budget")):
        r = subprocess.run([str(h.python), str(tb.SERVICE), "--port", str(tb.free_port()), *args],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode != 0 and words in r.stderr, r.stderr[-500:]


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_systemd_push_turns_ddtree_on_and_rollback_restores_flags(lbed, builds, lenv):
    """systemd shim: plan shows the env-file diff; push turns DDTREE on through the env file; one
    `rollback` goes back to the pristine files and DFLASH flags; --to <release> and --to pristine
    move the flags with the files; a hand-edited env file is drift. Over 60 s on 2 busy cores:
    three pushes and three rollbacks, each restarting the service with its health gate (each start of the stub service imports the host's real sglang, about 1.5 CPU-s in a child of the bed's fork server, and the pre-swap import check about 9 CPU-s)."""
    h, env_file, good = lbed["ct-launch"], lbed["env"]["ct-launch"], builds["good"]
    pristine_tree, pristine_env = tb.tree_digest(h.sglang), env_bytes(env_file)
    assert status("ct-launch", lenv)["speculative_algorithm"] == "DFLASH"
    want_env = launch.render_env(pristine_env, "SGLANG_SPEC_ARGS", DDTREE_ARGS)

    p = run_cli(["plan", "ct-launch", "--diff", "--build", str(good.root), "--json"], lenv)
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["launch"]["changed"] and plan["launch"]["expect_algorithm"] == "DDTREE"
    assert plan["launch"]["previous_expect_algorithm"] == "DFLASH"
    d = plan["diffs"][str(env_file)]
    assert '-SGLANG_SPEC_ARGS="--speculative-algorithm DFLASH"' in d and f'+SGLANG_SPEC_ARGS="{DDTREE_ARGS}"' in d
    assert "require speculative_algorithm == DDTREE" in plan["steps"] and any(str(env_file) in s for s in plan["steps"])
    assert env_bytes(env_file) == pristine_env  # plan changed nothing

    r = run_cli(["push", "ct-launch", "--build", str(good.root), "--json"], lenv)
    assert r.returncode == 0, r.stderr
    res = results(r)["ct-launch"]
    rid = res["release"]
    assert res["health"]["algorithm"] == "DDTREE" and res["extra"]["launch"]["expect_algorithm"] == "DDTREE"
    assert env_bytes(env_file) == want_env and tb.tree_digest(h.sglang) == expected_after(pristine_tree, good)
    info = server_info(h)
    assert info["speculative_algorithm"] == "DDTREE" and info["speculative_ddtree_budget"] == "7"
    rec = json.loads((h.state / "releases" / rid / "release.json").read_text())
    assert rec["launch"]["args"] == DDTREE_ARGS and rec["launch"]["previous_expect_algorithm"] == "DFLASH"
    assert rec["files"][str(env_file)] == sha256_file(env_file)
    assert rec["backup"][str(env_file)] == launch.sha256_of(pristine_env)
    assert (h.state / "releases" / rid / "backup" / "@abs" / env_file.relative_to("/")).read_bytes() == pristine_env
    assert (h.state / "pristine" / "@abs" / env_file.relative_to("/")).read_bytes() == pristine_env
    st = status("ct-launch", lenv)
    assert st["healthy"] and st["launch"]["expect_algorithm"] == "DDTREE" and st["speculative_algorithm"] == "DDTREE"
    assert st["verify"][str(env_file)] == "ok" and all(v == "ok" for v in st["verify"].values()), st["verify"]
    again = run_cli(["push", "ct-launch", "--build", str(good.root), "--json"], lenv)
    assert again.returncode == 0 and "nothing to do" in results(again)["ct-launch"]["message"], again.stderr

    r = run_cli(["rollback", "ct-launch", "--json"], lenv)  # one command, back to the state before
    assert r.returncode == 0, r.stderr
    res = results(r)["ct-launch"]
    assert res["health"]["algorithm"] == "DFLASH" and res["extra"]["launch"]["expect_algorithm"] == "DFLASH"
    assert env_bytes(env_file) == pristine_env and tb.tree_digest(h.sglang) == pristine_tree
    assert server_info(h)["speculative_algorithm"] == "DFLASH"

    r = run_cli(["rollback", "ct-launch", "--to", rid, "--json"], lenv)
    assert r.returncode == 0, r.stderr
    assert results(r)["ct-launch"]["health"]["algorithm"] == "DDTREE"
    assert env_bytes(env_file) == want_env and tb.tree_digest(h.sglang) == expected_after(pristine_tree, good)

    edited = want_env.replace(b"budget 7", b"budget 9")  # a hand edit of the managed flags is drift
    env_file.write_bytes(edited)
    r = run_cli(["push", "ct-launch", "--build", str(good.root)], lenv)
    assert r.returncode == 6 and f"{env_file} (drifted)" in r.stderr, r.stderr
    assert env_bytes(env_file) == edited
    env_file.write_bytes(want_env)

    r = run_cli(["rollback", "ct-launch", "--to", "pristine", "--json"], lenv)
    assert r.returncode == 0, r.stderr
    assert results(r)["ct-launch"]["health"]["algorithm"] == "DFLASH"
    assert env_bytes(env_file) == pristine_env and tb.tree_digest(h.sglang) == pristine_tree
    st = status("ct-launch", lenv)
    assert st["healthy"] and st["speculative_algorithm"] == "DFLASH" and st["launch"]["expect_algorithm"] == "DFLASH"


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_supervisord_auto_rollback_and_rollback_restore_env_file(lbed, builds, lenv):
    """supervisord through ProxyJump, no env file before: a push whose service fails is rolled back
    automatically with the env file (removed again) and health expecting no speculative algorithm;
    then push turns DDTREE on and one `rollback` removes the file and the flags again. Over 60 s on
    2 busy cores: four service restarts under supervisord with their health gates (each start of the stub service imports the host's real sglang, about 1.5 CPU-s in a child of the bed's fork server, and the pre-swap import check about 9 CPU-s)."""
    h, env_file, good = lbed["gpu-launch"], lbed["env"]["gpu-launch"], builds["good"]
    pristine_tree = tb.tree_digest(h.sglang)
    assert not env_file.exists() and status("gpu-launch", lenv)["speculative_algorithm"] is None

    r = run_cli(["push", "gpu-launch", "--build", str(builds["bad_service"].root), "--json"], lenv)
    assert r.returncode == 1, r.stderr
    res = results(r)["gpu-launch"]
    assert "rolled back automatically" in res["message"] and "service healthy again" in res["message"]
    assert not env_file.exists() and tb.tree_digest(h.sglang) == pristine_tree
    rels = sorted(os.listdir(h.state / "releases"))
    rec = json.loads((h.state / "releases" / rels[-1] / "release.json").read_text())
    assert rec["outcome"] == "rolled-back" and rec["launch"]["expect_algorithm"] == "DDTREE"
    assert rec["launch"]["previous_expect_algorithm"] == "NONE" and rec["backup"][str(env_file)] is None
    st = status("gpu-launch", lenv)
    assert st["healthy"] and st["speculative_algorithm"] is None and st["launch"]["exists"] is False

    r = run_cli(["push", "gpu-launch", "--build", str(good.root), "--json"], lenv)
    assert r.returncode == 0, r.stderr
    assert results(r)["gpu-launch"]["health"]["algorithm"] == "DDTREE"
    assert env_bytes(env_file) == launch.render_env(None, "SGLANG_SPEC_ARGS", DDTREE_ARGS)
    assert tb.tree_digest(h.sglang) == expected_after(pristine_tree, good)
    assert status("gpu-launch", lenv)["speculative_algorithm"] == "DDTREE"

    r = run_cli(["rollback", "gpu-launch", "--json"], lenv)
    assert r.returncode == 0, r.stderr
    assert results(r)["gpu-launch"]["extra"]["launch"]["expect_algorithm"] == "NONE"
    assert not env_file.exists() and tb.tree_digest(h.sglang) == pristine_tree
    st = status("gpu-launch", lenv)
    assert st["healthy"] and st["speculative_algorithm"] is None
    assert json.loads((h.state / "current.json").read_text())["state"] == "pristine"


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dead_push_with_launch_finished_by_next_command(lbed, builds, lenv):
    """systemd shim, the journal: a DDTREE push whose CLI is SIGKILLed (the faulty transport double)
    right after the swap, and after the first health poll (the service already restarted with the
    DDTREE flags), is finished by the next command (`status`): the env file is restored byte for byte
    with the package files in the same transition, the `.new`/`.old` temp files beside it are gone,
    and the service is healthy with the previous flags' algorithm (DFLASH)."""
    h, env_file, good = lbed["ct-launch"], lbed["env"]["ct-launch"], builds["good"]
    if (h.state / "current.json").exists():  # after the other tests: back to the state before the tool came
        r = run_cli(["rollback", "ct-launch", "--to", "pristine"], lenv)
        assert r.returncode == 0, r.stderr
    before_tree, before_env = tb.tree_digest(h.sglang), env_bytes(env_file)
    assert launch.algorithm_of(launch.parse_env(before_env).get("SGLANG_SPEC_ARGS")) == "DFLASH"
    for point in ("apply#1", "http#1"):
        r = run_cli(["push", "ct-launch", "--build", str(good.root), "--json"], dict(lenv, DDTREE_TEST_FAULT=f"kill@{point}"))
        assert r.returncode == -9, (point, r.returncode, r.stderr[-1500:])
        assert env_bytes(env_file) == launch.render_env(before_env, "SGLANG_SPEC_ARGS", DDTREE_ARGS), point  # swapped
        rid = max(os.listdir(h.state / "releases"))
        st = run_cli(["status", "ct-launch", "--json"], lenv)
        assert st.returncode == 0, (point, st.stderr[-2000:])
        s = json.loads(st.stdout)
        assert s["recovered"] and not s["unfinished"] and s["healthy"], (point, s)
        assert s["speculative_algorithm"] == "DFLASH" and s["launch"]["expect_algorithm"] == "DFLASH", (point, s)
        assert env_bytes(env_file) == before_env and tb.tree_digest(h.sglang) == before_tree, point
        assert not [p.name for p in env_file.parent.iterdir() if ".ddtree-" in p.name], point
        assert server_info(h)["speculative_algorithm"] == "DFLASH"
        journal = [json.loads(x) for x in (h.state / "releases" / rid / "journal.jsonl").read_text().splitlines()]
        assert journal[-1]["step"] == "rolled-back", (point, journal)
        assert {e.get("file") for e in journal if e["step"] == "swapping"} >= {str(env_file)}, journal
        assert {e.get("file") for e in journal if e["step"] == "restoring"} >= {str(env_file)}, journal
        rec = json.loads((h.state / "releases" / rid / "release.json").read_text())
        assert rec["outcome"] == "rolled-back" and rec["launch"]["previous_expect_algorithm"] == "DFLASH", rec
        assert rec["health_after_rollback"]["ok"] and rec["health_after_rollback"]["algorithm"] == "DFLASH", rec
        assert json.loads((h.state / "current.json").read_text())["state"] == "pristine"


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_env_file_budget_change_is_restart_pending(lbed, builds, lenv):
    """systemd shim: the DDTREE budget changed in the env file (by hand here) is what the service reads
    at its next start, not what it runs with: `status` and `plan` say `restart pending` with the
    flag and both values (the service's from its /get_server_info), `restart` applies it and the
    note goes; the hand edit stays drift until a rollback puts the flags back. About 40 s on 2
    quiet cores, over 60 s on 2 busy ones: a push, a restart and a rollback, each with its health
    gate (each start of the stub service imports the host's real sglang, about 1.5 CPU-s in a child of the bed's fork server, and the pre-swap import check about 9 CPU-s)."""
    h, env_file, good = lbed["ct-launch"], lbed["env"]["ct-launch"], builds["good"]
    if (h.state / "current.json").exists():  # after the other tests: back to the state before the tool came
        r = run_cli(["rollback", "ct-launch", "--to", "pristine"], lenv)
        assert r.returncode == 0, r.stderr
    pristine_env, pristine_tree = env_bytes(env_file), tb.tree_digest(h.sglang)
    r = run_cli(["push", "ct-launch", "--build", str(good.root), "--json"], lenv)
    assert r.returncode == 0, r.stderr
    st = status("ct-launch", lenv)
    assert st["launch"]["restart_pending"] == [], st["launch"]
    budget = launch.flags_of(DDTREE_ARGS)["speculative_ddtree_budget"]
    new = str(int(budget) + 2)
    pushed = env_bytes(env_file)
    tmp = env_file.with_name("edit")
    tmp.write_bytes(pushed.replace(f"budget {budget}".encode(), f"budget {new}".encode()))
    os.replace(tmp, env_file)
    running = server_info(h)["speculative_ddtree_budget"]
    want = [f"speculative_ddtree_budget: the service runs {running}, the env file says {new}"]
    s = run_cli(["status", "ct-launch", "--json"], lenv)
    assert json.loads(s.stdout)["launch"]["restart_pending"] == want and "restart pending" in s.stderr, s.stderr[-2000:]
    p = run_cli(["plan", "ct-launch", "--build", str(good.root), "--json"], lenv)
    assert p.returncode == 0 and json.loads(p.stdout)["restart_pending"] == want, p.stderr[-2000:]
    assert "restart pending" in p.stderr and "ddtree-deploy restart ct-launch" in p.stderr, p.stderr[-2000:]
    r = run_cli(["restart", "ct-launch", "--json"], lenv)
    assert r.returncode == 0, r.stderr[-2000:]
    assert server_info(h)["speculative_ddtree_budget"] == new
    st = status("ct-launch", lenv)
    assert st["launch"]["restart_pending"] == [] and st["verify"][str(env_file)] == "changed", st
    r = run_cli(["rollback", "ct-launch", "--to", "pristine", "--json"], lenv)
    assert r.returncode == 0, r.stderr[-2000:]
    assert env_bytes(env_file) == pristine_env and tb.tree_digest(h.sglang) == pristine_tree
    st = status("ct-launch", lenv)
    assert st["healthy"] and st["launch"]["restart_pending"] == [], st["launch"]


def test_budget_auto_passes_the_inventory_and_is_refused_for_a_pin_without_it(tmp_path):
    """`auto` is valid inventory (the pin is known only at push); a push checks the build's pin:
    0.5.16 serves it, 0.5.13.post1 refuses it at start, so the push refuses it first."""
    p = tmp_path / "hosts.toml"
    args = "--speculative-algorithm DDTREE --speculative-ddtree-budget AUTO"
    p.write_text(INV + f'ddtree_args = "{args}"\n')
    assert load_inventory(p).get("gpu").launch.ddtree_args == args
    assert launch.auto_budget_refusal(args, "0.5.16") is None
    for fixed in ("--speculative-algorithm DDTREE --speculative-ddtree-budget 63", "--speculative-algorithm DDTREE"):
        assert launch.auto_budget_refusal(fixed, "0.5.13.post1") is None
    for form in (args, "--speculative-algorithm DDTREE --speculative-ddtree-budget=auto"):
        msg = launch.auto_budget_refusal(form, "0.5.13.post1")
        assert msg is not None and "served on SGLang 0.5.16 only" in msg and "0.5.13.post1" in msg


@pytest.mark.parametrize(("version", "refused", "named"), [
    ("0.5.13.post1", True, True), ("0.5.16", False, True), ("0.5.13.post1", False, False), ("0.5.16", False, False),
])
def test_push_of_budget_auto_checks_the_builds_pin(tmp_path, version, refused, named):
    """envfile.for_push with `auto` in ddtree_args: a DDTREE build of 0.5.13.post1 is refused
    before anything is written (RemoteRefused names the pin), one of 0.5.16 renders the file.
    Without ddtree_args each pin's build renders its default (no budget flag on 0.5.16, whose
    server then runs auto at TP 1; b63 on 0.5.13.post1). The
    env file is read from the host facts, so no connection is made: the transport is a stand-in
    holding only the inventory host (the sshd push tests above cover the rest of the path)."""
    from types import SimpleNamespace

    from ddtree_deploy.deploy.build.buildinfo import BuildFile, BuildInfo
    from ddtree_deploy.deploy.errors import RemoteRefused
    from ddtree_deploy.deploy.remote import envfile
    from ddtree_deploy.deploy.remote.facts import HostFacts

    p = tmp_path / "hosts.toml"
    args = "--speculative-algorithm DDTREE --speculative-ddtree-budget auto"
    p.write_text(INV + (f'ddtree_args = "{args}"\n' if named else ""))
    if not named:  # the pin's default: no budget flag on 0.5.16 (the server's auto), b63 on 0.5.13.post1
        args = launch.default_ddtree_args(version)
        assert args.endswith("DDTREE" if version == "0.5.16" else "63")
    host = load_inventory(p).get("gpu")
    root = tmp_path / "build"
    (root / "srt/speculative").mkdir(parents=True)
    (root / launch.SPEC_INFO).write_text("class SpeculativeAlgorithm:\n    DDTREE = 1\n")
    build = BuildInfo(root, version, "b1", "s", "m", [], {launch.SPEC_INFO: BuildFile(launch.SPEC_INFO, "x", 1, "y")})
    before = b'SGLANG_SPEC_ARGS="--speculative-algorithm DFLASH"\n'
    facts = HostFacts("/p", "/s", version, {}, None, None, [], {}, reads={host.launch.env_file: before})
    t = SimpleNamespace(host=host)
    if refused:
        with pytest.raises(RemoteRefused, match="served on SGLang 0.5.16 only; this build is for 0.5.13.post1"):
            envfile.for_push(t, build, facts)
    else:
        change = envfile.for_push(t, build, facts)
        assert change.before == before and args.encode() in change.after
