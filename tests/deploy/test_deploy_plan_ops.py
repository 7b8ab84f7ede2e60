"""`plan` and `push` share one list of planned operations (deploy/remote/plan.py): on the real sshd bed,
the operations `plan --json` reports are the ones `push` then does, read back from the transport's
operation log (the faulty transport double in log mode), the host's journal and the release
record; a refusal `plan` reports is the error `push` gives."""

from __future__ import annotations

import json
import os
import shlex

import deploy_testbed as tb
import pytest
from deploy_cli import host_toml, run_cli

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(600)]

# transport operations (labels of tests/deploy/faults/sitecustomize.py) -> the plan's operation kinds;
# the restart and fail-fast commands are labelled from the commands the plan names (done_by)
DONE_BY = {"lock": "lock", "stage": "backup", "put": "upload", "verify": "verify", "apply": "swap",
           "http": "health", "unlock": "unlock"}


def sh_label(command: str) -> str:
    return "sh:" + "-".join(os.path.basename(w) for w in shlex.split(command)[:2])


def done_by(plan: dict) -> dict[str, str]:
    text = {op["kind"]: op["text"] for op in plan["operations"]}
    alive = text["health"].rpartition("(fail fast: ")[2].removesuffix(")")
    return dict(DONE_BY, **{sh_label(text["restart"].removeprefix("restart: ")): "restart", sh_label(alive): "health"})


@pytest.fixture(scope="module")
def setup(bed, builds, tmp_path_factory):
    h, good = bed["hosts"]["ct200"], builds["good"]
    root = tmp_path_factory.mktemp("plan_ops")
    utils = "srt/speculative/ddtree_utils.py"
    other = tb.derive_build(good, root / "good2", {utils: good.path_of(utils).read_bytes() + b"\n# second healthy build\n"})
    inv = root / "hosts.toml"
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"], deadline=60, import_check=False))
    return h, inv, good, other


def plan_of(build, env) -> dict:
    p = run_cli(["plan", "ct200", "--build", str(build.root), "--json"], env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def push_logged(build, env, log) -> dict:
    log.unlink(missing_ok=True)
    r = run_cli(["push", "ct200", "--build", str(build.root), "--json"], dict(env, DDTREE_TEST_FAULT="log", DDTREE_TEST_FAULT_LOG=str(log)))
    res = json.loads(r.stdout)["results"][0]
    return dict(res, returncode=r.returncode, stderr=r.stderr, ops=log.read_text().split() if log.is_file() else [])


def done(ops: list[str], labels: dict[str, str]) -> list[str]:
    """The kinds of operation push did, in order (one per run of the same kind: one upload per file)."""
    out = []
    for tag in ops:
        kind = labels.get(tag.rpartition("#")[0])
        if kind and (not out or out[-1] != kind):
            out.append(kind)
    return out


def check_push_did_the_plan(h, plan: dict, res: dict) -> None:
    ops = {op["kind"]: op for op in plan["operations"]}
    assert res["returncode"] == 0 and res["ok"] and res["changed"], res["stderr"][-2000:]
    labels = done_by(plan)
    assert done(res["ops"], labels) == [op["kind"] for op in plan["operations"] if op["kind"] in labels.values()], " ".join(res["ops"])
    assert sum(tag.startswith("put#") for tag in res["ops"]) == len(ops["upload"]["files"])
    rid = res["release"]
    rdir = h.state / "releases" / rid
    uploaded = {str(p.relative_to(rdir / "files")) for p in (rdir / "files").rglob("*") if p.is_file()}
    assert uploaded == set(ops["upload"]["files"])
    rec = json.loads((rdir / "release.json").read_text())
    assert set(rec["backup"]) == set(ops["backup"]["files"]) and set(rec["files"]) == set(ops["swap"]["files"])
    journal = [json.loads(x) for x in (rdir / "journal.jsonl").read_text().splitlines()]
    assert [e["file"] for e in journal if e["step"] == "swapping"] == sorted(ops["swap"]["files"])
    assert journal[-1]["step"] == "healthy" and res["extra"]["restarts"] == 1


def test_plan_is_what_push_does(setup, cli_env, site_cache, tmp_path):
    h, inv, good, other = setup
    env = dict(cli_env, DDTREE_DEPLOY_HOSTS=str(inv))
    log = tmp_path / "ops.log"
    # a fresh host: every file pristine
    tb.reset_host(h, good, site_cache)
    plan = plan_of(good, env)
    assert not plan["noop"] and not plan["refusals"], plan["refusals"]
    assert [op["text"] for op in plan["operations"]] == plan["steps"]
    check_push_did_the_plan(h, plan, push_logged(good, env, log))
    # an upgrade: one file differs from the deployed release
    plan = plan_of(other, env)
    assert "srt/speculative/ddtree_utils.py [deployed]" in next(op for op in plan["operations"] if op["kind"] == "swap")["text"]
    check_push_did_the_plan(h, plan, push_logged(other, env, log))
    # already there: the plan is "nothing", and push changes nothing on the host
    plan = plan_of(other, env)
    assert plan["noop"] and [op["kind"] for op in plan["operations"]] == ["nothing"]
    res = push_logged(other, env, log)
    assert res["returncode"] == 0 and not res["changed"] and "nothing to do" in res["message"]
    # push takes the lock before it reads the host, so "nothing" is: lock, one facts read, one
    # liveness check of the service (a stopped one would be restarted), unlock
    kinds = [tag.rpartition("#")[0] for tag in res["ops"]]
    assert kinds[:2] == ["lock", "facts"] and kinds[-1] == "unlock" and len(kinds) == 4 and kinds[2].startswith("sh:"), kinds


def test_plan_refusal_is_the_push_error(setup, cli_env):
    h, inv, good, other = setup
    env = dict(cli_env, DDTREE_DEPLOY_HOSTS=str(inv))
    if not (h.state / "current.json").is_file():
        assert run_cli(["push", "ct200", "--build", str(good.root)], env).returncode == 0
    rel = "srt/speculative/spec_registry.py"
    path = h.sglang / rel
    original = path.read_bytes()
    tmp = path.with_name(path.name + ".edit")
    tmp.write_bytes(original + b"# hand edit on the host\n")
    os.replace(tmp, path)  # a new inode, as an editor writes it
    try:
        build = good if tb.sha256_file(h.sglang / "srt/speculative/ddtree_utils.py") != tb.sha256_file(good.path_of("srt/speculative/ddtree_utils.py")) else other
        plan = plan_of(build, env)
        r = run_cli(["push", "ct200", "--build", str(build.root), "--json"], env)
        assert r.returncode == 6, r.stderr
        msg = json.loads(r.stdout)["results"][0]["message"]
        assert f"{rel} (drifted)" in msg and msg in plan["refusals"], (msg, plan["refusals"])
    finally:
        tmp.write_bytes(original)
        os.replace(tmp, path)
