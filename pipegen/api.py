"""The Python entry: `pipegen.generate(output_dir, **keys)` and `pipegen.run_generation(cfg)` (seed 000's name: it
takes the seed's composed config, or a run's own saved conf/config.yaml).

For a notebook or a script that wants a run's data without a shell: the same keys as the command line
(pipegen's and verl's, nested dicts or dotted names), the same run directory, and back the directory and
its summary (observe/summary.py's RunSummary). The call runs `python -m pipegen.launch` as a child process: the
launcher owns every process of the run and its crash guarantees (a resumable run directory, nothing lost or
duplicated), and a failing or interrupted run cannot take the caller's interpreter, its signal handlers or
its CUDA context down with it. Calling again with the same keys resumes, as rerunning the command does.

Owns: turning keys into overrides, running the launcher, and the result or the launcher's one-line error.
Must never: import verl, torch or Hydra at import time (`import pipegen` stays instant), or run a role
of the run in the caller's process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Mapping

from pipegen.config.overrides import to_overrides

if TYPE_CHECKING:
    from pipegen.observe.summary import RunSummary



@dataclass
class GenerationResult:
    run_dir: Path
    summary: "RunSummary"


class GenerationError(RuntimeError):
    """The launcher stopped without a result: its one-line error (`pipegen: error: ...`) and the run directory."""

    def __init__(self, message: str, run_dir: Path, returncode: int):
        super().__init__(message)
        self.run_dir = run_dir
        self.returncode = returncode


def run_generation(cfg: Mapping[str, Any] | Any, *, quiet: bool = False) -> GenerationResult:
    """Run (or resume) the generation `cfg` describes: a mapping, a list of `key=value` overrides, or a composed
    OmegaConf config: seed 000's (`hydra.compose` of its generation.yaml: verl's ppo_trainer and its own keys) or
    a run's own saved conf/config.yaml (config/config_file.py's `overrides_of` keeps the keys that differ from
    their defaults). The run's folder: output_dir or trainer.default_local_dir, else verl's
    outputs/<project_name>/<experiment_name>. Returns the run directory and its summary; raises GenerationError
    with the launcher's error line when it could not run."""
    if isinstance(cfg, (list, tuple)):
        overrides = [str(o) for o in cfg]
    elif type(cfg).__module__.startswith("omegaconf"):
        from pipegen.config.config_file import overrides_of

        overrides = overrides_of(cfg)
    else:
        overrides = to_overrides(cfg)
    run_dir, overrides = _run_folder(overrides)
    returncode, tail = _launch(overrides, quiet)
    from pipegen.observe.summary import run_summary
    from pipegen.run.layout import RunDir

    if returncode in (0, 1) and (run_dir / "checkpoint.json").exists():  # 1: units failed, the rest is the result
        return GenerationResult(run_dir, run_summary(RunDir(run_dir)))
    if returncode == 130:
        raise KeyboardInterrupt
    error = next((line for line in reversed(tail) if line.startswith("pipegen: error:")),
                 tail[-1] if tail else f"the launcher exited with {returncode}")
    raise GenerationError(error.removeprefix("pipegen: error: "), run_dir, returncode)


def _run_folder(overrides: list[str]) -> tuple[Path, list[str]]:
    """The run's folder as the launch will name it, and the overrides with it spelt out once (a folder made of
    `${trainer.experiment_name}` or `${now:...}` is resolved here, so the caller and the launch name one folder)."""
    from pipegen.config.overrides import given, parse
    from pipegen.config.verl_keys import translate_with_notes

    try:
        text = given(translate_with_notes(overrides)[0], "output_dir") or ""
    except ValueError:
        text = ""  # refused: the launcher says why in its one line
    if "${" in text:
        from pipegen.config.compose import compose

        text = str(compose([o for o in overrides if (p := parse(o)) is not None and p.key.startswith("trainer.")]
                           + [f"output_dir={text}"]).output_dir)
        overrides = [o for o in overrides if (p := parse(o)) is None
                     or p.key not in ("output_dir", "trainer.default_local_dir")] + [f"output_dir={text}"]
    return Path(text.strip("'\"")).expanduser().resolve(), overrides


def generate(output_dir: str | os.PathLike[str], *, quiet: bool = False, **keys: Any) -> GenerationResult:
    """`pipegen.generate("runs/mine", train_files="data.parquet", n=4, llm={"kind": "vllm", "tp": 2})`: the
    command line's keys as arguments (dotted names through a dict: `**{"data.shuffle": True}`)."""
    return run_generation({"output_dir": os.fspath(output_dir), **keys}, quiet=quiet)


def _launch(overrides: list[str], quiet: bool) -> tuple[int, list[str]]:
    """Run the launcher; its output goes to this process's stdout/stderr (unless quiet), and its last stderr
    lines come back for the error."""
    child = subprocess.Popen([sys.executable, "-m", "pipegen.launch", *overrides], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    tail: deque[str] = deque(maxlen=50)
    copies = [threading.Thread(target=_copy, args=(child.stdout, None if quiet else sys.stdout, None), daemon=True),
              threading.Thread(target=_copy, args=(child.stderr, None if quiet else sys.stderr, tail), daemon=True)]
    for t in copies:
        t.start()
    try:
        returncode = child.wait()
    except BaseException:  # KeyboardInterrupt: the launcher stops every process of the run, resumable
        child.send_signal(signal.SIGINT)
        child.wait()
        raise
    for t in copies:
        t.join()
    return returncode, list(tail)


def _copy(source: IO[bytes], sink: IO[str] | None, tail: deque[str] | None) -> None:
    for raw in iter(source.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if sink is not None:
            sink.write(line)
            sink.flush()
        if tail is not None:
            tail.append(line.rstrip("\n"))
