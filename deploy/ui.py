"""Output helpers shared by every command: human output to stderr (rich), --json to stdout."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

# Human output (tables, progress bars, messages) goes to stderr; stdout carries --json only.
console = Console(stderr=True, highlight=False)


def emit_json(payload: Any) -> None:
    """Write one JSON document to stdout (the only thing commands print to stdout)."""
    sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def error(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")


def warn(message: str) -> None:
    console.print(f"[yellow]warning:[/] {message}")


def ok(message: str) -> None:
    console.print(f"[green]✓[/] {message}")
