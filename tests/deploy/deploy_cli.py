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
              import_check: bool | None = None) -> str:
    """One [hosts.<name>] table for a test host. The pre-swap import check (tens of seconds on a
    CPU for the real build) runs on ct200 by default; other hosts and scenarios that test later
    stages switch it off to keep the suite fast."""
    if import_check is None:
        import_check = h.name == "ct200"
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
    if h.name == "ct200":
        kh = known_hosts or ssh.known_hosts
        return textwrap.dedent(f"""\
            [hosts.ct200]
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
    if h.name == "gpu-b":
        return textwrap.dedent(f"""\
            [hosts.gpu-b]
            ssh_alias = "gpu-b"
            ssh_config = "{ssh.ssh_config}"
            connect_timeout_s = 5
            """) + common + textwrap.dedent(f"""\
            restart = {{ strategy = "supervisor", program = "sglang", supervisorctl = "{VENV_BIN}/supervisorctl", config = "{sup_conf}", log_file = "{h.root}/run/service.log" }}
            """) + health
    argv = ", ".join(f'"{a}"' for a in ["/usr/bin/env", "DDTREE_TEST_SERVICE_ENV=1", *tb.service_argv(h)])
    return "[hosts.local]\n" + common + textwrap.dedent(f"""\
        restart = {{ strategy = "pidfile", pidfile = "{h.root}/run/service.pid", command = [{argv}], chdir = "{h.root}", log_file = "{h.root}/run/service.log" }}
        """) + health


def inventory_text(ssh, hosts, sup_conf, **kw) -> str:
    return "\n".join(host_toml(ssh, h, sup_conf, **kw) for h in hosts.values())


def run_cli(args: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], env=env, capture_output=True, text=True, timeout=timeout)
