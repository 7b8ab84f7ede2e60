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


# A client starts here as a supervisor starts it, with no signal ignored: a test run started in
# the background (nohup, `&`) ignores INT, QUIT and HUP, and a child inherits that (the client
# then passes them on as ignored, so its service would not end on them).
_SIGNALS_DEFAULT = (sys.executable, "-S", "-c", "import os, signal, sys\n"
                    "for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP): signal.signal(s, signal.SIG_DFL)\n"
                    "os.execv(sys.argv[1], sys.argv[1:])")


def start(sock: Path, script: Path, *args: str, prefix: tuple[str, ...] = (), **kw) -> subprocess.Popen:
    # a test that sets the client's signals itself (preexec_fn) keeps them
    launcher = () if "preexec_fn" in kw else _SIGNALS_DEFAULT
    return subprocess.Popen([*prefix, *launcher, sys.executable, "-S", "-E", str(tb.FORKSERVER), "client",
                             str(sock), str(script), *args],
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
    # one thread, as in a fresh interpreter: a signal sent to the service always reaches the
    # thread that runs it (a helper thread here once took a SIGINT and left the service asleep)
    assert info["other_threads_blocked"] == []


def test_an_uncaught_error_exits_1_with_its_traceback(server, tmp_path):
    root, sock = server
    p = start(sock, root / "svc.py", str(tmp_path / "i.json"), "raise")
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "Traceback" in stderr and "RuntimeError: boom from the service" in stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_signal_to_the_started_process_ends_the_service(server, tmp_path, sig):
    """TERM/INT are forwarded (the client then ends as the service did: by the same signal, or
    exit 1 for Python's KeyboardInterrupt traceback); KILL cannot be forwarded: the server sees
    the client's connection close and kills the service."""
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


def test_a_signal_before_the_service_exists_is_forwarded_once_it_does(tmp_path):
    """A supervisor's TERM can come right after the start, before the server has answered with the
    child's pid: the client keeps it and forwards it then. A stand-in server (this test) holds its
    answer until the signal has been sent; the "child" is a real process of this test."""
    import socket
    import threading

    sock = tmp_path / "fake.sock"
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lsock.bind(str(sock))
    lsock.listen(1)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    got: dict = {}
    signalled = threading.Event()

    def fake_server():
        conn, _ = lsock.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 18, 3)
        got["req"] = json.loads(msg)
        for fd in fds:
            os.close(fd)
        signalled.wait(30)
        time.sleep(0.2)  # the signal has reached the client by now
        conn.send(json.dumps({"pid": victim.pid}).encode())
        got["victim"] = victim.wait(30)
        conn.send(json.dumps({"status": 15}).encode())  # what waitpid reports for a SIGTERM death
        conn.close()

    t = threading.Thread(target=fake_server, daemon=True)
    t.start()
    p = start(sock, tmp_path / "svc.py", "x")
    try:
        deadline = time.monotonic() + 30
        while "req" not in got:  # the client has connected and sent its request: handlers are set
            assert time.monotonic() < deadline
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        signalled.set()
        p.communicate(timeout=30)
        t.join(10)
        assert got["victim"] == -signal.SIGTERM  # the kept signal reached the child
        assert p.returncode == -signal.SIGTERM
        assert got["req"]["ignored"] == []
    finally:
        victim.kill()
        lsock.close()


def test_a_signal_ignored_by_the_starter_is_ignored_by_the_service(server, tmp_path):
    """Started with SIGINT ignored (as `nohup`-like starters do), a fresh interpreter ignores SIGINT;
    so does the forked service. SIGTERM still ends it."""
    root, sock = server
    out = tmp_path / "info.json"
    p = start(sock, root / "svc.py", str(out), "sleep",
              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    child = wait_for(out)["pid"]
    os.kill(child, signal.SIGINT)  # straight to the service: the client forwards nothing it ignores
    time.sleep(0.5)
    assert not gone(child, timeout=0.5), "the service died of a SIGINT its starter ignored"
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    assert gone(child) and p.returncode == -signal.SIGTERM
