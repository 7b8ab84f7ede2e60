"""Errors with documented exit codes. The CLI maps each to its code; nothing else calls sys.exit.

Exit codes (also in README.md):
  0  success
  1  a quality gate failed, or a deploy failed (and was rolled back), or a health check failed
  2  usage or configuration error: bad inventory, bad series file, missing file, bad argument
  3  a patch does not apply with zero fuzz (the message names patch, file and hunk)
  4  snapshot integrity: a snapshot file differs from its manifest
  5  remote unreachable: connection, authentication or host-key verification failed
  6  remote refused the deploy: version mismatch, drifted files without --force, lock held,
     not enough disk
  7  automatic rollback failed: the host needs attention (the report says what is where)
  8  a transition was left unfinished on the host (connection lost and not regained): its journal
     records the step; the next push/status/rollback/plan on that host finishes it
  130/143  push/rollback stopped by SIGINT/SIGTERM (the host was put back; 7 or 8 win if worse)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PATCH = 3
EXIT_SNAPSHOT = 4
EXIT_UNREACHABLE = 5
EXIT_REFUSED = 6
EXIT_ROLLBACK_FAILED = 7
EXIT_UNFINISHED = 8
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class DDTreeDeployError(Exception):
    """Base class: a clear one-line message and the exit code the CLI returns."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, detail: str | None = None):
        super().__init__(message)
        self.message = message
        self.detail = detail


class UsageError(DDTreeDeployError):
    exit_code = EXIT_USAGE


class ConfigError(DDTreeDeployError):
    exit_code = EXIT_USAGE


class PatchApplyError(DDTreeDeployError):
    exit_code = EXIT_PATCH


class SnapshotError(DDTreeDeployError):
    exit_code = EXIT_SNAPSHOT


class GateFailed(DDTreeDeployError):
    exit_code = EXIT_FAILED


class RemoteUnreachable(DDTreeDeployError):
    exit_code = EXIT_UNREACHABLE


class RemoteRefused(DDTreeDeployError):
    exit_code = EXIT_REFUSED


class DeployFailed(DDTreeDeployError):
    exit_code = EXIT_FAILED


class RollbackFailed(DDTreeDeployError):
    exit_code = EXIT_ROLLBACK_FAILED


class Unfinished(DDTreeDeployError):
    exit_code = EXIT_UNFINISHED


def host_once(message: str, host: str) -> str:
    """`message` with each `<host>: ` prefix said once where errors were wrapped in errors
    (`h1: h1: x` -> `h1: x`, anywhere in the message)."""
    import re

    return re.sub(rf"(?<![\w.-])({re.escape(host)}: )(?:{re.escape(host)}: )+", r"\1", message)


def without_host(message: str, host: str) -> str:
    """`message` without its leading `<host>: ` (where the host is named beside it: a table row)."""
    return host_once(message, host).removeprefix(f"{host}: ")
