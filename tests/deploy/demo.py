"""Bring up the deploy test bed outside pytest and run ddtree-deploy commands against it
(used for the transcript in docs/DEPLOY.md). Usage, as root:

    .venv/bin/python tests/deploy/demo.py "plan ct200" "push ct200" "status ct200"

Each argument is one ddtree-deploy command line; `{build}` expands to the real build directory.
Everything is torn down at the end."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import deploy_testbed as tb  # noqa: E402
from deploy_cli import CLI, VENV_BIN, inventory_text  # noqa: E402


def main(commands: list[str]) -> int:
    root = Path(tempfile.mkdtemp(prefix="ddtree-demo-"))
    site = tb.sglang_site()
    build = tb.real_build(root / "build")  # a private build, so `ddtree-deploy push ct200` needs no --build
    algo = "DDTREE" if "DDTREE" in build.path_of("srt/speculative/spec_info.py").read_text() else "DFLASH"
    ssh = tb.ssh_bed(root / "ssh")
    hosts = {"ct200": tb.make_host("ct200", root / "ct200", site, algo),
             "gpu-b": tb.make_host("gpu-b", root / "gpu-b", site, algo),
             "local": tb.make_host("local", root / "local", site, "DFLASH")}
    tb.setup_systemd(hosts["ct200"])
    sup = tb.setup_supervisor(hosts["gpu-b"], ssh.ns)
    inv = root / "hosts.toml"
    inv.write_text(inventory_text(ssh, hosts, sup))
    env = dict(os.environ, DDTREE_DEPLOY_HOSTS=str(inv), DDTREE_DEPLOY_STATE=str(root / "deploy-state"),
               DDTREE_DEPLOY_BUILD=str(build.root), COLUMNS="120")
    # The build must pass its quality gates before `push` accepts it (writes GATES.json).
    subprocess.run([str(CLI), "check", "--build-dir", str(build.root.parent)], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rc = 0
    try:
        for c in commands:
            argv = shlex.split(c.replace("{build}", str(build.root)))
            print(f"$ ddtree-deploy {c}", flush=True)
            p = subprocess.run([str(CLI), *argv], env=env, text=True)
            print(f"[exit {p.returncode}]\n", flush=True)
            rc = rc or p.returncode
    finally:
        tb.sh(str(hosts["ct200"].root / "bin" / "systemctl"), "stop", "sglang", check=False)
        tb.sh(str(VENV_BIN / "supervisorctl"), "-c", str(sup), "shutdown", check=False)
        ssh.down()
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
