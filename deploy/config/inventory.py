"""The host inventory: `hosts.toml` parsed with tomllib and validated by pydantic (unknown keys refused).

Each `[hosts.<name>]` table describes how to reach one host (an SSH target, an ssh_config alias, or
the local machine), the service's python, the restart strategy and the health gate. The host named
`local` uses no SSH at all. See docs/DEPLOY.md for every key.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ..errors import ConfigError
from . import launch as _launch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_INVENTORY = "hosts.toml"
LOCAL_HOST = "local"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _absolute(value: str | None, what: str) -> str | None:
    if value is not None and not value.startswith("/"):
        raise ValueError(f"{what} must be an absolute path on the host, got {value!r}")
    return value


class SystemdRestart(_Strict):
    strategy: Literal["systemd"]
    unit: str
    sudo: bool = True  # `sudo -n systemctl ...`; set false when the SSH user may manage the unit
    log_file: str | None = None  # tail this instead of `journalctl -u <unit>` on failure


class SupervisorRestart(_Strict):
    strategy: Literal["supervisor"]
    program: str
    supervisorctl: str = "supervisorctl"
    config: str | None = None  # supervisord.conf passed as `-c`
    log_file: str | None = None


class PidfileRestart(_Strict):
    strategy: Literal["pidfile"]
    pidfile: str
    command: list[str] = Field(min_length=1)  # argv of the service; command[0] absolute
    chdir: str = "/"
    log_file: str | None = None  # start-stop-daemon --output target
    stop_retry: str = "TERM/30/KILL/5"

    @field_validator("pidfile", "chdir")
    @classmethod
    def _abs(cls, v: str) -> str:
        return _absolute(v, "path")  # type: ignore[return-value]

    @field_validator("command")
    @classmethod
    def _abs_cmd(cls, v: list[str]) -> list[str]:
        _absolute(v[0], "command[0]")
        return v


class CommandRestart(_Strict):
    strategy: Literal["command"]
    start: str
    stop: str
    status: str  # exit 0 while the service process is alive
    log_file: str | None = None


Restart = Annotated[
    SystemdRestart | SupervisorRestart | PidfileRestart | CommandRestart,
    Field(discriminator="strategy"),
]


class Smoke(_Strict):
    text: str = "The capital of France is"
    max_new_tokens: int = Field(default=8, ge=1, le=4096)


class Health(_Strict):
    url: str = "http://127.0.0.1:30000"  # as seen from the host itself (checks run on the host)
    deadline_s: float = Field(default=900.0, gt=0)
    interval_s: float = Field(default=5.0, gt=0)
    request_timeout_s: float = Field(default=10.0, gt=0)
    expect_algorithm: str | None = "DDTREE"  # speculative_algorithm in /get_server_info
    smoke: Smoke | None = Smoke()

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"health url must start with http:// or https://, got {v!r}")
        return v.rstrip("/")


class Launch(_Strict):
    """The service's speculative flags as part of the release (deploy/config/launch.py): the unit reads
    `variable` from `env_file` (systemd EnvironmentFile=, or a supervisord wrapper that sources it)."""

    env_file: str
    variable: str = _launch.DEFAULT_VARIABLE
    # what a push of a DDTREE build sets; None: the build's pin's default (args_for)
    ddtree_args: str | None = None

    @field_validator("env_file")
    @classmethod
    def _env_file(cls, v: str) -> str:
        return _launch.validate_env_file(v)

    @field_validator("variable")
    @classmethod
    def _variable(cls, v: str) -> str:
        return _launch.validate_variable(v)

    @field_validator("ddtree_args")
    @classmethod
    def _args(cls, v: str | None) -> str | None:
        return None if v is None else _launch.validate_ddtree_args(v)

    def args_for(self, sglang_version: str) -> str:
        """The DDTREE flags a push of a `sglang_version` build sets: `ddtree_args`, or the pin's
        default (launch.default_ddtree_args)."""
        return self.ddtree_args or _launch.default_ddtree_args(sglang_version)


class Host(_Strict):
    """One deploy target. `name` is the inventory key."""

    name: str
    # SSH target: either `ssh_alias` (resolved through ssh_config, ProxyJump honoured) or `address`.
    ssh_alias: str | None = None
    address: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None  # default: ssh_config UserKnownHostsFile, else ~/.ssh/known_hosts
    ssh_config: str | None = None  # default: ~/.ssh/config when it exists
    gateway: str | None = None  # another inventory host used as jump host
    connect_timeout_s: float = Field(default=15.0, gt=0)
    command_timeout_s: int = Field(default=300, ge=5)
    env: dict[str, str] = Field(default_factory=dict)  # exported for every remote command (e.g. PATH)
    # The service
    python: str
    sglang_dir: str | None = None  # detected from `python` when absent
    state_dir: str = "/var/lib/ddtree-deploy"
    keep_releases: int = Field(default=5, ge=1)
    min_free_mb: int = Field(default=64, ge=0)
    import_check: bool = True  # import the staged modules with `python` before the swap
    restart: Restart
    health: Health = Health()
    launch: Launch | None = None  # the launch flags travel with the release (push sets, rollback restores)

    @field_validator("python", "sglang_dir", "state_dir")
    @classmethod
    def _abs(cls, v: str | None) -> str | None:
        return _absolute(v, "path")

    @property
    def is_local(self) -> bool:
        return self.name == LOCAL_HOST

    @model_validator(mode="after")
    def _target(self) -> Host:
        if self.is_local:
            ssh = [k for k in ("ssh_alias", "address", "port", "user", "identity_file", "gateway") if getattr(self, k)]
            if ssh:
                raise ValueError(f"the host `local` uses no SSH; remove {', '.join(ssh)}")
        elif not (self.ssh_alias or self.address):
            raise ValueError("give `ssh_alias` (an ~/.ssh/config host) or `address`")
        elif self.ssh_alias and self.address:
            raise ValueError("give either `ssh_alias` or `address`, not both")
        if self.launch is not None and "expect_algorithm" in self.health.model_fields_set:
            raise ValueError("with [launch] the health gate expects the algorithm of the flags each state puts in "
                             "place (DDTREE after a push, the previous flags' after a rollback); "
                             "remove health.expect_algorithm")
        return self


class Inventory(_Strict):
    path: str
    hosts: dict[str, Host]

    def get(self, name: str) -> Host:
        if name not in self.hosts:
            known = ", ".join(sorted(self.hosts)) or "none"
            raise ConfigError(f"{self.path}: no host {name!r} (known: {known})")
        return self.hosts[name]


def default_path() -> Path:
    return Path(os.environ.get("DDTREE_DEPLOY_HOSTS", DEFAULT_INVENTORY))


def _format_error(path: Path, name: str, exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and p in ("systemd", "supervisor", "pidfile", "command")))
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    where = f"hosts.{name}.{loc}" if loc else f"hosts.{name}"
    return f"{path}: {where}: {msg}{more}"


def load_inventory(path: Path | str | None = None) -> Inventory:
    """Read and validate an inventory; every problem is a ConfigError (exit 2) naming file and key."""
    p = Path(path) if path is not None else default_path()
    if not p.is_file():
        raise ConfigError(f"inventory {p} not found (copy hosts.example.toml, or pass --inventory)")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML ({exc})") from exc
    unknown = set(data) - {"hosts"}
    if unknown:
        raise ConfigError(f"{p}: unknown top-level key(s) {', '.join(sorted(unknown))} (only [hosts.<name>] tables)")
    raw = data.get("hosts")
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{p}: no hosts (add a [hosts.<name>] table)")
    hosts: dict[str, Host] = {}
    for name, table in raw.items():
        if not _NAME.match(name):
            raise ConfigError(f"{p}: bad host name {name!r} (letters, digits, . _ -)")
        if not isinstance(table, dict):
            raise ConfigError(f"{p}: hosts.{name} must be a table")
        if "name" in table:
            raise ConfigError(f"{p}: hosts.{name}: unknown key 'name' (the table key is the name)")
        try:
            hosts[name] = Host.model_validate({**table, "name": name})
        except ValidationError as exc:
            raise ConfigError(_format_error(p, name, exc)) from None
    for h in hosts.values():
        if h.gateway is not None:
            if h.gateway not in hosts:
                raise ConfigError(f"{p}: hosts.{h.name}.gateway: no host {h.gateway!r} in the inventory")
            if h.gateway == h.name or hosts[h.gateway].is_local:
                raise ConfigError(f"{p}: hosts.{h.name}.gateway: {h.gateway!r} cannot be a gateway")
    return Inventory(path=str(p), hosts=hosts)
