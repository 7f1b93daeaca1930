"""The Python entry: `pipegen.generate(output_dir, **keys)` and `pipegen.run_generation(cfg)`.

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

if TYPE_CHECKING:
    from pipegen.observe.summary import RunSummary

GROUPS = ("llm", "cluster", "streams")  # config groups: {"llm": {"kind": "vllm", ...}} chooses llm=vllm


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


def _value(value: Any) -> str:
    """A Python value as Hydra's override grammar reads it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    plain = text and all(c.isalnum() or c in "/._-:@+~" for c in text) and not text[0].isdigit()
    return text if plain or _is_number(text) else "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def to_overrides(keys: Mapping[str, Any], prefix: str = "") -> list[str]:
    """`{"n": 4, "llm": {"kind": "vllm", "tp": 2}, "data.shuffle": True}` -> `["n=4", "llm=vllm", "llm.tp=2",
    "data.shuffle=true"]`. A dict value is a group of keys, except where verl's key holds a dict itself
    (e.g. data.apply_chat_template_kwargs): pass those as a dotted name with the dict as its value."""
    out: list[str] = []
    for name, value in keys.items():
        path = f"{prefix}{name}"
        if isinstance(value, Mapping) and not (prefix or "." in name) and path in GROUPS:
            value = dict(value)
            kind = value.pop("kind", None)
            if kind is not None:
                out.append(f"{path}={kind}")
            out += to_overrides(value, f"{path}.")
        elif isinstance(value, Mapping) and not any(path.endswith(k) for k in _DICT_KEYS):
            out += to_overrides(value, f"{path}.")
        else:
            out.append(f"{path}={_value(value)}")
    return out


_DICT_KEYS = ("apply_chat_template_kwargs", "mm_processor_kwargs", "engine_kwargs", "reward_kwargs")


def run_generation(cfg: Mapping[str, Any] | Any, *, quiet: bool = False) -> GenerationResult:
    """Run (or resume) the generation `cfg` describes: a mapping, an OmegaConf config or a list of
    `key=value` overrides with `output_dir` among them. Returns the run directory and its summary; raises
    GenerationError with the launcher's error line when it could not run."""
    if isinstance(cfg, (list, tuple)):
        overrides = [str(o) for o in cfg]
    else:
        if type(cfg).__module__.startswith("omegaconf"):
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_container(cfg, resolve=True)
        overrides = to_overrides(cfg)
    out = next((o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")), None)
    if out is None:
        raise ValueError("output_dir is missing: pipegen.generate('runs/NAME', ...) or run_generation({'output_dir': ...})")
    run_dir = Path(out.strip("'\"")).expanduser().resolve()
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
