"""Output helpers shared by every command: human output to stderr (rich), --json to stdout."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

# Human output (tables, progress bars, messages) goes to stderr; stdout carries --json only.
console = Console(stderr=True, highlight=False)


# Set once a command has written its JSON document, so a failure raised afterwards does not add
# a second one (deploy.cli.main writes {"ok": false, ...} only for commands that wrote none).
json_written = False


def emit_json(payload: Any) -> None:
    """Write one JSON document to stdout (the only thing commands print to stdout)."""
    global json_written
    json_written = True
    sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def error(message: str) -> None:
    """One line, never wrapped, the message printed literally (it may hold `x[i]` or paths)."""
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def warn(message: str) -> None:
    console.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def ok(message: str) -> None:
    console.print(f"[green]✓[/] {message}")
