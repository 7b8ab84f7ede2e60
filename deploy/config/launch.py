"""The service's launch flags as part of a release (`[hosts.<name>.launch]`).

The SGLang service reads its speculative flags from one variable of an environment file, e.g.
`/etc/sglang/ddtree.env`:

    # SGLANG_SPEC_ARGS: the speculative flags of the SGLang service, managed by ddtree-deploy
    # (push of a DDTREE build sets them; rollback restores the previous ones with the files).
    SGLANG_SPEC_ARGS="--speculative-algorithm DDTREE --speculative-ddtree-budget 63"

systemd: `EnvironmentFile=-/etc/sglang/ddtree.env` and `$SGLANG_SPEC_ARGS` (unbraced: split into
words) on the `ExecStart=` line. supervisord (no env files): a wrapper program,
`command=/bin/sh -c 'set -a; [ -f /etc/sglang/ddtree.env ] && . /etc/sglang/ddtree.env; set +a; exec /opt/sglang/venv/bin/python -m sglang.launch_server ... $SGLANG_SPEC_ARGS'`.
The value is validated so that systemd and `sh` read it identically (no quotes, `$` or spaces in a flag).

The env file is one more file of the release, keyed by its absolute path in `targets`, the release
record's `files`/`backup`/`pristine` and `current.json`: backed up before the swap (its bytes
before the first push are the pristine copy), uploaded, hashed, swapped atomically, restored by
`rollback` and by the automatic rollback in the same transition. Under a release's `files/` and
`backup/` and under `pristine/` an absolute path is stored as `@abs/<path>` (store_rel).

A push of a DDTREE build (its spec_info.py defines DDTREE) sets the variable to `ddtree_args` (when
the inventory gives none: `default_ddtree_args` of the build's pin: on 0.5.16 no budget flag, so the
server's default, budget auto at --tp-size 1; 63 on 0.5.13.post1) and keeps every other line of
the file; a build without DDTREE leaves the file as it is. The health
gate of a transition expects the algorithm that the env file it puts in place names
(`--speculative-algorithm X`, or NONE when there is none: SGLang then reports null), so a rollback
expects the previous flags' algorithm, and the automatic rollback after a failed push expects the
algorithm of the flags it restores. Each release record has a `launch` entry with both sides.

This module holds the pure rules (config layer: no host, no I/O); deploy.remote.envfile reads and
changes the host's file through the agent.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from dataclasses import dataclass, field

from ddtree_serving import DDTREE_AUTO, DDTREE_MAX_BUDGET  # the server-args rules both pins apply

DEFAULT_VARIABLE = "SGLANG_SPEC_ARGS"
# What a push of a DDTREE build sets when [hosts.<name>.launch] gives no ddtree_args
# (default_ddtree_args): on the pins that serve budget auto (DDTREE_AUTO_PINS) no budget flag, so the
# server takes its own default (auto at --tp-size 1, block size - 1 above, where auto is not built);
# b63 on the others.
DEFAULT_DDTREE_ARGS = "--speculative-algorithm DDTREE --speculative-ddtree-budget 63"
DEFAULT_DDTREE_ARGS_AUTO_PINS = "--speculative-algorithm DDTREE"
NO_ALGORITHM = "NONE"  # what the health gate expects when the flags name no algorithm
ABS_PREFIX = "@abs"  # absolute target paths under files/, backup/ and pristine/
SPEC_INFO = "srt/speculative/spec_info.py"
DDTREE_INT_FLAGS = {"--speculative-ddtree-budget": (1, DDTREE_MAX_BUDGET), "--speculative-ddtree-topk-cap": (1, None)}
DDTREE_BOOL_FLAGS = ("--speculative-ddtree-allow-hybrid-unsafe", "--speculative-ddtree-debug-metrics")
# characters that systemd's EnvironmentFile= / `$VAR` and sh's `.` / `$VAR` read the same way
_SAFE_TOKEN = re.compile(r"^[A-Za-z0-9_./:,=+@%-]+$")
_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MARKER = ("# {variable}: the speculative flags of the SGLang service, managed by ddtree-deploy\n"
          "# (push of a DDTREE build sets them; rollback restores the previous ones with the files).")


def store_rel(rel: str) -> str:
    """A target's path under a release's files/ or backup/ (and under pristine/): package files as
    they are, an absolute path (the env file) as `@abs/<path>` so it cannot collide with them."""
    return ABS_PREFIX + rel if rel.startswith("/") else rel


# -- validation (inventory) -----------------------------------------------------------------------
def validate_variable(name: str) -> str:
    if not _VARIABLE.match(name):
        raise ValueError(f"must be a shell/systemd variable name (letters, digits, _), got {name!r}")
    return name


def validate_env_file(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError(f"must be an absolute path on the host, got {path!r}")
    if path.endswith("/") or any(part in ("", ".", "..") for part in path[1:].split("/")):
        raise ValueError(f"must be a normalized file path (no //, . or ..), got {path!r}")
    if re.search(r"[\s\x00-\x1f]", path):
        raise ValueError(f"must not contain whitespace or control characters, got {path!r}")
    return path


def validate_ddtree_args(args: str) -> str:
    """The flags a DDTREE build turns on; one-line error (ValueError) for what SGLang would refuse at
    start (after the swap and restart) or what the env file cannot carry. Returns them normalized."""
    toks = args.split()
    if not toks:
        raise ValueError("is empty; give at least `--speculative-algorithm DDTREE`")
    for tok in toks:
        if not _SAFE_TOKEN.match(tok):
            raise ValueError(f"{tok!r} has characters the env file cannot carry safely "
                             "(allowed: letters, digits and _ . / : , = + @ % -)")
    if not toks[0].startswith("--"):
        raise ValueError(f"must start with a flag (--...), got {toks[0]!r}")
    flags: dict[str, str | None] = {}
    last = None
    for tok in toks:
        if tok.startswith("--"):
            name, eq, value = tok.partition("=")
            if name in flags:
                raise ValueError(f"gives {name} twice")
            flags[name] = value if eq else None
            last = None if eq else name
        elif last is None:
            raise ValueError(f"{tok!r} is not a flag and follows no flag that takes a value")
        else:
            flags[last] = tok
            last = None
    algo = flags.get("--speculative-algorithm")
    if "--speculative-algorithm" not in flags or algo is None:
        raise ValueError("must turn DDTREE on: `--speculative-algorithm DDTREE`")
    if algo.upper() != "DDTREE":
        raise ValueError(f"must say `--speculative-algorithm DDTREE`, got {algo!r} "
                         "(the other states' flags are the ones captured on the host)")
    known = sorted([*DDTREE_INT_FLAGS, *DDTREE_BOOL_FLAGS])
    for name, value in flags.items():
        if name.startswith("--speculative-ddtree-") and name not in known:
            raise ValueError(f"unknown DDTREE flag {name} (known: {', '.join(known)})")
        if name in DDTREE_BOOL_FLAGS and value is not None:
            raise ValueError(f"{name} takes no value, got {value!r}")
        if name == "--speculative-ddtree-budget" and value is not None and value.lower() == DDTREE_AUTO:
            continue  # served by the pins of DDTREE_AUTO_PINS; a push checks the build's pin
        if name in DDTREE_INT_FLAGS:
            lo, hi = DDTREE_INT_FLAGS[name]
            if value is None or not re.fullmatch(r"\d+", value) or int(value) < lo or (hi is not None and int(value) > hi):
                rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
                raise ValueError(f"{name} needs an integer {rng}, got {value!r}")
    budget, width = flags.get("--speculative-ddtree-budget"), flags.get("--speculative-num-draft-tokens")
    if budget is not None and budget.lower() == DDTREE_AUTO and width is not None:
        raise ValueError("--speculative-ddtree-budget auto chooses the verify width per round; "
                         f"drop --speculative-num-draft-tokens (got {width!r})")
    if budget is not None and width is not None and (not width.isdigit() or int(width) != int(budget) + 1):
        raise ValueError(f"--speculative-num-draft-tokens is the DDTREE verify width and must be "
                         f"--speculative-ddtree-budget + 1 = {int(budget) + 1}, got {width!r}")
    return " ".join(toks)


# SGLang pins whose DDTREE worker serves `--speculative-ddtree-budget auto` (the others refuse it at
# start: docs/DDTREE.md, "--speculative-ddtree-budget auto").
DDTREE_AUTO_PINS = ("0.5.16",)


def default_ddtree_args(sglang_version: str) -> str:
    """The DDTREE flags a push of a `sglang_version` build sets when the inventory names none: where
    the pin serves budget auto, no budget flag (the server's default: auto, which picks the verify
    width per round and plain decode where trees do not pay, at --tp-size 1; block size - 1 at
    --tp-size > 1, which the tool cannot see from here), budget 63 elsewhere."""
    return DEFAULT_DDTREE_ARGS_AUTO_PINS if sglang_version in DDTREE_AUTO_PINS else DEFAULT_DDTREE_ARGS


def auto_budget_refusal(args: str | None, sglang_version: str) -> str | None:
    """Why a build of `sglang_version` cannot start with the DDTREE flags `args` (budget auto on a pin
    that does not serve it), or None."""
    budget = None
    toks = (args or "").split()
    for i, tok in enumerate(toks):
        name, eq, value = tok.partition("=")
        if name == "--speculative-ddtree-budget":
            budget = value if eq else (toks[i + 1] if i + 1 < len(toks) else None)
    if budget is None or budget.lower() != DDTREE_AUTO or sglang_version in DDTREE_AUTO_PINS:
        return None
    return (f"--speculative-ddtree-budget auto is served on SGLang {', '.join(DDTREE_AUTO_PINS)} only; "
            f"this build is for {sglang_version} (give a budget 1..1023)")


# -- the env file ------------------------------------------------------------------------------------
def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        inner = value[1:-1]
        return re.sub(r"\\(.)", r"\1", inner) if value[0] == '"' else inner
    return value


def _logical_lines(text: str) -> list[str]:
    out: list[str] = []
    buf = ""
    for line in text.splitlines():
        if line.endswith("\\") and not line.lstrip().startswith(("#", ";")):
            buf += line[:-1]
            continue
        out.append(buf + line)
        buf = ""
    if buf:
        out.append(buf)
    return out


def parse_env(data: bytes | None) -> dict[str, str]:
    """KEY=VALUE assignments of an env file, as systemd's EnvironmentFile= reads the common subset
    (comments #/;, blank lines, "double" / 'single' quotes, backslash continuations). Later wins."""
    if data is None:
        return {}
    out: dict[str, str] = {}
    for line in _logical_lines(data.decode("utf-8", "replace")):
        s = line.strip()
        if not s or s[0] in "#;" or "=" not in s:
            continue
        key, _, value = s.partition("=")
        key = key.strip().removeprefix("export ").strip()
        out[key] = _unquote(value)
    return out


def algorithm_of(args: str | None) -> str:
    """The --speculative-algorithm of a flag string (the last one wins, as with argparse), upper
    case; NONE when there is none (no speculative decoding: SGLang reports null)."""
    algo = None
    toks = (args or "").split()
    for i, tok in enumerate(toks):
        if tok == "--speculative-algorithm" and i + 1 < len(toks):
            algo = toks[i + 1]
        elif tok.startswith("--speculative-algorithm="):
            algo = tok.split("=", 1)[1]
    return (algo or NO_ALGORITHM).upper()


def flags_of(args: str | None) -> dict[str, str | bool]:
    """`--name value` / `--name=value` / `--name` (True) of a flag string, keyed as SGLang's server
    args are (`--speculative-ddtree-budget` -> `speculative_ddtree_budget`); the last one wins."""
    out: dict[str, str | bool] = {}
    toks = (args or "").split()
    i = 0
    while i < len(toks):
        tok = toks[i]
        if tok.startswith("--"):
            name, eq, value = tok[2:].partition("=")
            key = name.replace("-", "_")
            if eq:
                out[key] = value
            elif i + 1 < len(toks) and not toks[i + 1].startswith("--"):
                out[key], i = toks[i + 1], i + 1
            else:
                out[key] = True
        i += 1
    return out


def _norm(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return "none" if v is None else str(v).lower()


def restart_pending(args: str | None, server_info: dict) -> list[str]:
    """The flags of `args` (the env file's, as the service reads them at its next start) that the
    running service does not run with, by its /get_server_info (which reports every server arg):
    e.g. `speculative_ddtree_budget: the service runs 63, the env file says 31`. Empty: nothing
    pending. A flag the service does not report is not compared (it cannot be known)."""
    out = []
    running = server_info.get("speculative_algorithm")
    want = algorithm_of(args)
    if _norm(running or NO_ALGORITHM) != want.lower():
        out.append(f"speculative_algorithm: the service runs {running or NO_ALGORITHM}, the env file says {want}")
    for key, value in flags_of(args).items():
        if key == "speculative_algorithm" or key not in server_info:
            continue
        if _norm(server_info[key]) != _norm(value):
            out.append(f"{key}: the service runs {server_info[key]}, the env file says {value}")
    return out


def _assigns(line: str, variable: str) -> bool:
    return re.match(rf"^\s*(export\s+)?{re.escape(variable)}\s*=", line) is not None


def render_env(current: bytes | None, variable: str, args: str) -> bytes:
    """`current` with `variable` set to `args` (its first assignment replaced in place, later ones
    dropped, the marker comment above it), every other line kept; idempotent."""
    try:
        text = "" if current is None else current.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the env file is not UTF-8 text; refusing to rewrite it") from None
    marker = MARKER.format(variable=variable).splitlines()
    lines = [ln for ln in text.splitlines() if ln not in marker]
    assignment = f'{variable}="{args}"'
    out: list[str] = []
    placed = False
    for ln in lines:
        if not _assigns(ln, variable):
            out.append(ln)
            continue
        value = ln.split("=", 1)[1].strip()
        if ln.endswith("\\") or (value[:1] in "\"'" and (len(value) < 2 or value[-1] != value[0])):
            raise ValueError(f"{variable} spans several lines in the env file; make it one line to let the tool manage it")
        if not placed:
            out += [*marker, assignment]
            placed = True
    if not placed:
        out += [*marker, assignment]
    return ("\n".join(out) + "\n").encode()


def sha256_of(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


# -- one transition's change of the env file ----------------------------------------------------------
@dataclass
class EnvChange:
    """The env file before (on the host now) and after the transition."""

    path: str
    variable: str
    before: bytes | None
    after: bytes | None
    drifted: bool = False  # the host's file differs from what the current state's record says
    pristine_sha256: str | None = None
    _local: list = field(default_factory=list, repr=False)  # temp dir of the upload

    @property
    def before_sha256(self) -> str | None:
        return sha256_of(self.before)

    @property
    def after_sha256(self) -> str | None:
        return sha256_of(self.after)

    @property
    def unchanged(self) -> bool:
        return self.before == self.after

    @property
    def before_args(self) -> str | None:
        return parse_env(self.before).get(self.variable)

    @property
    def after_args(self) -> str | None:
        return parse_env(self.after).get(self.variable)

    @property
    def expect_before(self) -> str:
        return algorithm_of(self.before_args)

    @property
    def expect_after(self) -> str:
        return algorithm_of(self.after_args)

    def record(self) -> dict:
        """The release record's `launch` entry: both sides of the transition."""
        return {"env_file": self.path, "variable": self.variable,
                "args": self.after_args, "expect_algorithm": self.expect_after, "sha256": self.after_sha256,
                "previous_args": self.before_args, "previous_expect_algorithm": self.expect_before,
                "previous_sha256": self.before_sha256}

    def to_json(self) -> dict:
        return dict(self.record(), changed=not self.unchanged, drifted=self.drifted)

    def summary(self) -> str:
        if self.unchanged:
            return (f"launch flags unchanged: {self.path} {self.variable}={self.after_args or '(unset)'} "
                    f"(health expects {self.expect_after})")
        return (f"launch flags: {self.path} {self.variable}: {self.before_args or '(unset)'} -> "
                f"{self.after_args or '(unset)'}" + ("" if self.after is not None else " (file removed)")
                + f"; health expects {self.expect_after} (after an automatic rollback: {self.expect_before})")

    def diff(self) -> str:
        old = (self.before or b"").decode("utf-8", "replace").splitlines(True)
        new = (self.after or b"").decode("utf-8", "replace").splitlines(True)
        a = f"a{self.path}" if self.before is not None else "/dev/null"
        b = f"b{self.path}" if self.after is not None else "/dev/null"
        return "".join(difflib.unified_diff(old, new, a, b))

    def local_file(self):
        """The rendered file on this machine, for the upload (removed by cleanup())."""
        import tempfile
        from pathlib import Path

        d = tempfile.TemporaryDirectory(prefix="ddtree-launch-")
        self._local.append(d)
        p = Path(d.name) / "env"
        p.write_bytes(self.after or b"")
        return p

    def cleanup(self) -> None:
        while self._local:
            self._local.pop().cleanup()

    # push: the env file joins the release
    def add_to_push(self, record: dict, targets: dict, uploads: dict, release_dir: str) -> None:
        if self.after is None:  # a build without DDTREE on a host without the file: keep it absent
            targets[self.path] = {"src": None, "sha256": None}
        else:
            targets[self.path] = {"src": f"{release_dir}/files/{store_rel(self.path)}", "sha256": self.after_sha256}
            uploads[self.path] = self.local_file()
        record["files"][self.path] = self.after_sha256
        record["pristine"][self.path] = self.pristine_sha256
        record["launch"] = self.record()


def unchanged(change: EnvChange | None) -> bool:
    return change is None or change.unchanged
