"""A rollout line -> `RolloutRecord` whose token lists are numpy arrays, without a Python object per token.

`RolloutRecord.from_line` (orjson) builds a Python int or float for every token id, mask bit and
log-prob, and the writer then turns those lists back into arrays: together about twice the cost of
the parse alone. simdjson (pysimdjson) parses the line once in C++ and hands each numeric array out
as one contiguous buffer (`as_buffer`), so the writer reads a 1k-token record in ~0.7x the time of a
bare `orjson.loads`. Integers come out as int64 and floats as float64, exactly the values orjson
gives (both parsers round decimal text correctly), so verl parity is unchanged. Records with the same
dataset row text share one row dict (the n samples of a prompt), as verl's `DataProto.repeat` shares
them.

Owns: which trajectory keys are read as arrays (verl's `AgentLoopOutput` token lists).
Must never: accept a line the record contract would reject; anything unusual (a non-numeric entry in
a token list, a missing key, a line orjson would refuse) goes through `RolloutRecord.from_line`.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np
import simdjson

from pipegen.run.records import RolloutRecord, TrajectoryKeys

# verl AgentLoopOutput lists read as arrays: buffer type code, numpy dtype
ARRAY_KEYS = {
    TrajectoryKeys.PROMPT_IDS: ("i", np.int64),
    TrajectoryKeys.RESPONSE_IDS: ("i", np.int64),
    TrajectoryKeys.RESPONSE_MASK: ("i", np.int64),
    TrajectoryKeys.RESPONSE_LOGPROBS: ("d", np.float64),
}
_SCALAR_FIELDS = tuple(f.name for f in fields(RolloutRecord) if f.name not in ("trajectories", "row"))
_MISSING = object()
ROW_CACHE_SIZE = 256  # distinct dataset rows remembered; a prompt's n samples arrive close together


class LineParser:
    """One reusable simdjson parser (a parser holds one document at a time; arrays are copied out)."""

    def __init__(self) -> None:
        self._parser = simdjson.Parser()
        self._rows: dict[bytes, dict[str, Any]] = {}

    def record(self, line: bytes) -> RolloutRecord:
        """The line as a RolloutRecord; trajectory token lists as numpy arrays when they are numeric."""
        try:
            return self._fast(line)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError):  # simdjson's errors
            # a fresh parser: the traceback may still hold proxies into the old one's document
            self._parser = simdjson.Parser()
            return RolloutRecord.from_line(line)  # the record contract decides (and raises) on odd lines

    def _fast(self, line: bytes) -> RolloutRecord:
        doc = self._parser.parse(line)
        if not isinstance(doc, simdjson.Object):
            raise TypeError("a record line is a JSON object")
        values = {}
        for name in _SCALAR_FIELDS:
            value = doc.get(name, _MISSING)
            if value is not _MISSING:
                values[name] = _plain(value)
        row = doc.get("row", _MISSING)
        if row is not _MISSING:
            values["row"] = self._row(row)
        return RolloutRecord(**values, trajectories=[_trajectory(t) for t in doc["trajectories"]])

    def _row(self, value) -> Any:
        """The dataset row, one shared dict per distinct row text: the n samples of a prompt carry the
        same row, and sharing it is what verl's own `DataProto.repeat` does for them. It also makes
        pickle write each row's fields once per batch file instead of once per sample."""
        if type(value) is not simdjson.Object:
            return _plain(value)
        text = value.mini
        row = self._rows.get(text)
        if row is None:
            if len(self._rows) >= ROW_CACHE_SIZE:
                self._rows.clear()
            row = self._rows[text] = value.as_dict()
        return row


def _trajectory(traj) -> dict[str, Any]:
    if not isinstance(traj, simdjson.Object):
        raise TypeError("a trajectory is a JSON object")
    out: dict[str, Any] = {}
    for key in traj.keys():
        value = traj[key]
        spec = ARRAY_KEYS.get(key)
        if spec is not None and type(value) is simdjson.Array:
            out[key] = np.frombuffer(value.as_buffer(of_type=spec[0]), dtype=spec[1])
        else:
            out[key] = _plain(value)
    return out


def _plain(value):
    kind = type(value)
    if kind is simdjson.Object:
        return value.as_dict()
    if kind is simdjson.Array:
        return value.as_list()
    return value

