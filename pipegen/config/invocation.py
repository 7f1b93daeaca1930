"""The command the user typed, for every message that names one: `pipegen status DIR` after the installed
`pipegen` command, `python -m pipegen.status DIR` after `python -m`.

How it is told: this process's `sys.argv[0]` (the installed script is named `pipegen`; `python -m pipegen` runs
`pipegen/__main__.py`), or `PIPEGEN_COMMAND`, which the launcher sets for its children so that a role started as
`python -m pipegen.writer` still names the command the user typed.

Owns: that choice and each subcommand's module form. Must never: import anything of pipegen (config/ is the
ground floor).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

COMMAND_ENV = "PIPEGEN_COMMAND"  # "pipegen", "python -m pipegen" or "python -m" (each module by its own name)
# each subcommand as a module, as pipegen/command.py's table runs it
MODULES = {"run": "pipegen.launch", "status": "pipegen.status", "verify": "pipegen.status --verify",
           "report": "pipegen.report", "export": "pipegen.export", "tasks": "pipegen.tasks",
           "serve-reward": "pipegen.rewards.serve", "rescore": "pipegen.rescore", "replay": "pipegen.replay"}


def typed() -> str:
    """How pipegen was started: "pipegen", "python -m pipegen", or "python -m" (a module of its own)."""
    named = os.environ.get(COMMAND_ENV)
    if named in ("pipegen", "python -m pipegen", "python -m"):
        return named
    script = Path(sys.argv[0] if sys.argv and sys.argv[0] else "")
    if script.name == "pipegen":
        return "pipegen"
    if script.name == "__main__.py" and script.parent.name == "pipegen":
        return "python -m pipegen"
    return "python -m"


def command(sub: str) -> str:
    """The subcommand `sub` ("status", "run", ...) as the user starts it: `pipegen status`, `python -m pipegen
    status` or `python -m pipegen.status`."""
    how = typed()
    if how != "python -m":
        return f"{how} {sub}"
    module, _, flag = MODULES[sub].partition(" ")
    return f"python -m {module}" + (f" {flag}" if flag else "")


def remember() -> None:
    """Hand the command on to this process's children (the launcher calls it before it starts any)."""
    os.environ[COMMAND_ENV] = typed()
