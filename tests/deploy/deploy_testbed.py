"""The deploy test bed: real sshd servers (loopback + a network namespace behind it as ProxyJump),
real supervisors (start-stop-daemon, supervisord, a systemctl shim over start-stop-daemon) and
"remote" SGLang installs (the real sglang wheel, installed per host with `pip --target`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddtree_deploy.deploy.build.buildinfo import (
    MANIFEST_NAME,
    BuildFile,
    BuildInfo,
    compute_build_id,
    load_build,
    sha256_file,
)

REPO = Path(__file__).resolve().parents[2]
SGLANG_VERSION = "0.5.13.post1"
SERVICE = Path(__file__).with_name("service") / "server.py"
SHIMS = Path(__file__).with_name("shims")
SITE_CACHE = REPO / ".cache" / "deploy-tests" / f"site-{SGLANG_VERSION}"
SSHD = "/usr/sbin/sshd"


def sh(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the remote SGLang ------------------------------------------------------------------------------
def sglang_site(version: str = SGLANG_VERSION) -> Path:
    """A pip --target install of the real sglang wheel of `version` (no deps), made once and cached."""
    import fcntl

    cache = SITE_CACHE.with_name(f"site-{version}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    # pytest-xdist workers share the cache: one installs, the others wait for it under the lock
    with open(cache.with_name(cache.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (cache / "sglang" / "__init__.py").is_file():
            return cache
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        wheels = sorted((REPO / ".cache" / "wheels").glob(f"sglang-{version}-*.whl"))
        src = [str(wheels[-1]), "--no-index"] if wheels else [f"sglang=={version}"]
        sh(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), *src)
        shutil.rmtree(cache, ignore_errors=True)  # a half-made folder of an interrupted run
        os.replace(tmp, cache)
        return cache


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under root except bytecode caches: 'the host's files, byte for byte'."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            p = Path(dirpath) / f
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -- builds -----------------------------------------------------------------------------------------
def real_build(dest_root: Path) -> BuildInfo:
    """The project's own build (snapshot + patch series + ddtree_utils.py)."""
    from ddtree_deploy.deploy.build.build import Inputs, build

    return build(Inputs(build_root=dest_root)).info


def derive_build(base: BuildInfo, dest: Path, changes: dict[str, bytes]) -> BuildInfo:
    """A copy of `base` with some files replaced; manifest written with deploy.build.buildinfo."""
    dest.mkdir(parents=True)
    files = {}
    for rel, f in base.files.items():
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if rel in changes:
            p.write_bytes(changes[rel])
        else:
            shutil.copyfile(base.path_of(rel), p)
        files[rel] = BuildFile(rel, sha256_file(p), p.stat().st_size, f.pristine_sha256)
    info = BuildInfo(dest, base.sglang_version, compute_build_id({r: f.sha256 for r, f in files.items()}, base.sglang_version),
                     base.series_sha256, base.snapshot_manifest_sha256, list(base.patches), files)
    (dest / MANIFEST_NAME).write_text(json.dumps(info.to_json(), indent=2))
    return load_build(dest)


def fallback_build(site: Path, dest: Path) -> BuildInfo:
    """Only when the project's builder cannot build: pristine files + a marker, plus ddtree_utils.py."""
    dest.mkdir(parents=True)
    files = {}
    for rel in ("srt/speculative/spec_info.py", "srt/speculative/dflash_info.py", "srt/speculative/ddtree_utils.py"):
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        orig = site / "sglang" / rel
        pristine = sha256_file(orig) if orig.is_file() else None
        data = (orig.read_bytes() if orig.is_file() else (REPO / "ddtree_utils.py").read_bytes()) + b"\n# ddtree test build\n"
        p.write_bytes(data)
        files[rel] = BuildFile(rel, sha256_file(p), len(data), pristine)
    info = BuildInfo(dest, SGLANG_VERSION, compute_build_id({r: f.sha256 for r, f in files.items()}, SGLANG_VERSION), "0" * 64, "0" * 64, [], files)
    (dest / MANIFEST_NAME).write_text(json.dumps(info.to_json(), indent=2))
    return load_build(dest)


# -- ssh ------------------------------------------------------------------------------------------
SSHD_CONFIG = """\
Port {port}
ListenAddress {addr}
HostKey {hostkey}
PidFile {pidfile}
AuthorizedKeysFile {authkeys}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin prohibit-password
# the keys live under /tmp (mode 1777), which StrictModes would refuse
StrictModes no
Subsystem sftp internal-sftp
LogLevel VERBOSE
# authorized_keys gives the bed's key its own HOME (see ssh_bed)
PermitUserEnvironment yes
"""


@dataclass
class SSHBed:
    root: Path
    port: int
    ns: str
    veth: str
    ns_addr: str
    client_key: Path
    known_hosts: Path
    ssh_config: Path
    pids: list[Path] = field(default_factory=list)

    def down(self) -> None:
        for p in self.pids:
            if p.is_file():
                try:
                    os.kill(int(p.read_text().strip()), 15)
                except (ProcessLookupError, ValueError):
                    pass
        sh("ip", "link", "del", self.veth, check=False)
        sh("ip", "netns", "del", self.ns, check=False)


def ssh_bed(root: Path) -> SSHBed:
    """sshd on 127.0.0.1:<free port> ("bastion") and sshd on port 22 in a fresh network namespace."""
    root.mkdir(parents=True, exist_ok=True)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    pid = os.getpid()
    ns, veth = f"ddt{pid}", f"ddt{pid}a"
    o2, o3 = 200 + pid % 50, (pid // 50) % 250
    host_ip, ns_ip = f"10.{o2}.{o3}.1", f"10.{o2}.{o3}.2"
    for name, comment in (("host_key", "ct200"), ("ns_host_key", "gpu-b"), ("client_key", "client")):
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(root / name))
    # The login shell sshd runs every command with (root's: bash) sources ~/.bashrc even when not
    # interactive. The machine running the tests may have a heavy one (here: `pyenv init`, 0.18
    # CPU-s and as long in wall time per command, most of the deploy tests' CPU): the bed's key logs
    # in with a HOME of its own, empty, so a host command costs what it would on a plain host.
    home = root / "home"
    home.mkdir(exist_ok=True)
    (root / "authorized_keys").write_text(f'environment="HOME={home}" ' + (root / "client_key.pub").read_text())
    port = free_port()
    bed = SSHBed(root, port, ns, veth, ns_ip, root / "client_key", root / "known_hosts", root / "ssh_config",
                 [root / "sshd.pid", root / "ns_sshd.pid"])
    (root / "sshd_config").write_text(SSHD_CONFIG.format(port=port, addr="127.0.0.1", hostkey=root / "host_key",
                                                         pidfile=root / "sshd.pid", authkeys=root / "authorized_keys"))
    (root / "ns_sshd_config").write_text(SSHD_CONFIG.format(port=22, addr=ns_ip, hostkey=root / "ns_host_key",
                                                            pidfile=root / "ns_sshd.pid", authkeys=root / "authorized_keys"))
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", veth[:-1] + "b")
        sh("ip", "link", "set", veth[:-1] + "b", "netns", ns)
        sh("ip", "addr", "add", f"{host_ip}/24", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/24", "dev", veth[:-1] + "b")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", veth[:-1] + "b", "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh(SSHD, "-f", str(root / "sshd_config"), "-E", str(root / "sshd.log"))
        sh("ip", "netns", "exec", ns, SSHD, "-f", str(root / "ns_sshd_config"), "-E", str(root / "ns_sshd.log"))
    except subprocess.CalledProcessError as exc:
        bed.down()
        raise RuntimeError(f"ssh test bed failed: {exc.cmd}: {exc.stderr}") from None
    pub = lambda n: " ".join((root / f"{n}.pub").read_text().split()[:2])  # noqa: E731
    bed.known_hosts.write_text(f"[127.0.0.1]:{port} {pub('host_key')}\n{ns_ip} {pub('ns_host_key')}\n")
    bed.ssh_config.write_text(textwrap.dedent(f"""\
        Host ddt-bastion
          HostName 127.0.0.1
          Port {port}
        Host gpu-b
          HostName {ns_ip}
          ProxyJump ddt-bastion
        Host *
          User root
          IdentityFile {bed.client_key}
          IdentitiesOnly yes
          UserKnownHostsFile {bed.known_hosts}
          StrictHostKeyChecking yes
          BatchMode yes
          ConnectTimeout 5
        """))
    deadline = time.monotonic() + 10
    while not all(p.is_file() for p in bed.pids):
        if time.monotonic() > deadline:
            bed.down()
            raise RuntimeError("sshd did not start (see sshd.log)")
        time.sleep(0.05)
    return bed


# -- hosts ----------------------------------------------------------------------------------------
@dataclass
class TestHost:
    name: str
    root: Path
    port: int
    algorithm: str

    @property
    def site(self) -> Path:
        return self.root / "site"

    @property
    def sglang(self) -> Path:
        return self.root / "site" / "sglang"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"


FORKSERVER = SERVICE.with_name("forkserver.py")
FORKSERVER_SOCK: Path | None = None  # set by start_forkserver: hosts made after it start their service there


def start_forkserver(root: Path, site_cache: Path) -> subprocess.Popen:
    """The bed's fork server (tests/deploy/service/forkserver.py: why and how): its preload list
    is discovered once per site and interpreter (cached next to the site), then the server imports
    those modules and listens. Hosts made afterwards route their service starts to it."""
    import fcntl
    import sysconfig

    global FORKSERVER_SOCK
    purelib = Path(sysconfig.get_paths()["purelib"])
    key = hashlib.sha256(f"{site_cache.resolve()}|{sys.executable}|{purelib.stat().st_mtime_ns}|{sha256_file(FORKSERVER)}"
                         .encode()).hexdigest()[:16]
    preload = site_cache.with_name(f"{site_cache.name}.preload-{key}.json")
    with open(site_cache.with_name(site_cache.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not preload.is_file():
            sh(sys.executable, str(FORKSERVER), "discover", str(site_cache), str(preload),
               env=dict(os.environ, PYTHONPATH=str(site_cache)))
    sock = root / "forkserver.sock"
    if len(str(sock)) > 100:  # AF_UNIX path limit
        import tempfile

        sock = Path(tempfile.mkdtemp(prefix="ddt-fs")) / "fs.sock"
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
    p = serve_forkserver(sock, preload, root / "forkserver.log", env=env)
    FORKSERVER_SOCK = sock
    return p


def serve_forkserver(sock: Path, preload: Path, log: Path, env: dict | None = None,
                     timeout: float = 300) -> subprocess.Popen:
    """A fork server on `sock` with the modules of `preload` (a JSON list), logging to `log`;
    returns once it listens (the socket appears when it is ready)."""
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, str(FORKSERVER), "serve", str(sock), str(preload)], stdout=out,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not sock.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise RuntimeError(f"fork server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return p


def make_host(name: str, root: Path, site_cache: Path, algorithm: str) -> TestHost:
    """A host root: its own copy of the sglang install (hard links: files are only ever replaced,
    never written in place), a python wrapper that puts it first on sys.path, run/ and state/."""
    h = TestHost(name, root, free_port(), algorithm)
    (root / "bin").mkdir(parents=True)
    (root / "run").mkdir()
    sh("cp", "-al", str(site_cache), str(h.site))
    route = ""  # `python <the stub service> ...` starts through the bed's fork server when it runs
    if FORKSERVER_SOCK is not None:
        route = (f'if [ "$1" = "{SERVICE}" ] && [ -S "{FORKSERVER_SOCK}" ]; then\n'
                 f'  exec {sys.executable} -S -E {FORKSERVER} client "{FORKSERVER_SOCK}" "$@"\nfi\n')
    h.python.write_text(f'#!/bin/sh\nexport PYTHONPATH="{h.site}${{PYTHONPATH:+:$PYTHONPATH}}"\n{route}exec {sys.executable} "$@"\n')
    h.python.chmod(0o755)
    return h


LAUNCH_VAR = "SGLANG_SPEC_ARGS"


def service_argv(h: TestHost, launch: bool = False) -> list[str]:
    """The service's argv; `launch`: its speculative flags come from $SGLANG_SPEC_ARGS (the env
    file of [hosts.X.launch]) instead of a fixed --speculative-algorithm."""
    base = [str(h.python), str(SERVICE), "--host", "127.0.0.1", "--port", str(h.port)]
    return base if launch else [*base, "--speculative-algorithm", h.algorithm]


def setup_systemd(h: TestHost, unit: str = "sglang", env_file: Path | None = None) -> None:
    """A unit for the systemctl shim; with `env_file`, as a real unit would read the launch flags:
    `EnvironmentFile=-<env_file>` and `ExecStart=... $SGLANG_SPEC_ARGS` (split into words)."""
    for shim in ("systemctl", "sudo"):
        shutil.copyfile(SHIMS / shim, h.root / "bin" / shim)
        (h.root / "bin" / shim).chmod(0o755)
    (h.root / "units").mkdir()
    argv = " ".join(f"'{a}'" for a in service_argv(h, launch=env_file is not None))
    if env_file is None:
        (h.root / "units" / f"{unit}.sh").write_text(f"#!/bin/sh\nexport DDTREE_TEST_SERVICE_ENV=1\nexec {argv}\n")
    else:
        (h.root / "units" / f"{unit}.sh").write_text(
            f"#!/bin/sh\n# EnvironmentFile=-{env_file}\nexport DDTREE_TEST_SERVICE_ENV=1\nexec {argv} ${LAUNCH_VAR}\n")


def setup_supervisor(h: TestHost, netns: str | None, env_file: Path | None = None, autorestart: bool = False) -> Path:
    """supervisord (in `netns`) with the program `sglang`; with `env_file`, the wrapper the README
    shows: `sh -c 'set -a; [ -f ENV ] && . ENV; set +a; exec ... $SGLANG_SPEC_ARGS'`; `autorestart`:
    supervisord starts the program again whenever it exits (a service that dies at start then
    crash-loops, as under a production supervisor)."""
    conf = h.root / "supervisord.conf"
    run = h.root / "run"
    if env_file is None:
        command = " ".join(service_argv(h))
    else:
        argv = " ".join(service_argv(h, launch=True))
        command = f"/bin/sh -c 'set -a; [ -f {env_file} ] && . {env_file}; set +a; exec {argv} ${LAUNCH_VAR}'"
    conf.write_text(textwrap.dedent(f"""\
        [unix_http_server]
        file={run}/supervisor.sock
        [supervisord]
        pidfile={run}/supervisord.pid
        logfile={run}/supervisord.log
        [rpcinterface:supervisor]
        supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
        [supervisorctl]
        serverurl=unix://{run}/supervisor.sock
        [program:sglang]
        command={command}
        environment=DDTREE_TEST_SERVICE_ENV="1"
        autostart=false
        autorestart={str(autorestart).lower()}
        startsecs=0
        stopasgroup=true
        killasgroup=true
        stopwaitsecs=20
        redirect_stderr=true
        stdout_logfile={run}/service.log
        """))
    prefix = ["ip", "netns", "exec", netns] if netns else []
    sh(*prefix, str(Path(sys.executable).parent / "supervisord"), "-c", str(conf))
    deadline = time.monotonic() + 15
    while not (run / "supervisor.sock").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("supervisord did not start")
        time.sleep(0.1)
    return conf


def wait_healthy(h: TestHost, netns: str | None = None, timeout: float = 180) -> None:
    """Until the host's service answers /health (in `netns` when it runs there): a fixture that
    starts a service hands it to its tests up, whichever of them runs first (the service imports
    the real sglang: seconds, more on a loaded machine)."""
    probe = [sys.executable, "-c", "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)",
             f"http://127.0.0.1:{h.port}/health"]
    prefix = ["ip", "netns", "exec", netns] if netns else []
    deadline = time.monotonic() + timeout
    while subprocess.run([*prefix, *probe], capture_output=True, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{h.name}: the service did not answer /health within {timeout:.0f} s")
        time.sleep(0.5)


def reset_host(h: TestHost, build: BuildInfo, site_cache: Path) -> None:
    """Back to pristine without reinstalling: target files from the cached install (replaced, not
    written in place), added files removed, deploy state and lock gone."""
    for rel in build.files:
        src, dest = site_cache / "sglang" / rel, h.sglang / rel
        if src.is_file():
            tmp = dest.with_name(dest.name + ".reset")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
        elif dest.exists():
            dest.unlink()
    shutil.rmtree(h.state, ignore_errors=True)
