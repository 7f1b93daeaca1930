"""The record contract: what one line of a stream shard is, and how a unit is named.

A unit is `(index, sample)`: the dataset row's `extra_info.index` and the sample number 0..n-1. Every
finished unit becomes one `RolloutRecord` (all the trajectories its agent loop returned, together) and
every unit that gave up becomes one `FailureRecord`; each is one JSON line in an actor's shard.

- `UnitKeys` turns `(index, sample)` into one integer `index * n + sample` (so sets of units compress
  into ranges in the checkpoint) and back, and names a unit as the text `"index:sample"` where a human
  reads it (the checkpoint's failed units, status, logs).
- `attempt` numbers a unit's tries from 0: how many earlier tries of it ended in a FailureRecord (a
  unit retried by a later launch carries 1, 2, ...). Requests re-sent inside one try (5xx retries,
  stall resends, hedges) are counted in the actor's stats, not here. A reader keeps the first complete
  record of a unit and drops any later one as a duplicate, whatever its attempt: the late answer of a
  superseded try never becomes a second row.
- `TrajectoryKeys` names the keys of one trajectory in a record: verl `AgentLoopOutput`'s fields,
  which pipegen reads back by name (the actor's checks and counters, the writer's parse and padding).
- `unit_seed` and `prompt_uid` derive the per-unit sampling seed and the prompt's uid, so a rerun of
  the same setup reproduces both.

Wire format: orjson of the dataclass, fields in declaration order, so `index` and `sample` lead the
line and `read_head` can read them without parsing the rest. Dataclasses + orjson were measured
against pydantic and msgspec on 1k-token records (ARCHITECTURE.md, "Stream lines"): orjson serialises a
dataclass natively and decoding is one `orjson.loads` plus a constructor call, with no extra
dependency and no validation cost on the hot path.

Owns: every record key (a trajectory's included), the unit-key arithmetic, seed and uid derivation.
Must never: touch files or know about processes (streams.py moves the bytes).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from typing import Any, Final

import orjson

_DUMPS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY  # numpy float32 log-prob arrays: shortest exact repr
_HEAD = re.compile(rb'^\{"index":(-?\d+),"sample":(\d+)')


@dataclass(frozen=True)
class UnitKeys:
    """Unit <-> integer key for a run with n samples per prompt."""

    n: int

    def key(self, index: int, sample: int) -> int:
        return index * self.n + sample

    def unit(self, key: int) -> tuple[int, int]:
        return divmod(key, self.n)

    def priority(self, position: int, sample: int) -> int:
        """verl's `priority` for a unit: its place in dataset order (position, not index)."""
        return position * self.n + sample

    def valid_sample(self, sample: int) -> bool:
        return 0 <= sample < self.n


def unit_label(index: int, sample: int) -> str:
    """How a human reads a unit: `"index:sample"` (checkpoint's failed units, status, logs)."""
    return f"{index}:{sample}"


def parse_unit_label(label: str) -> tuple[int, int]:
    index, sample = label.split(":")
    return int(index), int(sample)


def unit_seed(base_seed: int, index: int, sample: int) -> int:
    """A distinct, reproducible sampling seed per unit (fits SGLang's int sampling_seed)."""
    digest = hashlib.blake2b(f"{base_seed}:{index}:{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def prompt_uid(run_key: str, index: int) -> str:
    """verl gives the n samples of one prompt one shared uid; pipegen derives it so reruns match."""
    return str(uuid.uuid5(uuid.NAMESPACE_OID, f"{run_key}:{index}"))


class TrajectoryKeys:
    """The keys of one trajectory in `RolloutRecord.trajectories`, which is verl's `AgentLoopOutput` as JSON:
    the field names pipegen reads by name. Plain str constants (not an Enum), so the JSON keys are verl's
    own bytes and hot loops can bind them to module-level names."""

    PROMPT_IDS: Final = "prompt_ids"
    RESPONSE_IDS: Final = "response_ids"
    RESPONSE_MASK: Final = "response_mask"  # 1 for a model token, 0 for a tool/user token
    RESPONSE_LOGPROBS: Final = "response_logprobs"  # None unless the servers returned log-probs
    REWARD_SCORE: Final = "reward_score"
    NUM_TURNS: Final = "num_turns"
    METRICS: Final = "metrics"
    EXTRA_FIELDS: Final = "extra_fields"
    MULTI_MODAL_DATA: Final = "multi_modal_data"
    ROUTED_EXPERTS: Final = "routed_experts"
    # one entry per token; the writer reads these as arrays
    TOKEN_LISTS: Final = (PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK, RESPONSE_LOGPROBS)


@dataclass
class RolloutRecord:
    """One finished unit: every trajectory its agent loop returned, and what verl needs to pad them.

    `row` is the dataset row's non-tensor fields as verl's agent loop received them; `trajectories`
    are verl `AgentLoopOutput`s as JSON (`model_dump(mode="json")`, log-probs as float32).
    """

    index: int
    sample: int
    uid: str
    priority: int
    seed: int | None
    agent_name: str
    launch: str
    row: dict[str, Any]
    trajectories: list[dict[str, Any]]
    attempt: int = 0

    def to_line(self) -> bytes:
        return orjson.dumps(self, option=_DUMPS_OPTIONS) + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> "RolloutRecord":
        return cls(**_known(cls, orjson.loads(line)))

    @property
    def num_rows(self) -> int:
        return len(self.trajectories)

    def agent_kwargs(self, default_agent: str) -> dict[str, Any]:
        """The per-row kwargs verl's worker hands to the agent loop and its postprocessing."""
        kwargs = dict(self.row)
        kwargs.setdefault("agent_name", default_agent)
        kwargs["uid"] = self.uid
        kwargs["priority"] = self.priority
        return kwargs


@dataclass
class FailureRecord:
    """One unit that failed after its retries: never a sample, retried by the next launch."""

    index: int
    sample: int
    launch: str
    seed: int | None
    agent_name: str
    reason: str
    attempt: int = 0

    def to_line(self) -> bytes:
        return orjson.dumps(self, option=_DUMPS_OPTIONS) + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> "FailureRecord":
        return cls(**_known(cls, orjson.loads(line)))


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The keys cls declares: a line written by a newer pipegen with extra keys still reads."""
    names = cls.__dataclass_fields__
    return data if all(k in names for k in data) else {k: v for k, v in data.items() if k in names}


def encode_record(index: int, sample: int, body: dict[str, Any]) -> bytes:
    """A line with `index` and `sample` first and a free-form body: what the stream layer needs to
    know of a line. Product records go through RolloutRecord/FailureRecord.to_line."""
    return orjson.dumps({"index": index, "sample": sample, **body}, option=_DUMPS_OPTIONS) + b"\n"


def read_head(line: bytes) -> tuple[int, int] | None:
    """(index, sample) from the front of a line, without parsing the rest."""
    m = _HEAD.match(line)
    return (int(m.group(1)), int(m.group(2))) if m else None
