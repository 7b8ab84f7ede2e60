"""How many times a command goes to the host, and how many bytes it sends: one default `push` of
the real build to a pristine ct200 (loopback sshd), then `status`, counted by the faulty transport
double in log mode (tests/deploy/faults/sitecustomize.py: every command line and upload with its
size). docs/DEPLOY.md ("Trips to the host") reports these numbers; this test keeps them: the host's
facts are read once per command, the agent's source goes over the wire once per connection."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import deploy_testbed as tb
import pytest
from deploy_cli import host_toml, run_cli

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(600)]


def tally(path: Path) -> dict:
    rows = [ln.split() for ln in path.read_text().splitlines()] if path.is_file() else []
    labels = Counter(tag.rpartition("#")[0] for tag, _ in rows)
    shell = sum(n for k, n in labels.items() if k.startswith("sh:"))
    up = sum(int(n) for tag, n in rows if tag.startswith("put#"))
    return {"operations": len(rows), "agent_calls": len(rows) - shell - labels["put"], "shell": shell,
            "uploads": labels["put"], "upload_bytes": up, "command_bytes": sum(int(n) for _, n in rows) - up,
            "by_label": dict(sorted(labels.items()))}


def test_trips_and_bytes_of_a_push_and_a_status(bed, builds, site_cache, cli_env, tmp_path):
    h, good = bed["hosts"]["ct200"], builds["good"]
    inv = tmp_path / "hosts.toml"
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"], deadline=60, import_check=False))
    tb.reset_host(h, good, site_cache)
    # the default push and status: no --build, each host gets the build of its SGLang's pin
    builds_root = tmp_path / "build"
    builds_root.mkdir()
    (builds_root / f"sglang-{good.sglang_version}").symlink_to(good.root)
    env = dict(cli_env, DDTREE_DEPLOY_HOSTS=str(inv), DDTREE_TEST_FAULT="log", DDTREE_DEPLOY_BUILD_ROOT=str(builds_root))
    out = {}
    for name, args in (("push", ["push", "ct200", "--json"]), ("status", ["status", "ct200", "--json"])):
        log = tmp_path / f"{name}.bytes"
        r = run_cli(args, dict(env, DDTREE_TEST_FAULT_BYTES=str(log)))
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = tally(log)
    print("TRIPS " + json.dumps(out, sort_keys=True))
    agent = (Path(tb.__file__).resolve().parents[2] / "deploy" / "remote" / "agent.py").read_bytes()
    for name, t in out.items():
        assert t["by_label"].get("facts") == 1, (name, t)
        # the agent source is sent with the first call of a connection only: the bytes of every
        # other call are its arguments
        assert t["command_bytes"] < len(agent) + 1000 * t["operations"], (name, t)
    assert out["push"]["uploads"] == len(good.files)
    assert out["push"]["upload_bytes"] == sum(f.size for f in good.files.values())
