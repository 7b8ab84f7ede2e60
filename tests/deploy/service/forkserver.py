"""A fork server for the stub service of the deploy test bed: the service's start without the
third-party import bill.

Why: every start of tests/deploy/service/server.py imports the host's real sglang, and sglang pulls
torch, torchvision (torch._dynamo with it), transformers, openai, scipy, ...: about 8 CPU-s, of which
sglang's own modules are about 1 s. The sshd tests restart services over a hundred times, so on 2
cores that import was the largest single cost of `make test` (docs/TESTING.md, ninth session).

How: one server per test bed imports those third-party modules once (the list is what the service
imported in a discovery run, minus everything from the host's site, i.e. sglang), then forks a child
per service start. The host's python wrapper sends `python <server.py> ...` here (`client`); every
other python command runs as before. Nothing of sglang is ever imported in the server: each child
imports the host's sglang from its own site, exactly as a fresh interpreter does, so a broken
deployed build still fails inside the service.

The supervisor keeps tracking the service: the process it started (systemd shim, supervisord,
start-stop-daemon) is the client, which lives exactly as long as the service child:
- the child joins the client's network namespace (supervisord runs in the bed's netns), takes its
  stdin/stdout/stderr (passed over the socket), working directory, environment and argv;
- SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 sent to the client are forwarded to the child;
- a client that dies (SIGKILL included) takes the child with it (the server sees the client's connection
  close and kills the child; the child has one thread, as a fresh interpreter);
- a signal that comes before the child exists is kept and forwarded once it does, and a signal the
  client's starter ignored is ignored by the child too;
- the client ends as the child ended: the same exit code, or killed by the same signal.
Where the server is not running, or the request's PYTHONPATH or script folder holds a module the
server has already imported (a fresh interpreter would load that copy instead), the client execs the
real interpreter with the same arguments.

Usage: forkserver.py discover SITE OUT.json | serve SOCKET PRELOAD.json | client SOCKET SCRIPT [ARGS...]
(the client is run with `python -S -E`: stdlib only, nothing imported at module level but that).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
MAX_MSG = 1 << 18  # one request: argv, environment, cwd (SOCK_SEQPACKET keeps it one message)
CLONE_NEWNET = 0x40000000


# -- client: what the supervisor starts --------------------------------------------------------------
def client(sock_path: str, argv: list[str]) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(sock_path)
    except OSError:  # no server: the plain interpreter, as if this wrapper were not there
        s.close()
        os.execv(sys.executable, [sys.executable, *argv])
    # Signals are caught from here on: one that comes before the child exists (a supervisor's TERM
    # right after the start) is kept and forwarded once the child's pid is known, not lost.
    child = 0
    pending: list[int] = []
    original = {sig: signal.getsignal(sig) for sig in FORWARDED}

    def forward(n: int, _frame) -> None:
        if not child:
            pending.append(n)
            return
        try:
            os.kill(child, n)
        except ProcessLookupError:  # ended already: its status is on the way
            pass

    ignored = [int(sig) for sig, h in original.items() if h == signal.SIG_IGN]
    for sig in FORWARDED:
        if sig not in ignored:
            signal.signal(sig, forward)
    req = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid(), "ignored": ignored}
    socket.send_fds(s, [json.dumps(req).encode()], [0, 1, 2])
    first = s.recv(MAX_MSG)
    if not first:
        sys.exit("forkserver: the server closed the connection before starting the service")
    answer = json.loads(first)
    if "exec" in answer:  # the server cannot start this one as a fresh interpreter would: be one
        s.close()
        for sig, h in original.items():
            signal.signal(sig, h)
        for n in pending:  # what came meanwhile, to this process as it now is
            os.kill(os.getpid(), n)
        os.execv(sys.executable, [sys.executable, *argv])
    child = answer["pid"]
    for n in pending:
        forward(n, None)
    last = s.recv(MAX_MSG)
    if not last:  # the server died (nothing watches us for the child any more): end here, take it along
        os.kill(child, signal.SIGKILL)
        sys.exit("forkserver: the server went away")
    status = json.loads(last)["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


# -- discovery: which modules the service imports that are not the host's ---------------------------
def discover(site: str, out: str) -> None:
    """Run in a fresh interpreter with PYTHONPATH=site: import what the service imports, write the
    third-party module names in import order."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import server  # the stub service (its module-level imports are stdlib only)

    server.load(None, [])
    site = os.path.realpath(site)
    names = []
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None) or ""
        if name.split(".")[0] in ("sglang", "server", "__main__") or (f and os.path.realpath(f).startswith(site + os.sep)):
            continue
        names.append(name)
    with open(out + ".tmp", "w") as fh:
        json.dump(names, fh)
    os.replace(out + ".tmp", out)


# -- server -------------------------------------------------------------------------------------------
def preload(names: list[str]) -> int:
    import importlib

    n = 0
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            n += 1
        except BaseException:  # noqa: BLE001 - a module that only imports in its parent's context
            pass
    return n


def shadowing(req: dict) -> list[str]:
    """Modules this server has imported that the request's sys.path would take from elsewhere (a
    PYTHONPATH entry or the script's folder comes before site-packages), and a sitecustomize there
    (a fresh interpreter runs it at start-up): a forked child would differ, so such a request is
    not forked."""
    tops = {name.split(".")[0] for name in sys.modules} | {"sitecustomize", "usercustomize"}  # run at start-up
    dirs = [os.path.dirname(os.path.abspath(os.path.join(req["cwd"], req["argv"][0])))]
    dirs += [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    hits = []
    for d in dirs:
        try:
            entries = os.listdir(d)
        except OSError:
            continue
        for e in entries:
            name = e.split(".")[0]
            if name in tops and not e.endswith((".dist-info", ".egg-info", ".pth")) and e != "__pycache__":
                hits.append(os.path.join(d, e))
    return hits


def _join_netns(pid: int) -> None:
    theirs = f"/proc/{pid}/ns/net"
    if os.stat(theirs).st_ino == os.stat("/proc/self/ns/net").st_ino:
        return
    import ctypes

    fd = os.open(theirs, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({theirs})")
    finally:
        os.close(fd)


def _run_child(req: dict, fds: list[int]) -> None:
    """In the forked child: become the service the client asked for, then exit with its status."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's own handlers: a fresh interpreter's
        ignored = set(req.get("ignored", ()))  # what the client's starter ignored, as a fresh python would
        for sig in FORWARDED:
            if sig in ignored:
                signal.signal(sig, signal.SIG_IGN)
            elif sig == signal.SIGINT:
                signal.signal(sig, signal.default_int_handler)
            else:
                signal.signal(sig, signal.SIG_DFL)
        _join_netns(req["pid"])
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        argv = req["argv"]
        script = os.path.abspath(argv[0])
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[0:0] = [os.path.dirname(script), *extra]  # as a fresh `python script` orders them
        sys.argv = list(argv)
        import importlib
        import runpy
        import traceback

        importlib.invalidate_caches()
        # One thread, as in a fresh interpreter: a signal always reaches the thread that runs the
        # service (the server, not a thread here, kills this child when its client dies).
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught error
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(sock_path: str, preload_file: str) -> None:
    import selectors

    with open(preload_file) as fh:
        n = preload(json.load(fh))
    try:
        os.unlink(sock_path)
    except FileNotFoundError:
        pass
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lsock.bind(sock_path + ".tmp")
    lsock.listen(64)
    os.replace(sock_path + ".tmp", sock_path)  # the socket appears once the server is ready
    print(f"forkserver: {n} modules preloaded, listening on {sock_path}", flush=True)
    rd, wr = os.pipe()
    os.set_blocking(rd, False)
    os.set_blocking(wr, False)
    signal.set_wakeup_fd(wr)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ)
    sel.register(rd, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.fileobj is lsock:
                conn, _ = lsock.accept()
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(conn, MAX_MSG, 3)
                    req = json.loads(msg)
                except (OSError, ValueError):
                    conn.close()
                    continue
                hits = shadowing(req)
                if hits:
                    print(f"forkserver: not forked (a fresh interpreter would load {', '.join(hits[:3])})", flush=True)
                    for fd in fds:
                        os.close(fd)
                    conn.send(json.dumps({"exec": True}).encode())
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    lsock.close()
                    conn.close()
                    os.close(rd)
                    os.close(wr)
                    for other in children.values():
                        other.close()
                    _run_child(req, fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                conn.send(json.dumps({"pid": pid}).encode())
                sel.register(conn, selectors.EVENT_READ, pid)
            elif key.fileobj == rd:
                while True:
                    try:
                        if not os.read(rd, 512):
                            break
                    except BlockingIOError:
                        break
            else:  # a client's connection: it only ever closes, when the client is gone
                try:
                    data = key.fileobj.recv(MAX_MSG)
                except OSError:
                    data = b""
                if not data:  # the client died (its supervisor killed it): so does the service
                    sel.unregister(key.fileobj)
                    try:
                        os.kill(key.data, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        while children:  # reap: tell each client how its child ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                if conn in (k.fileobj for k in sel.get_map().values()):
                    sel.unregister(conn)
                try:
                    conn.send(json.dumps({"status": status}).encode())
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "client" and len(sys.argv) > 3:
        client(sys.argv[2], sys.argv[3:])
    elif cmd == "serve" and len(sys.argv) == 4:
        serve(sys.argv[2], sys.argv[3])
    elif cmd == "discover" and len(sys.argv) == 4:
        discover(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__.rsplit("Usage: ", 1)[1])
