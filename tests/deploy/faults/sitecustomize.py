"""A faulty transport double for the deploy tests (never shipped: only tests put this directory on
PYTHONPATH). With DDTREE_TEST_FAULT set, every SSH operation of the `ddtree-deploy` process is
counted and labelled (an agent op by its name, `put`, or `sh:<first word>` for a shell command):

  DDTREE_TEST_FAULT=drop@<label>#<n>   the n-th <label> operation runs on the host, then the SSH
                                       connection is really closed and the caller gets TransportLost
                                       (the answer is lost, as when the network dies mid-command)
  DDTREE_TEST_FAULT=kill@<label>#<n>   the n-th <label> operation runs, then this process SIGKILLs itself
  DDTREE_TEST_FAULT=cut@<label>#<n>    the n-th <label> command is made to take 3 s longer on the host (`sleep 3;`
                                       first) and the SSH transport is closed 1 s after it started: the
                                       connection dies *during* the command, and the library's own
                                       behaviour (Fabric: exit status -1) reaches the tool
  DDTREE_TEST_FAULT=fill@<label>#<n>   the n-th <label> operation runs, then the file DDTREE_TEST_FAULT_FILL
                                       is written with zeros until its filesystem is full (ENOSPC)
  DDTREE_TEST_FAULT=log                only log
  DDTREE_TEST_FAULT_LOG=<file>         one line per operation: "<label>#<n>"
  DDTREE_TEST_FAULT_BYTES=<file>       one line per operation: "<label>#<n> <bytes sent>" (the command
                                       line as sent, or the uploaded file's size): trips and bytes of a run
  DDTREE_TEST_FAULT_REFUSE_RECONNECT=1 after a drop, reconnecting fails (the network stays down)
"""

import os
import shlex
import signal
import threading

_SPEC = os.environ.get("DDTREE_TEST_FAULT")


def _label(script: str) -> str:
    try:
        parts = shlex.split(script)
    except ValueError:
        return "sh:?"
    if len(parts) > 3 and parts[1] == "-c" and "@@ddtree-agent@@" in parts[2]:
        return parts[3]  # python -c <agent source> <op> <json> --save <path>: the first call of a connection
    if len(parts) > 2 and os.path.basename(parts[1]).startswith("ddtree-agent-"):
        return parts[2]  # python <state_dir>/ddtree-agent-<sha>.py <op> <json>: the stored agent
    return "sh:" + "-".join(os.path.basename(w) for w in parts[:2])


def _install() -> None:
    from ddtree_deploy.deploy.errors import RemoteUnreachable
    from ddtree_deploy.deploy.remote import transport as tr

    counts: dict[str, int] = {}
    kind, _, point = (_SPEC or "").partition("@")
    state = {"fired": False}
    log = os.environ.get("DDTREE_TEST_FAULT_LOG")
    sizes = os.environ.get("DDTREE_TEST_FAULT_BYTES")

    def after(self, label: str, nbytes: int = 0) -> None:
        counts[label] = counts.get(label, 0) + 1
        tag = f"{label}#{counts[label]}"
        if log:
            with open(log, "a") as f:
                f.write(tag + "\n")
        if sizes:
            with open(sizes, "a") as f:
                f.write(f"{tag} {nbytes}\n")
        if state["fired"] or tag != point:
            return
        state["fired"] = True
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "fill":
            fd = os.open(os.environ["DDTREE_TEST_FAULT_FILL"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                for size in (1 << 20, 4096, 1):  # until not even one more byte fits
                    try:
                        while True:
                            os.write(fd, b"\0" * size)
                    except OSError:
                        pass
            finally:
                os.close(fd)
        if kind == "drop":
            self.conn.client.get_transport().close()
            self._dropped = True
            raise tr.TransportLost(f"{self.host.name}: connection lost (test double: dropped after {tag})")

    run, put, reopen = tr.SSHTransport.run, tr.SSHTransport.put, tr.SSHTransport._open

    def sent(self, script, timeout_s):
        return len(tr.wrap(script, self._timeout(timeout_s), self.host.env).encode())

    def run2(self, script, timeout_s=None):
        label = _label(script)
        if kind == "cut" and not state["fired"] and f"{label}#{counts.get(label, 0) + 1}" == point:
            state["fired"] = True
            script = "sleep 3; " + script
            threading.Timer(1.0, lambda: self.conn.client.get_transport().close()).start()
        r = run(self, script, timeout_s)
        after(self, _label(script), sent(self, script, timeout_s))
        return r

    def put2(self, local, remote, progress=None):
        put(self, local, remote, progress)
        after(self, "put", os.path.getsize(local))

    def open2(self):
        if state["fired"] and kind in ("drop", "cut") and os.environ.get("DDTREE_TEST_FAULT_REFUSE_RECONNECT") == "1":
            raise RemoteUnreachable(f"{self.host.name}: cannot connect (test double: the network stays down)")
        reopen(self)

    tr.SSHTransport.run, tr.SSHTransport.put, tr.SSHTransport._open = run2, put2, open2
    lrun, lput = tr.LocalTransport.run, tr.LocalTransport.put

    def lrun2(self, script, timeout_s=None):
        r = lrun(self, script, timeout_s)
        after(self, _label(script), sent(self, script, timeout_s))
        return r

    def lput2(self, local, remote, progress=None):
        lput(self, local, remote, progress)
        after(self, "put", os.path.getsize(local))

    tr.LocalTransport.run, tr.LocalTransport.put = lrun2, lput2


if _SPEC:
    _install()
