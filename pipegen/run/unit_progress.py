"""Progress inside a sample on disk: a unit's model calls and the tokens of its unfinished answer, kept while the
unit runs so that a crash costs at most one chunk of an answer per unit in flight.

One file per unit that holds progress, `streams/progress/<index>-<sample>.jsonl` (layout.py names the folder),
one line per piece of an answer:

    {"call": c, "digest": "...", "ids": [...], "logprobs": [...] | null, "end": null | "stop" | "length" | ...,
     "at": k | null}

`call` counts the unit's model calls from 0; `digest` names the call's request (`request_digest`: the prompt ids,
sampling params, seed and pictures), so a rerun can tell whether it asks the same thing; a call's answer is its
lines' `ids` (and `logprobs`) in order, each line placed at answer token `at` (what an earlier line held from there
on is superseded: a streamed request re-sent after a failure writes its answer again from where it started; null:
after what came before); the call is complete when its last line has an `end` (the engine's finish reason). Only
the unit's last call may be incomplete.

When a line is written (actor/continuation.py decides): the new tokens of a long answer each time a streaming engine
sends its answer so far, a chunk of a long answer that goes on (an engine that does not stream), and a complete
call once the unit makes its next call. A unit that makes one call and answers it in one chunk writes nothing (its shard line is
its record), so a run of short single-turn answers costs what it cost without this file.

Durability: each line is one `write()` on an O_APPEND file (a line holds a streamed piece, a chunk, `actors.progress_chunk_tokens`
tokens, or a whole model call), so a SIGKILL or any other crash of the process loses nothing written. The lines
are never fsync'd: an fsync per chunk cost the e2e bench's actor a third of its rate at 1k-token answers on a
2-core box, and one on a timer over every open file more, for files that are unlinked within minutes. A machine
crash may lose what the kernel had not yet written back (seconds): those units generate that part again. A torn or
zeroed tail is where the reader stops (`parse_calls`), so a lost line never becomes a wrong token.
The file is unlinked once the unit's line is in its shard (the actor), and any left over for a unit the
checkpoint committed or a shard holds is unlinked at the next actor start (`tidy`).

Owns: the file's lines, reading them back, the request digest, listing the units that hold progress.
Must never: import a role, verl or torch; keep a unit's file after its line is in a shard (beyond a crash
between the two, which `tidy` repairs).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import orjson

from pipegen.run.atomic import atomic_write

SUFFIX = ".jsonl"


def progress_file_name(index: int, sample: int) -> str:
    return f"{index}-{sample}{SUFFIX}"


def unit_of(path: Path) -> tuple[int, int] | None:
    """(index, sample) of a progress file's name; None for a name this module did not write."""
    if not path.name.endswith(SUFFIX):
        return None
    index, _, sample = path.name[: -len(SUFFIX)].partition("-")
    try:
        return int(index), int(sample)
    except ValueError:
        return None


def request_digest(prompt_ids: list[int], sampling_params: dict[str, Any], seed: int | None,
                   image_data: list[Any] | None = None) -> str:
    """What a model call asks, as 32 hex digits: equal digests, equal requests. (The ids go to orjson as they are:
    a per-id int() would cost most of the ~10 us this takes at 1k tokens.)"""
    digest = hashlib.blake2b(orjson.dumps(prompt_ids, option=orjson.OPT_SERIALIZE_NUMPY), digest_size=16)
    digest.update(orjson.dumps([sampling_params, seed, image_data or []], option=orjson.OPT_SORT_KEYS, default=str))
    return digest.hexdigest()


@dataclass
class RecordedCall:
    """One model call as recorded: its request digest, the answer so far, and its finish (None: unfinished)."""

    digest: str
    ids: list[int]
    logprobs: list[float] | None
    end: str | None
    at: int | None = None  # a written piece's place in its answer (what came after it before is superseded)


def read_progress(path: Path) -> bytes | None:
    """The file's bytes; None without a file (os.open: for nearly every unit one failed open(), not Path's ~7 us)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with open(fd, "rb") as f:
        return f.read()


def read_calls(path: Path) -> list[RecordedCall]:
    """A unit's recorded calls in order ([] without a file)."""
    return parse_calls(read_progress(path) or b"")


def parse_calls(data: bytes) -> list[RecordedCall]:
    """A file's recorded calls in order. Stops at the first line that does not follow on (a torn write, a call out
    of order, a piece after a complete call): what comes after it is not trusted."""
    calls: list[RecordedCall] = []
    for raw in data.split(b"\n")[:-1]:  # the part after the last newline is a torn write, never a line
        try:
            line = orjson.loads(raw)
            call, digest, ids = int(line["call"]), str(line["digest"]), list(map(int, line["ids"]))
            logprobs, end, at = line.get("logprobs"), line.get("end"), line.get("at")
            logprobs = None if logprobs is None else list(map(float, logprobs))  # ints and floats, as the engine's
            at = None if at is None else int(at)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            break
        if logprobs is not None and len(logprobs) != len(ids):
            break
        if call == len(calls) - 1 and calls[-1].end is None and calls[-1].digest == digest \
                and (calls[-1].logprobs is None) == (logprobs is None) \
                and (at is None or 0 <= at <= len(calls[-1].ids)):
            last = calls[-1]  # the next piece of the unfinished call, from its place in the answer
            if at is not None:
                del last.ids[at:]
                if last.logprobs is not None:
                    del last.logprobs[at:]
            last.ids += ids
            if logprobs is not None:
                last.logprobs += logprobs
            last.end = end
        elif call == len(calls) and (not calls or calls[-1].end is not None) and not at:
            calls.append(RecordedCall(digest, ids, logprobs, end))
        else:
            break
    return calls


def _line(call: int, piece: RecordedCall) -> bytes:
    return orjson.dumps({"call": call, "digest": piece.digest, "ids": piece.ids, "logprobs": piece.logprobs,
                         "end": piece.end, "at": piece.at}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"


class ProgressFile:
    """One unit's progress file, opened on its first line (a unit that writes none creates no file).
    `exists`: whether the file may be on disk (its owner read one back, or wrote one): a unit that never had one
    makes no unlink() when it ends."""

    def __init__(self, path: Path, exists: bool):
        self.path = path
        self.exists = exists
        self._fd: int | None = None

    def append(self, call: int, piece: RecordedCall) -> None:
        """One line in one write(): a SIGKILL after it loses nothing of it (no fsync: see the module docstring)."""
        if self._fd is None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
            try:
                self._fd = os.open(self.path, flags, 0o644)
            except FileNotFoundError:  # the run's first file: its folder too (not a mkdir() a unit)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, flags, 0o644)
            self.exists = True
        os.write(self._fd, _line(call, piece))

    def keep_only(self, calls: list[RecordedCall]) -> None:
        """Replace the file by these complete calls (the record after the first call a rerun asks differently
        no longer describes this run), crash-safely; no file when there are none."""
        self.close()
        if not calls:
            self.discard()
            return
        body = b"".join(_line(c, call) for c, call in enumerate(calls))
        atomic_write(self.path, lambda f: f.write(body))
        self.exists = True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        """The unit's line is in its shard: its progress is no longer needed."""
        self.close()
        if not self.exists:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self.exists = False


def progress_files(folder: Path) -> dict[tuple[int, int], Path]:
    """Every unit that holds progress: {(index, sample): its file}."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return {}
    found = {}
    for entry in entries:
        unit = unit_of(Path(entry.path))
        if unit is not None:
            found[unit] = Path(entry.path)
    return found


def progress_summary(folder: Path) -> tuple[int, int]:
    """(units holding progress, tokens they hold), for `status`."""
    files = progress_files(folder)
    return len(files), sum(len(c.ids) for path in files.values() for c in read_calls(path))


def tidy(folder: Path, is_done: Callable[[int, int], bool]) -> int:
    """Unlink the progress of units that are done (committed, or in a shard line): left by a crash between a
    unit's shard line and the unlink. Returns how many files went."""
    gone = 0
    for (index, sample), path in progress_files(folder).items():
        if is_done(index, sample):
            try:
                path.unlink()
                gone += 1
            except FileNotFoundError:
                pass
    return gone
