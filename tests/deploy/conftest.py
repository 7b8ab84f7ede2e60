"""Fixtures for the deploy tests: one session-wide test bed (sshd x2, netns, supervisors, three
hosts with their own real sglang install), the project's real build and some broken variants."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import deploy_testbed as tb

from deploy_cli import CLI, VENV_BIN, host_toml, inventory_text, run_cli  # noqa: F401  (re-exported)


FAULTS = Path(__file__).with_name("faults")


def _need_root_tools() -> str | None:
    """Why the test bed cannot start here, or None. Only a missing root account is a reason to skip
    (nothing to install fixes it); a root machine without the system tools is a setup error."""
    if os.geteuid() != 0:
        return "needs root (sshd, network namespaces)"
    missing = [name for name, tool in (("openssh-server", tb.SSHD), ("iproute2", shutil.which("ip")),
                                       ("dpkg (start-stop-daemon)", shutil.which("start-stop-daemon")),
                                       ("openssh-client", shutil.which("ssh-keygen")))
               if not tool or not Path(tool).exists()]  # fmt: skip
    if missing:
        pytest.fail(f"the deploy test bed needs {', '.join(missing)}: run `make setup` as root "
                    "(it installs them with apt-get)", pytrace=False)
    return None


@pytest.fixture(scope="session")
def site_cache() -> Path:
    try:
        return tb.sglang_site()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot install the sglang {tb.SGLANG_VERSION} wheel for the test hosts: {exc.stderr[-300:]}")


@pytest.fixture(scope="session")
def builds(tmp_path_factory, site_cache):
    """good: the project's real build; broken variants differ only in ddtree_utils.py."""
    root = tmp_path_factory.mktemp("builds")
    try:
        good = tb.real_build(root / "real")
    except Exception as exc:  # the builder is another engineer's work in progress: keep testing deploy
        print(f"real build unavailable ({exc}); using the fallback build")
        good = tb.fallback_build(site_cache, root / "fallback")
    utils = "srt/speculative/ddtree_utils.py"
    base = good.path_of(utils).read_bytes()
    in_service = b'\nimport os as _os\nif _os.environ.get("DDTREE_TEST_SERVICE_ENV") == "1":\n    %s\n'
    return {
        "good": good,
        # fails wherever it is imported: the pre-swap import check must catch it
        "bad_import": tb.derive_build(good, root / "bad_import", {utils: base + b'\nraise ImportError("ddtree test build: broken at import")\n'}),
        # imports fine in the deploy's import check, fails inside the service (its unit sets the env var):
        # stands in for failures that only show in the service's own environment (GPU, unit env)
        "bad_service": tb.derive_build(good, root / "bad_service", {utils: base + in_service % b'raise RuntimeError("ddtree test build: fails at import inside the service")'}),
        # the service hangs while loading: stands in for a model load that outlasts the deadline
        "hang_service": tb.derive_build(good, root / "hang_service", {utils: base + in_service % b'import time; time.sleep(3600)'}),
        "syntax": tb.derive_build(good, root / "syntax", {utils: base + b"\ndef broken(:\n"}),
    }


@pytest.fixture(scope="session")
def algorithm(builds) -> str:
    """DDTREE once the patch series adds it to spec_info.py, else DFLASH."""
    spec = builds["good"].path_of("srt/speculative/spec_info.py").read_text()
    return "DDTREE" if "DDTREE" in spec else "DFLASH"


@pytest.fixture(scope="session")
def bed(tmp_path_factory, site_cache, algorithm):
    why = _need_root_tools()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("bed")
    forkserver = tb.start_forkserver(root, site_cache)
    ssh = tb.ssh_bed(root / "ssh")
    hosts = {
        "ct200": tb.make_host("ct200", root / "ct200", site_cache, algorithm),
        "gpu-b": tb.make_host("gpu-b", root / "gpu-b", site_cache, algorithm),
        # `local` keeps DFLASH, valid on pristine and patched SGLang alike, so it can go back to pristine
        "local": tb.make_host("local", root / "local", site_cache, "DFLASH"),
    }
    tb.setup_systemd(hosts["ct200"])
    sup_conf = tb.setup_supervisor(hosts["gpu-b"], ssh.ns)
    inv = root / "hosts.toml"
    inv.write_text(inventory_text(ssh, hosts, sup_conf))
    state = root / "deploy-state"
    yield {"ssh": ssh, "hosts": hosts, "inventory": inv, "root": root, "supervisor": sup_conf, "local_state": state}
    # teardown: services, supervisord, fork server, sshd, netns
    for name in ("ct200",):
        tb.sh(str(hosts[name].root / "bin" / "systemctl"), "stop", "sglang", check=False)
    tb.sh("start-stop-daemon", "--stop", "--quiet", "--pidfile", str(hosts["local"].root / "run" / "service.pid"),
          "--retry", "TERM/10/KILL/5", "--remove-pidfile", "--oknodo", check=False)
    tb.sh(str(VENV_BIN / "supervisorctl"), "-c", str(sup_conf), "shutdown", check=False)
    forkserver.terminate()
    forkserver.wait(30)
    ssh.down()


@pytest.fixture
def cli_env(bed, tmp_path):
    """Environment for running the real console script against the test inventory."""
    env = dict(os.environ, DDTREE_DEPLOY_HOSTS=str(bed["inventory"]), DDTREE_DEPLOY_STATE=str(tmp_path / "deploy-state"),
               COLUMNS="400", DDTREE_DEPLOY_ALLOW_UNGATED="1")  # test builds skip the (slow) gates
    # the faulty transport double (tests/deploy/faults/sitecustomize.py): inert unless DDTREE_TEST_FAULT is set
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULTS), env.get("PYTHONPATH")) if p)
    env.pop("DDTREE_TEST_FAULT", None)
    return env
