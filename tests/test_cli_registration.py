"""The command table (deploy/cli/app.py COMMANDS): a command line registers only the module of the
command it names, every command still answers, and the full table keeps `--help`'s order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLI = Path(sys.executable).parent / "ddtree-deploy"

PROBE = r"""
import importlib, json, sys
a = importlib.import_module('ddtree_deploy.deploy.cli.app')  # the package's `app` is the Typer object
a._register(a._command_in(sys.argv[1:]))
print(json.dumps({"modules": sorted(m for m in ("build_cmds", "bench_cmds", "remote_cmds")
                                    if f"ddtree_deploy.deploy.cli.{m}" in sys.modules),
                  "commands": [c.name for c in a.app.registered_commands],
                  "groups": [g.name for g in a.app.registered_groups]}))
"""


def probe(*argv: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_a_command_line_imports_only_its_commands_module():
    for argv, module in ((["push", "ct200", "--json"], "remote_cmds"), (["status", "x"], "remote_cmds"),
                         (["bench", "http://127.0.0.1:1"], "bench_cmds"), (["patch", "--pin", "0.5.16"], "build_cmds"),
                         (["snapshot", "verify"], "build_cmds")):
        got = probe(*argv)
        assert got["modules"] == [module], (argv, got)
        assert argv[0] in got["commands"] + got["groups"], (argv, got)


def test_help_and_unknown_words_register_the_whole_table_in_order():
    from ddtree_deploy.deploy.cli.app import COMMANDS, app

    top = [name for target, name, _, _ in COMMANDS if target is app]
    for argv in ([], ["--help"], ["nosuch"]):
        got = probe(*argv)
        assert got["modules"] == ["bench_cmds", "build_cmds", "remote_cmds"] and got["commands"] == top, (argv, got)
        assert got["groups"] == ["snapshot"]


def test_a_lone_registered_command_still_needs_its_name():
    """Typer runs an app's only command as the app itself unless it has a callback: `bench` (the one
    command of its module) must still be `ddtree-deploy bench ...`, and the others must answer."""
    env = dict(os.environ, COLUMNS="200")
    for argv, word in ((["bench", "--help"], "Benchmark live SGLang servers"), (["push", "--help"], "atomic swap"),
                       (["snapshot", "--help"], "verify"), (["--help"], "rollback")):
        r = subprocess.run([str(CLI), *argv], capture_output=True, text=True, timeout=120, env=env, check=False)
        assert r.returncode == 0 and word in r.stdout, (argv, r.stdout[-1500:], r.stderr[-1500:])
    r = subprocess.run([str(CLI), "nosuch"], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert r.returncode == 2 and "No such command 'nosuch'" in r.stderr
