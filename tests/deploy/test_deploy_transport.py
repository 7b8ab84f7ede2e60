"""Transport behaviour over real SSH and locally: remote-side timeouts, argument quoting, strict
host keys on every hop (ProxyJump), the agent's facts."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from ddtree_deploy.deploy.config.inventory import load_inventory
from ddtree_deploy.deploy.errors import RemoteUnreachable
from ddtree_deploy.deploy.remote.agent_client import call_agent
from ddtree_deploy.deploy.remote.transport import LocalTransport, connect, wrap


def test_wrap_quotes_and_bounds_every_command():
    cmd = wrap("echo \"$X\" 'a b'", 7, {"X": "it's; rm -rf /"})
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
    assert r.stdout == "it's; rm -rf / a b\n"
    assert cmd.startswith("timeout -k 5 7 sh -c ")


def running(cmdline: str) -> list[int]:
    """Pids whose command line is exactly `cmdline` (no pgrep needed)."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "cmdline").read_bytes().replace(b"\0", b" ").strip() == cmdline.encode():
                out.append(int(p.name))
        except OSError:
            pass
    return out


@pytest.fixture
def inv(bed):
    return load_inventory(bed["inventory"])


@pytest.mark.ssh
@pytest.mark.parametrize("name", ["ct200", "gpu-b", "local"])
def test_remote_timeout_kills_the_command_on_the_host(inv, name):
    t = connect(inv.get(name), inv)
    try:
        marker = f"sleep 61.{time.time_ns() % 10**6:06d}"  # unique command line to look for afterwards
        t0 = time.monotonic()
        r = t.run(marker, timeout_s=1)
        assert r.rc == 124 and time.monotonic() - t0 < 15
        time.sleep(0.5)
        assert not running(marker)  # nothing left running on the host (one process table for all test hosts)
    finally:
        t.close()


@pytest.mark.ssh
def test_agent_facts_through_proxyjump_with_odd_arguments(inv, bed):
    t = connect(inv.get("gpu-b"), inv)  # ssh_config alias + ProxyJump through the loopback sshd
    try:
        odd = "srt/it's a \"file\"; $(touch /tmp/ddtree-pwned).py"
        out = call_agent(t, "facts", {"sglang_dir": None, "files": [odd, "srt/server_args.py"], "state_dir": "/nonexistent/x"})
        h = bed["hosts"]["gpu-b"]
        assert out["sglang_dir"] == str(h.sglang) and out["version"] == "0.5.13.post1"
        assert out["files"][odd] is None and out["files"]["srt/server_args.py"]["size"] == (h.sglang / "srt/server_args.py").stat().st_size
    finally:
        t.close()
    assert not __import__("os").path.exists("/tmp/ddtree-pwned")


@pytest.mark.ssh
def test_gateway_hop_is_strict_too(inv, bed, tmp_path):
    """gpu-b's known_hosts lists only gpu-b: the bastion hop's key is unknown, so nothing connects."""
    kh = tmp_path / "kh"
    kh.write_text("".join(line for line in bed["ssh"].known_hosts.read_text().splitlines(True) if "127.0.0.1" not in line))
    h = inv.get("gpu-b").model_copy(update={"known_hosts": str(kh)})
    with pytest.raises(RemoteUnreachable, match="not in known_hosts"):
        connect(h, inv)


def test_local_transport_runs_with_env(tmp_path):
    from ddtree_deploy.deploy.config.inventory import Host

    h = Host.model_validate({"name": "local", "python": "/usr/bin/python3", "env": {"GREETING": "hi there"},
                             "restart": {"strategy": "command", "start": "true", "stop": "true", "status": "true"}})
    t = LocalTransport(h)
    r = t.run('printf "%s" "$GREETING"')
    assert r.ok and r.stdout == "hi there"
    src = tmp_path / "a"
    src.write_bytes(b"x" * 1000)
    seen = []
    t.put(src, str(tmp_path / "d" / "b"), seen.append)
    assert (tmp_path / "d" / "b").read_bytes() == src.read_bytes() and sum(seen) == 1000


@pytest.mark.ssh
def test_inventory_gateway_reaches_the_namespace_host(bed, tmp_path):
    """`gateway = "ct200"` (an inventory host as jump host) instead of an ssh_config ProxyJump."""
    from deploy_cli import host_toml

    ssh, h = bed["ssh"], bed["hosts"]["gpu-b"]
    text = host_toml(ssh, bed["hosts"]["ct200"], bed["supervisor"]) + (
        f'[hosts.gpu-direct]\naddress = "{ssh.ns_addr}"\nuser = "root"\nidentity_file = "{ssh.client_key}"\n'
        f'known_hosts = "{ssh.known_hosts}"\ngateway = "ct200"\npython = "{h.python}"\n'
        'restart = { strategy = "command", start = "true", stop = "true", status = "true" }\n')
    p = tmp_path / "hosts.toml"
    p.write_text(text)
    inv = load_inventory(p)
    t = connect(inv.get("gpu-direct"), inv)
    try:
        r = t.run("ip -4 -o addr show")
        assert ssh.ns_addr in r.stdout  # really inside the namespace
        assert call_agent(t, "facts", {"sglang_dir": None, "files": [], "state_dir": "/nonexistent"})["sglang_dir"] == str(h.sglang)
    finally:
        t.close()


@pytest.mark.ssh
def test_missing_service_python_is_a_config_error(bed, tmp_path):
    from ddtree_deploy.deploy.errors import ConfigError

    inv = load_inventory(bed["inventory"])
    h = inv.get("ct200").model_copy(update={"python": "/nonexistent/bin/python"})
    t = connect(h, inv)
    try:
        with pytest.raises(ConfigError, match="cannot run /nonexistent/bin/python on the host"):
            call_agent(t, "facts", {"sglang_dir": None, "files": [], "state_dir": "/nonexistent"})
    finally:
        t.close()
