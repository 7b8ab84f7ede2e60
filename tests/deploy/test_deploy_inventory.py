"""Inventory validation (no hosts needed): good files load, every kind of bad file is a one-line
ConfigError naming the file and key, and the CLI turns it into exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from ddtree_deploy.deploy.config.inventory import (
    PidfileRestart,
    SystemdRestart,
    load_inventory,
)
from ddtree_deploy.deploy.errors import EXIT_USAGE, ConfigError

GOOD = """\
[hosts.bastion-gpu]
address = "10.0.0.5"
port = 2222
user = "deploy"
identity_file = "~/.ssh/id_ed25519"
gateway = "jump"
python = "/opt/sglang/bin/python"
restart = { strategy = "systemd", unit = "sglang.service" }

[hosts.jump]
ssh_alias = "jump"
python = "/usr/bin/python3"
restart = { strategy = "command", start = "true", stop = "true", status = "true" }
health = { expect_algorithm = "DFLASH", smoke = { text = "hi" } }

[hosts.local]
python = "/usr/bin/python3"
restart = { strategy = "pidfile", pidfile = "/run/sg.pid", command = ["/usr/bin/python3", "-m", "sglang.launch_server"] }
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "hosts.toml"
    p.write_text(text)
    return p


def test_good_inventory_loads_with_defaults(tmp_path):
    inv = load_inventory(write(tmp_path, GOOD))
    h = inv.get("bastion-gpu")
    assert isinstance(h.restart, SystemdRestart) and h.restart.sudo
    assert h.health.deadline_s == 900 and h.health.expect_algorithm == "DDTREE"
    assert h.gateway == "jump" and h.state_dir == "/var/lib/ddtree-deploy"
    assert inv.get("local").is_local and isinstance(inv.get("local").restart, PidfileRestart)
    assert inv.get("jump").health.smoke.max_new_tokens == 8


@pytest.mark.parametrize(("edit", "words"), [
    (lambda t: t.replace('port = 2222', 'port = 2222\nprot = 1'), "hosts.bastion-gpu.prot: Extra inputs are not permitted"),
    (lambda t: t.replace('gateway = "jump"', 'gateway = "nowhere"'), "hosts.bastion-gpu.gateway: no host 'nowhere'"),
    (lambda t: t.replace('"/opt/sglang/bin/python"', '"python3"'), "hosts.bastion-gpu.python: path must be an absolute path"),
    (lambda t: t.replace('strategy = "systemd", unit = "sglang.service"', 'strategy = "systemd"'), "hosts.bastion-gpu.restart.unit: Field required"),
    (lambda t: t.replace('strategy = "systemd"', 'strategy = "docker"'), "restart"),
    (lambda t: t.replace('ssh_alias = "jump"', ''), "give `ssh_alias`"),
    (lambda t: t + '\n[hosts.x]\n', "hosts.x"),
    (lambda t: t.replace('[hosts.local]\n', '[hosts.local]\naddress = "1.2.3.4"\n'), "the host `local` uses no SSH"),
    (lambda t: "[defaults]\nx = 1\n" + t, "unknown top-level key(s) defaults"),
    (lambda t: t.replace('port = 2222', 'port = 99999'), "hosts.bastion-gpu.port"),
    (lambda t: t + "\n[hosts.\"bad name\"]\n", "bad host name"),
    (lambda t: t.replace("[hosts.jump]", "[hosts.jump"), "not valid TOML"),
    (lambda t: "", "no hosts"),
])
def test_bad_inventory_is_a_clear_config_error(tmp_path, edit, words):
    p = write(tmp_path, edit(GOOD))
    with pytest.raises(ConfigError) as exc:
        load_inventory(p)
    msg = exc.value.message
    assert words in msg and str(p) in msg and "\n" not in msg
    assert exc.value.exit_code == EXIT_USAGE


def test_missing_inventory(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_inventory(tmp_path / "nope.toml")


def test_unknown_host_name(tmp_path):
    inv = load_inventory(write(tmp_path, GOOD))
    with pytest.raises(ConfigError, match=r"no host 'ct999' \(known: bastion-gpu, jump, local\)"):
        inv.get("ct999")


@pytest.mark.parametrize("cmd", [["push", "bastion-gpu"], ["plan", "bastion-gpu"], ["status", "jump"], ["rollback", "local"]])
def test_cli_bad_inventory_exit_2(tmp_path, cmd):
    p = write(tmp_path, GOOD.replace("port = 2222", "port = 2222\nprot = 1"))
    cli = Path(sys.executable).parent / "ddtree-deploy"
    r = subprocess.run([str(cli), *cmd, "-i", str(p)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "hosts.bastion-gpu.prot: Extra inputs are not permitted" in r.stderr
    assert r.stdout == ""


def test_example_inventory_is_valid():
    example = Path(__file__).resolve().parents[2] / "hosts.example.toml"
    inv = load_inventory(example)
    ct = inv.get("ct200")
    assert ct.health.deadline_s == 900 and ct.restart.strategy == "systemd"
