"""Helpers to drive the real `ddtree-deploy` console script against the test bed: inventory text
for the test hosts and a runner. A module of its own (not conftest.py) so test files import it
by a unique name: `from conftest import ...` is ambiguous with several conftest.py files."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import deploy_testbed as tb

VENV_BIN = Path(sys.executable).parent
CLI = VENV_BIN / "ddtree-deploy"


def host_toml(ssh, h, sup_conf, *, deadline: float = 240, known_hosts: Path | None = None,
              import_check: bool | None = None, kind: str | None = None, launch: str | None = None) -> str:
    """One [hosts.<name>] table for a test host. The pre-swap import check (tens of seconds on a
    CPU for the real build) runs on ct200 by default; other hosts and scenarios that test later
    stages switch it off to keep the suite fast. `kind` (default: the host's name) picks how it is
    reached and supervised: ct200 (loopback sshd, systemd shim), gpu-b (ssh_config alias through
    ProxyJump into the netns, supervisord), local (pidfile). `launch`: the body of its
    [hosts.<name>.launch] table (the health gate then derives the algorithm from the flags)."""
    kind = kind or h.name
    if import_check is None:
        import_check = kind == "ct200"
    common = textwrap.dedent(f"""\
        python = "{h.python}"
        import_check = {str(import_check).lower()}
        state_dir = "{h.state}"
        keep_releases = 3
        command_timeout_s = 120
        """)
    health = textwrap.dedent(f"""\
        [hosts.{h.name}.health]
        url = "http://127.0.0.1:{h.port}"
        deadline_s = {deadline}
        interval_s = 0.5
        expect_algorithm = "{h.algorithm}"
        smoke = {{ text = "The capital of France is", max_new_tokens = 6 }}
        """)
    if launch is not None:
        health = health.replace(f'expect_algorithm = "{h.algorithm}"\n', "") + f"[hosts.{h.name}.launch]\n{launch}\n"
    if kind == "ct200":
        kh = known_hosts or ssh.known_hosts
        return textwrap.dedent(f"""\
            [hosts.{h.name}]
            address = "127.0.0.1"
            port = {ssh.port}
            user = "root"
            identity_file = "{ssh.client_key}"
            known_hosts = "{kh}"
            connect_timeout_s = 5
            env = {{ PATH = "{h.root}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" }}
            """) + common + textwrap.dedent(f"""\
            restart = {{ strategy = "systemd", unit = "sglang.service", log_file = "{h.root}/run/sglang.log" }}
            """) + health
    if kind == "gpu-b":
        return textwrap.dedent(f"""\
            [hosts.{h.name}]
            ssh_alias = "gpu-b"
            ssh_config = "{ssh.ssh_config}"
            connect_timeout_s = 5
            """) + common + textwrap.dedent(f"""\
            restart = {{ strategy = "supervisor", program = "sglang", supervisorctl = "{VENV_BIN}/supervisorctl", config = "{sup_conf}", log_file = "{h.root}/run/service.log" }}
            """) + health
    argv = ", ".join(f'"{a}"' for a in ["/usr/bin/env", "DDTREE_TEST_SERVICE_ENV=1", *tb.service_argv(h)])
    return f"[hosts.{h.name}]\n" + common + textwrap.dedent(f"""\
        restart = {{ strategy = "pidfile", pidfile = "{h.root}/run/service.pid", command = [{argv}], chdir = "{h.root}", log_file = "{h.root}/run/service.log" }}
        """) + health


def inventory_text(ssh, hosts, sup_conf, **kw) -> str:
    return "\n".join(host_toml(ssh, h, sup_conf, **kw) for h in hosts.values())


def run_cli(args: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], env=env, capture_output=True, text=True, timeout=timeout)
