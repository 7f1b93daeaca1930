"""`pipegen COMMAND [ARGS]`: the one installed command (`[project.scripts]` in pyproject.toml), in the style of
vLLM's `vllm/entrypoints/cli/main.py`: a table of subcommands, each run by the `main(argv)` of the module that
owns it, with the rest of the command line, so every subcommand parses its own arguments with its one parser.

    pipegen run output_dir=DIR [key=value ...]   is   python -m pipegen.launch output_dir=DIR [key=value ...]

Owns: the table below and the top-level --help. Must never: import a subcommand's module before it is named
(`pipegen --help` and `pipegen status` stay instant; `run` alone pays for Hydra), parse a subcommand's
arguments itself, or be needed by a run (the roles stay `python -m` modules: actor, writer, the CPU server).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Subcommand:
    module: str  # whose main(argv) runs it; `X` with no main of its own runs `X.__main__`'s
    help: str
    also: str  # the same command as a module
    fixed: tuple[str, ...] = ()  # arguments put before the user's (verify is status --verify)


COMMANDS: dict[str, Subcommand] = {
    "run": Subcommand("pipegen.launch.launcher", "generate trajectories into output_dir=DIR (resumes a run)",
                      "python -m pipegen.launch"),
    "status": Subcommand("pipegen.observe.run_status", "a snapshot of any run: progress, rates, liveness, failures",
                         "python -m pipegen.status"),
    "verify": Subcommand("pipegen.observe.run_status", "check a run directory: every unit exactly once (exit 1 if not)",
                         "python -m pipegen.status DIR --verify", ("--verify",)),
    "rescore": Subcommand("pipegen.rescore.rescore_run", "score a run's rows again with the current reward, generating "
                          "nothing (old scores kept beside the new)", "python -m pipegen.rescore"),
    "replay": Subcommand("pipegen.replay", "generate some of a finished run's units again and compare them bit for "
                         "bit (exit 0 only when identical)", "python -m pipegen.replay"),
    "export": Subcommand("pipegen.export", "a run's trajectories as Parquet or JSON lines",
                         "python -m pipegen.export"),
    "report": Subcommand("pipegen.report", "a run's report", "python -m pipegen.report"),
    "tasks": Subcommand("pipegen.tasks", "list the tasks tasks=[...] can name (and check your manifests)",
                        "python -m pipegen.tasks"),
    "bench": Subcommand("pipegen.bench", "measure every speed target side by side (writes BENCHMARKS.md)",
                        "python -m pipegen.bench"),
    "serve-reward": Subcommand("pipegen.rewards.serve", "serve a reward function over HTTP (reward.verifier_url)",
                               "python -m pipegen.rewards.serve"),
    "models": Subcommand("pipegen.inputs.models", "resolve model names to local folders (converting the embedded one)",
                         "python -m pipegen.inputs.models"),
}


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: pipegen COMMAND [ARGS ...]   (pipegen COMMAND --help: that command's own arguments)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {COMMANDS[name].help}   [{COMMANDS[name].also}]" for name in COMMANDS]
    lines += ["", "pipegen run output_dir=DIR is python -m pipegen.launch output_dir=DIR: the same keys, the same run."]
    return "\n".join(lines)


def entry(name: str) -> Callable[[list[str]], int]:
    """The named subcommand's main(argv), its module imported now."""
    module = importlib.import_module(COMMANDS[name].module)
    main = getattr(module, "main", None)
    if main is None:  # a package whose command is its __main__ (guarded by `if __name__ == "__main__"`)
        main = importlib.import_module(f"{COMMANDS[name].module}.__main__").main
    return main


def main(argv: list[str] | None = None) -> int:
    """`pipegen COMMAND ARGS...`: COMMAND's main with ARGS; the command list without one (exit 2) or with --help."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"pipegen: error: no command '{name}'; choose one of: {', '.join(COMMANDS)} "
              "(pipegen --help)", file=sys.stderr)
        return 2
    return int(entry(name)([*COMMANDS[name].fixed, *rest]) or 0)


if __name__ == "__main__":
    sys.exit(main())
