"""A faulty transport double for the deploy tests (never shipped: only tests put this directory on
PYTHONPATH). With DDTREE_TEST_FAULT set, every SSH operation of the `ddtree-deploy` process is
counted and labelled (an agent op by its name, `put`, or `sh:<first word>` for a shell command):

  DDTREE_TEST_FAULT=drop@<label>#<n>   the n-th <label> operation runs on the host, then the SSH
                                       connection is really closed and the caller gets TransportLost
                                       (the answer is lost, as when the network dies mid-command)
  DDTREE_TEST_FAULT=kill@<label>#<n>   the n-th <label> operation runs, then this process SIGKILLs itself
  DDTREE_TEST_FAULT=fill@<label>#<n>   the n-th <label> operation runs, then the file DDTREE_TEST_FAULT_FILL
                                       is written with zeros until its filesystem is full (ENOSPC)
  DDTREE_TEST_FAULT=log                only log
  DDTREE_TEST_FAULT_LOG=<file>         one line per operation: "<label>#<n>"
  DDTREE_TEST_FAULT_REFUSE_RECONNECT=1 after a drop, reconnecting fails (the network stays down)
"""

import os
import shlex
import signal

_SPEC = os.environ.get("DDTREE_TEST_FAULT")


def _label(script: str) -> str:
    try:
        parts = shlex.split(script)
    except ValueError:
        return "sh:?"
    if "@@ddtree-agent@@" in parts[2:3][0] if len(parts) > 2 else False:
        return parts[3]
    return "sh:" + "-".join(os.path.basename(w) for w in parts[:2])


def _install() -> None:
    from ddtree_deploy.deploy import transport as tr
    from ddtree_deploy.deploy.errors import RemoteUnreachable

    counts: dict[str, int] = {}
    kind, _, point = (_SPEC or "").partition("@")
    state = {"fired": False}
    log = os.environ.get("DDTREE_TEST_FAULT_LOG")

    def after(self, label: str) -> None:
        counts[label] = counts.get(label, 0) + 1
        tag = f"{label}#{counts[label]}"
        if log:
            with open(log, "a") as f:
                f.write(tag + "\n")
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

    def run2(self, script, timeout_s=None):
        r = run(self, script, timeout_s)
        after(self, _label(script))
        return r

    def put2(self, local, remote, progress=None):
        put(self, local, remote, progress)
        after(self, "put")

    def open2(self):
        if state["fired"] and kind == "drop" and os.environ.get("DDTREE_TEST_FAULT_REFUSE_RECONNECT") == "1":
            raise RemoteUnreachable(f"{self.host.name}: cannot connect (test double: the network stays down)")
        reopen(self)

    tr.SSHTransport.run, tr.SSHTransport.put, tr.SSHTransport._open = run2, put2, open2
    lrun, lput = tr.LocalTransport.run, tr.LocalTransport.put

    def lrun2(self, script, timeout_s=None):
        r = lrun(self, script, timeout_s)
        after(self, _label(script))
        return r

    def lput2(self, local, remote, progress=None):
        lput(self, local, remote, progress)
        after(self, "put")

    tr.LocalTransport.run, tr.LocalTransport.put = lrun2, lput2


if _SPEC:
    _install()
