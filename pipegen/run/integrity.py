"""Reading a run directory's small files without trusting them: damage becomes one typed error.

A run directory outlives the processes that wrote it: it is copied between filesystems, restored from
backups, opened in editors. Every small file of the contract (`checkpoint.json`, `conf/*.json`,
`conf/config.yaml`) is read through `read_json_file` / `read_yaml_file` here, which turn every way a
file can go bad (truncated, empty, zero-filled, garbage, the wrong shape) into a `DamagedFile` that
carries the path, what is wrong, what is still intact and the command that recovers it. Each process's
main prints it as one line; nothing reads on from a damaged file.

`set_aside` is the only way pipegen retires a damaged or replaced file: it is renamed beside the new
one, never deleted.

Owns: the damage diagnosis, the `DamagedFile` error, the set-aside names.
Must never: repair a file itself (each file's owner decides how it is re-derived), delete anything,
or import verl or torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import orjson

ASIDE_MARK = ".damaged-"  # `checkpoint.json.damaged-20260101T000000`: not matched by any glob pipegen reads


class DamagedFile(ValueError):
    """A run-directory file that cannot be what it should be. `str()` is the one line a user sees."""

    def __init__(self, path: Path, problem: str, intact: str = "", fix: str = ""):
        self.path, self.problem, self.intact, self.fix = Path(path), problem, intact, fix
        parts = [f"{self.path} is damaged ({problem})"]
        if intact:
            parts.append(f"intact: {intact}")
        if fix:
            parts.append(f"fix: {fix}")
        super().__init__("; ".join(parts))

    def with_advice(self, intact: str, fix: str) -> "DamagedFile":
        """The same damage, with the file owner's account of what is intact and how to recover."""
        return DamagedFile(self.path, self.problem, intact, fix)


def diagnose(data: bytes) -> str | None:
    """Why bytes that should be a text file are not, when it shows without parsing (else None)."""
    if not data:
        return "empty"
    if not data.strip(b"\0"):
        return f"zero-filled, {len(data)} bytes"
    if b"\0" in data:
        return "holds NUL bytes: overwritten or a bad block"
    return None


def read_text_bytes(path: Path, missing_ok: bool = False) -> bytes | None:
    """A text file's bytes; None for a missing one when missing_ok; a DamagedFile when it is missing
    otherwise, or when its bytes cannot be text (diagnose)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise DamagedFile(path, "missing") from None
    except IsADirectoryError:
        raise DamagedFile(path, "a directory, not a file") from None
    problem = diagnose(data)
    if problem:
        raise DamagedFile(path, problem)
    return data


def read_json_file(path: Path, validate: Callable[[Any], Any] | None = None, what: str = "JSON",
                   missing_ok: bool = False) -> Any:
    """The parsed JSON of path (None when missing and missing_ok), through validate when given;
    any decode or validation error becomes a DamagedFile naming the path."""
    data = read_text_bytes(path, missing_ok)
    if data is None:
        return None
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise DamagedFile(path, f"not valid JSON, {len(data)} bytes, truncated or overwritten: {e}") from None
    return _validated(path, value, validate, what)


def read_yaml_file(path: Path, end_marker: str, validate: Callable[[Any], Any] | None = None,
                   what: str = "YAML", missing_ok: bool = False) -> Any:
    """The OmegaConf object of a YAML file whose last line must be `end_marker` (so a truncated file,
    which often still parses, is told apart from a whole one)."""
    from omegaconf import OmegaConf

    data = read_text_bytes(path, missing_ok)
    if data is None:
        return None
    if data.rstrip().splitlines()[-1:] != [end_marker.encode()]:
        raise DamagedFile(path, f"does not end with its end line {end_marker!r}: truncated or overwritten")
    try:
        value = OmegaConf.create(data.decode())
    except Exception as e:  # yaml's and OmegaConf's errors share no base class
        raise DamagedFile(path, f"not valid YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return _validated(path, value, validate, what)


def _validated(path: Path, value: Any, validate: Callable[[Any], Any] | None, what: str) -> Any:
    if validate is None:
        return value
    try:
        return validate(value)
    except DamagedFile:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise DamagedFile(path, f"not a {what}: {type(e).__name__}: {e}") from None
    except Exception as e:  # OmegaConf's errors on a config missing a key
        raise DamagedFile(path, f"not a {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") \
            from None


def rebuild_command(root: Path) -> str:
    """The command that re-derives the writer's state (checkpoint.json) from the batch files and shards."""
    return f"python -m pipegen.writer output_dir={root} --rebuild"


def relaunch_advice(root: Path) -> str:
    """How a file the launcher writes is restored: the launch command of the run, run again."""
    return (f"rerun the command that launched this run (python -m pipegen.launch output_dir={root} ...): "
            "it writes this file again")


def aside_path(path: Path) -> Path:
    """Where set_aside puts path: beside it, stamped with the time, never over an earlier one."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    candidate = path.with_name(f"{path.name}{ASIDE_MARK}{stamp}")
    k = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}{ASIDE_MARK}{stamp}-{k}")
        k += 1
    return candidate


def set_aside(path: Path) -> Path:
    """Rename path beside itself (aside_path) and return the new name; the data stays on disk."""
    target = aside_path(path)
    os.replace(path, target)
    return target


def set_aside_files(directory: Path) -> list[Path]:
    """Every file set aside under directory (they are the user's to inspect and delete)."""
    return sorted(p for p in Path(directory).rglob(f"*{ASIDE_MARK}*") if p.is_file())
