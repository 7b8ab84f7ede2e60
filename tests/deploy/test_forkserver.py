"""The test bed's fork server (tests/deploy/service/forkserver.py) keeps what a supervisor relies on
when it starts a service through it: argv, environment, working directory, stdio and sys.path as a
fresh interpreter has them; the same exit code; signals to the started process reach the service;
a SIGKILL of the started process ends the service; the service runs in the starter's network
namespace; without a server the plain interpreter runs. Each case runs one small script through a
real server (an empty preload list: the contract does not depend on what is preloaded)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import deploy_testbed as tb
import pytest

pytestmark = [pytest.mark.timeout(120)]

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    out = sys.argv[1]
    info = {"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("FS_TEST"), "path0": sys.path[:2],
            "pid": os.getpid(), "netns": os.stat("/proc/self/ns/net").st_ino, "main": __name__,
            "other_threads_blocked": [
                int(next(l for l in open(f"/proc/self/task/{t}/status") if l.startswith("SigBlk:")).split()[1], 16)
                for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]}
    with open(out + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(out + ".tmp", out)
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    mode = sys.argv[2]
    if mode == "exit":
        sys.exit(int(sys.argv[3]))
    if mode == "raise":
        raise RuntimeError("boom from the service")
    time.sleep(600)
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fs")
    (root / "pre.json").write_text("[]")
    sock = root / "fs.sock"
    p = tb.serve_forkserver(sock, root / "pre.json", root / "fs.log", timeout=60)
    (root / "svc.py").write_text(SCRIPT)
    yield root, sock
    p.terminate()
    p.wait(10)


def start(sock: Path, script: Path, *args: str, prefix: tuple[str, ...] = (), **kw) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-S", "-E", str(tb.FORKSERVER), "client", str(sock), str(script), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def wait_for(path: Path, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return json.loads(path.read_text())


def gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_service_sees_a_fresh_interpreters_view_and_its_exit_code_comes_back(server, tmp_path):
    root, sock = server
    out = tmp_path / "info.json"
    env = dict(os.environ, FS_TEST="from the unit", PYTHONPATH=f"/nonexistent/site{os.pathsep}{tmp_path}")
    p = start(sock, root / "svc.py", str(out), "exit", "3", cwd=tmp_path, env=env)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 3
    assert stdout == "to stdout\n" and "to stderr" in stderr
    info = json.loads(out.read_text())
    assert info["argv"] == [str(root / "svc.py"), str(out), "exit", "3"]
    assert info["cwd"] == str(tmp_path) and info["env"] == "from the unit" and info["main"] == "__main__"
    assert info["path0"] == [str(root), "/nonexistent/site"]  # script dir, then PYTHONPATH: as `python script`
    assert info["pid"] != p.pid  # a forked child, not the started process
    # the server's helper thread in the child blocks every signal, so a signal sent to the service
    # always reaches its main thread (a fresh interpreter has no other thread to take it)
    assert info["other_threads_blocked"], "the child has its watch thread"
    for mask in info["other_threads_blocked"]:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            assert mask >> (sig - 1) & 1, (hex(mask), sig)


def test_an_uncaught_error_exits_1_with_its_traceback(server, tmp_path):
    root, sock = server
    p = start(sock, root / "svc.py", str(tmp_path / "i.json"), "raise")
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "Traceback" in stderr and "RuntimeError: boom from the service" in stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_signal_to_the_started_process_ends_the_service(server, tmp_path, sig):
    """TERM/INT are forwarded (the client then ends as the service did: by the same signal, or
    exit 1 for Python's KeyboardInterrupt traceback); KILL cannot be forwarded: the service sees
    its starter's pidfd close and kills itself."""
    root, sock = server
    out = tmp_path / "info.json"
    p = start(sock, root / "svc.py", str(out), "sleep")
    child = wait_for(out)["pid"]
    p.send_signal(sig)
    p.communicate(timeout=30)
    assert gone(child), f"service {child} outlived its starter after {sig.name}"
    assert p.returncode == (1 if sig == signal.SIGINT else -sig)


def test_the_service_runs_in_its_starters_network_namespace(server, tmp_path):
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 for a network namespace")
    root, sock = server
    ns = f"ddtfs{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        want = subprocess.run(["ip", "netns", "exec", ns, "stat", "-L", "-c", "%i", "/proc/self/ns/net"],
                              capture_output=True, text=True, check=True).stdout.strip()
        out = tmp_path / "info.json"
        p = start(sock, root / "svc.py", str(out), "exit", "0", prefix=("ip", "netns", "exec", ns))
        p.communicate(timeout=60)
        assert p.returncode == 0
        got = json.loads(out.read_text())["netns"]
        assert str(got) == want and got != os.stat("/proc/self/ns/net").st_ino
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False)


def test_without_a_server_the_plain_interpreter_runs(server, tmp_path):
    root, _ = server
    out = tmp_path / "info.json"
    p = start(tmp_path / "no-server.sock", root / "svc.py", str(out), "exit", "5")
    p.communicate(timeout=60)
    assert p.returncode == 5
    assert json.loads(out.read_text())["pid"] == p.pid  # exec'd in place: the started process itself


def test_a_path_that_shadows_a_preloaded_module_gets_a_fresh_interpreter(server, tmp_path):
    """The server has imported `selectors`; a PYTHONPATH folder with its own `selectors.py` would be
    ignored by a forked child, so the client runs the plain interpreter instead."""
    root, sock = server
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "selectors.py").write_text("MARK = 1\n")
    out = tmp_path / "info.json"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "shadow"))
    p = start(sock, root / "svc.py", str(out), "exit", "0", env=env)
    p.communicate(timeout=60)
    assert p.returncode == 0
    assert json.loads(out.read_text())["pid"] == p.pid
