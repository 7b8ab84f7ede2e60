"""How commands and files reach a host: one small interface, an SSH (Fabric) and a local implementation.

Every command runs as `timeout -k 5 N sh -c '<script>'` on the host, so a hung command dies there
even if the connection does. SSH is strict: the known_hosts file is loaded and paramiko's
RejectPolicy set on every hop before the first byte is sent (Fabric accepts unknown keys by default).
A dropped connection raises TransportLost; nothing reconnects silently (callers call `reconnect()`).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config.inventory import Host, Inventory
from ..errors import RemoteUnreachable

ProgressFn = Callable[[int], None]  # called with the number of bytes sent since the last call

# paramiko logs a failed (re)connection with a traceback through the `logging` module; the tool
# reports it as one line (RemoteUnreachable), so nothing of it reaches stderr by itself
logging.getLogger("paramiko").addHandler(logging.NullHandler())

class TransportLost(RemoteUnreachable):
    """The connection dropped in the middle of an operation."""


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


def wrap(script: str, timeout_s: int, env: dict[str, str]) -> str:
    """The exact command line sent to the host: env exports + remote-side timeout + sh -c."""
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in sorted(env.items()))
    return f"timeout -k 5 {int(timeout_s)} sh -c {shlex.quote(exports + script)}"


class Transport:
    """Interface shared by SSH and local hosts."""

    host: Host

    @property
    def label(self) -> str:
        return self.host.name

    def run(self, script: str, timeout_s: int | None = None) -> Result:
        raise NotImplementedError

    def put(self, local: Path, remote: str, progress: ProgressFn | None = None) -> None:
        raise NotImplementedError

    def reconnect(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _timeout(self, timeout_s: int | None) -> int:
        return int(timeout_s if timeout_s is not None else self.host.command_timeout_s)


class LocalTransport(Transport):
    """This machine (host name `local`): same scripts, run through subprocess."""

    def __init__(self, host: Host):
        self.host = host

    def run(self, script: str, timeout_s: int | None = None) -> Result:
        t = self._timeout(timeout_s)
        p = subprocess.run(["sh", "-c", wrap(script, t, self.host.env)], capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=t + 30)
        return Result(p.returncode, p.stdout, p.stderr)

    def put(self, local: Path, remote: str, progress: ProgressFn | None = None) -> None:
        Path(remote).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, remote)
        if progress:
            progress(Path(local).stat().st_size)

    def reconnect(self) -> None:
        return None

    def close(self) -> None:
        return None


def _known_hosts_for(host: Host, ssh_config: dict) -> Path:
    raw = host.known_hosts or (ssh_config.get("userknownhostsfile") or "~/.ssh/known_hosts").split()[0]
    return Path(os.path.expanduser(raw))


class SSHTransport(Transport):
    """Fabric 3 connection with strict host keys, connect/banner/auth/channel timeouts and keepalive."""

    def __init__(self, host: Host, inventory: Inventory):
        self.host = host
        self.inventory = inventory
        self._dropped = False
        self.conn = None
        self._open()

    # -- connection -------------------------------------------------------------------------
    def _config(self):
        from fabric import Config

        path = self.host.ssh_config or os.path.expanduser("~/.ssh/config")
        if self.host.ssh_config and not Path(path).is_file():
            raise RemoteUnreachable(f"{self.host.name}: ssh_config {path} not found")
        return Config(runtime_ssh_path=path) if Path(path).is_file() else Config()

    def _connection(self, host: Host, config):
        from fabric import Connection

        t = host.connect_timeout_s
        ck: dict = {"banner_timeout": t, "auth_timeout": t, "channel_timeout": t}
        if host.identity_file:
            ck.update(key_filename=[os.path.expanduser(host.identity_file)], look_for_keys=False, allow_agent=False)
        if host.ssh_alias:
            return Connection(host.ssh_alias, config=config, connect_timeout=t, connect_kwargs=ck)
        gw = None
        if host.gateway:
            gw = self._connection(self.inventory.get(host.gateway), config)
        return Connection(host.address, user=host.user, port=host.port, config=config,
                          connect_timeout=t, connect_kwargs=ck, gateway=gw)

    def _harden(self, conn, first: bool) -> None:
        """Strict host keys on this hop and every gateway hop (Fabric defaults to AutoAddPolicy)."""
        import paramiko
        from fabric import Connection

        kh = _known_hosts_for(self.host, conn.ssh_config)
        if not kh.is_file():
            raise RemoteUnreachable(f"{self.host.name}: known_hosts file {kh} not found; refusing to trust an unknown host key "
                                    "(add the host's key after verifying it, e.g. ssh-keyscan + fingerprint check)")
        conn.client.load_host_keys(str(kh))
        conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        conn.connect_timeout = conn.connect_timeout or self.host.connect_timeout_s
        for k in ("banner_timeout", "auth_timeout", "channel_timeout"):
            conn.connect_kwargs.setdefault(k, self.host.connect_timeout_s)
        if isinstance(conn.gateway, Connection):
            self._harden(conn.gateway, False)
        elif isinstance(conn.gateway, str):
            raise RemoteUnreachable(f"{self.host.name}: ProxyCommand gateways are not supported (use ProxyJump)")

    def _open(self) -> None:
        import paramiko

        conn = self._connection(self.host, self._config())
        self._harden(conn, True)
        try:
            conn.open()
            conn.transport.set_keepalive(15)
        except paramiko.BadHostKeyException as exc:
            raise RemoteUnreachable(f"{self.host.name}: host key MISMATCH for {exc.hostname} (possible attack or reinstalled host); refusing") from None
        except paramiko.AuthenticationException as exc:
            raise RemoteUnreachable(f"{self.host.name}: SSH authentication failed ({exc})") from None
        except paramiko.SSHException as exc:
            msg = str(exc)
            if "known_hosts" in msg:
                msg = f"host key not in known_hosts, refusing an unknown key ({msg})"
            raise RemoteUnreachable(f"{self.host.name}: {msg}") from None
        except (TimeoutError, OSError, EOFError) as exc:
            raise RemoteUnreachable(f"{self.host.name}: cannot connect ({type(exc).__name__}: {exc})") from None
        self.conn = conn
        self._dropped = False

    def reconnect(self) -> None:
        self.close()
        self._open()

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # closing a dead connection may raise anything; nothing to do about it
                pass
            self.conn = None

    def _check_alive(self) -> None:
        if self._dropped or self.conn is None or not self.conn.is_connected:
            raise TransportLost(f"{self.host.name}: connection lost")

    # -- operations -------------------------------------------------------------------------
    def run(self, script: str, timeout_s: int | None = None) -> Result:
        from invoke.exceptions import CommandTimedOut

        self._check_alive()
        t = self._timeout(timeout_s)
        try:
            r = self.conn.run(wrap(script, t, self.host.env), hide=True, warn=True, timeout=t + 30, in_stream=False)
        except CommandTimedOut:
            raise TransportLost(f"{self.host.name}: no answer within {t + 30}s (connection stalled)") from None
        except (TimeoutError, OSError, EOFError) as exc:
            raise TransportLost(f"{self.host.name}: connection lost ({type(exc).__name__}: {exc})") from None
        except Exception as exc:
            import paramiko

            if isinstance(exc, paramiko.SSHException):
                raise TransportLost(f"{self.host.name}: connection lost ({exc})") from None
            raise
        if r.exited is None or r.exited < 0:
            # no exit status: the command was killed by a signal (the connection is still up), or the
            # connection died while it ran (Fabric then reports -1): the latter is a lost connection
            if not self.conn.is_connected or not self.conn.transport.is_active():
                self._dropped = True
                raise TransportLost(f"{self.host.name}: connection lost while the command ran on the host")
            return Result(-1 if r.exited is None else r.exited, r.stdout, r.stderr)
        return Result(r.exited, r.stdout, r.stderr)

    def put(self, local: Path, remote: str, progress: ProgressFn | None = None) -> None:
        self._check_alive()
        sent = [0]

        def cb(done: int, total: int) -> None:
            if progress and done > sent[0]:
                progress(done - sent[0])
                sent[0] = done

        try:
            self.conn.sftp().put(str(local), remote, callback=cb)
        except (TimeoutError, OSError, EOFError) as exc:
            if isinstance(exc, OSError) and not isinstance(exc, TimeoutError) and self.conn.is_connected \
                    and self.conn.transport.is_active():
                # the connection is fine: the host refused the write (SFTP "Failure": a full disk, ...)
                raise OSError(f"the host could not write {remote} ({exc})") from None
            raise TransportLost(f"{self.host.name}: upload of {remote} failed ({type(exc).__name__}: {exc})") from None


def connect(host: Host, inventory: Inventory) -> Transport:
    """Open the transport for `host` (raises RemoteUnreachable, exit 5)."""
    return LocalTransport(host) if host.is_local else SSHTransport(host, inventory)
