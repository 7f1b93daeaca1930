"""`python -m pipegen.export DIR --format atif`: one ATIF document (Harbor's Agent Trajectory Interchange Format,
v1.8) per trajectory, `DIR/trajectories.atif/<index>-<sample>-<trajectory>.json`, for agent tooling that reads
ATIF instead of verl's DataProto.

A document's steps come from the row's messages and its tokens:
- a gateway run (the `external` loop) keeps each trajectory's messages, as the harness held them, in the row's
  `gateway` field: system and user messages become `system` / `user` steps, each assistant message an `agent`
  step with its text and tool calls, and each tool message an observation of the agent step whose call it
  answers (tool-call ids are the document's own, `call_<step>_<k>`: the gateway's canonical messages carry none);
- any other loop (single-turn, verl's tool_agent): the row's `raw_prompt` messages (an assistant message there, a
  worked example, is an agent step marked as copied context), then one agent step per run
  of model tokens (the response mask's 1s), its text decoded from those ids, and the tokens between two runs
  (tool results, a user turn, rendered by the chat template) as the observation of the step before them,
  decoded. A single-turn row is its prompt's steps and one agent step.
Every agent step that the row sampled carries `metrics`: `prompt_token_ids` (the prompt and every response
token before the step), `completion_token_ids` and `logprobs` (the row's own ids and rollout log-probs: never
re-tokenized), so the agent steps' completion ids, in order, are exactly the row's model tokens.

Copied context (ATIF's `is_copied_context`, "MUST be filtered out of SFT training data") marks the agent steps a
trajectory did not sample itself: assistant messages in its prompt (worked examples, or the history a harness
edited, e.g. after compaction, which starts a new trajectory rendered from messages), in a branch forked
from another trajectory, the calls it inherited from that trajectory (the gateway's `calls` counts only the
branch's own), and in a piece of a multi-trajectory sample (a snapshot loop's later snapshot or its final
conversation), the runs of model tokens inside the prefix it shares with an earlier piece of the same sample:
across a sample's documents each sampled token is then outside copied context exactly once.

Every document is one piece: `session_id` is the sample's (every piece of it shares one), `trajectory_id`
`<index>-<sample>-<trajectory>`, and `extra` carries the row's fields that the DataProto and Parquet rows
carry too: index, sample, trajectory, uid, reward, loss_weight, reward_rule, is_snapshot, snapshot_index.

Each document is checked against the `atif` package's pydantic models when it is installed (`pip install
atif`, Python >= 3.11; the test extra installs it): a document that does not validate stops the export.

Owns: the ATIF document of a row. Must never: write outside its output folder, leave a half-written folder
under the final name, or re-tokenize text into ids.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import orjson
from omegaconf import DictConfig

from pipegen.export.card import pipegen_version
from pipegen.export.writers import ROW_GROUP_ROWS, plain
from pipegen.run.batchfile import BatchColumns
from pipegen.run.rows import SortedRows
from pipegen.run.stream import PieceKeys, session_id

SCHEMA_VERSION = "ATIF-v1.8"
GATEWAY_FIELD = "gateway"  # the external loop's per-trajectory record (pipegen/gateway/loop.py)
PIECE_FIELDS = (PieceKeys.SESSION_ID, PieceKeys.LOSS_WEIGHT, PieceKeys.REWARD_RULE, PieceKeys.IS_SNAPSHOT,
                PieceKeys.SNAPSHOT_INDEX)


def shared_prefix(ids: np.ndarray, earlier: list[np.ndarray]) -> int:
    """The longest prefix `ids` shares with any of `earlier` (the pieces before it of its sample)."""
    best = 0
    for other in earlier:
        n = min(len(ids), len(other))
        differ = np.flatnonzero(ids[:n] != other[:n])
        best = max(best, int(differ[0]) if len(differ) else n)
    return best


def _text(content: Any) -> str:
    """A message's content as text (text parts joined; anything else as JSON)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return orjson.dumps(plain(content)).decode()


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of model tokens (mask 1) in a response."""
    out, start = [], None
    for i, bit in enumerate(mask.tolist()):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(mask)))
    return out


class RowTokens:
    """One row's unpadded ids, mask and log-probs, and the metrics of a run of model tokens."""

    def __init__(self, prompt: np.ndarray, response: np.ndarray, mask: np.ndarray, logprobs: np.ndarray | None):
        self.prompt, self.response, self.mask, self.logprobs = prompt, response, mask, logprobs
        self.runs = _runs(mask)

    def metrics(self, run: tuple[int, int]) -> dict[str, Any]:
        start, end = run
        prompt_ids = self.prompt.tolist() + self.response[:start].tolist()
        out = {"prompt_tokens": len(prompt_ids), "completion_tokens": end - start, "prompt_token_ids": prompt_ids,
               "completion_token_ids": self.response[start:end].tolist()}
        if self.logprobs is not None:
            out["logprobs"] = [float(x) for x in self.logprobs[start:end]]
        return out


def _arguments(value: Any) -> dict[str, Any]:
    """ATIF's arguments are a JSON object: a call whose arguments did not parse keeps them under `raw`."""
    return plain(value) if isinstance(value, dict) else {"raw": plain(value)}


def gateway_steps(messages: list[dict[str, Any]], tokens: RowTokens, own_calls: int) -> list[dict[str, Any]]:
    """Steps from a gateway trajectory's messages; the last assistant messages are the row's runs of model
    tokens, of which all but the last `own_calls` were inherited from the trajectory it forked from."""
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    sampled = assistants[len(assistants) - len(tokens.runs):] if tokens.runs else []
    run_of = {i: run for i, run in zip(sampled, tokens.runs)}
    own = set(sampled[max(0, len(sampled) - own_calls):])
    steps: list[dict[str, Any]] = []
    last_agent: dict[str, Any] | None = None
    answered = 0
    for i, m in enumerate(messages):
        role, n = m.get("role"), len(steps) + 1
        if role == "assistant":
            step: dict[str, Any] = {"step_id": n, "source": "agent", "message": _text(m.get("content"))}
            calls = [{"tool_call_id": f"call_{n}_{k}", "function_name": str(c.get("function", {}).get("name", "")),
                      "arguments": _arguments(c.get("function", {}).get("arguments"))}
                     for k, c in enumerate(m.get("tool_calls") or [])]
            if calls:
                step["tool_calls"] = calls
            if i in run_of:
                step["metrics"] = tokens.metrics(run_of[i])
            if i not in own:
                step["is_copied_context"] = True
            steps.append(step)
            last_agent, answered = step, 0
        elif role == "tool" and last_agent is not None:
            calls = last_agent.get("tool_calls") or []
            result = {"content": _text(m.get("content"))}
            if answered < len(calls):
                result["source_call_id"] = calls[answered]["tool_call_id"]
            answered += 1
            last_agent.setdefault("observation", {"results": []})["results"].append(result)
        else:
            source = role if role in ("system", "user") else "user"
            step = {"step_id": n, "source": source, "message": _text(m.get("content"))}
            if role not in ("system", "user"):
                step["extra"] = {"role": role}
            steps.append(step)
            last_agent = None
    return steps


def token_steps(prompt: list[dict[str, Any]], tokens: RowTokens, decode: Any,
                shared: int = 0) -> list[dict[str, Any]]:
    """Steps of a verl loop's row: its prompt messages, then one agent step per run of model tokens, the tokens
    between runs (decoded) as the observation of the step before them. `shared`: how many response tokens this
    piece shares with an earlier piece of its sample; the runs inside them are copied context."""
    steps: list[dict[str, Any]] = []
    for m in prompt:
        role = m.get("role") if isinstance(m, dict) else "user"
        text = _text(m.get("content") if isinstance(m, dict) else m)
        if role == "assistant":  # a worked example in the prompt: the model did not sample it here
            steps.append({"step_id": len(steps) + 1, "source": "agent", "message": text, "is_copied_context": True})
            continue
        source = role if role in ("system", "user") else "user"
        step = {"step_id": len(steps) + 1, "source": source, "message": text}
        if source != role:
            step["extra"] = {"role": role}
        steps.append(step)
    for k, run in enumerate(tokens.runs):
        start, end = run
        step = {"step_id": len(steps) + 1, "source": "agent", "message": decode(tokens.response[start:end].tolist()),
                "metrics": tokens.metrics(run)}
        if end <= shared:  # sampled in an earlier piece of this sample
            step["is_copied_context"] = True
        after = tokens.runs[k + 1][0] if k + 1 < len(tokens.runs) else len(tokens.response)
        if after > end:
            step["observation"] = {"results": [{"content": decode(tokens.response[end:after].tolist()),
                                                "extra": {"decoded_from_tokens": True}}]}
        steps.append(step)
    return steps


def document(row: dict[str, Any], tokens: RowTokens, decode: Any, model: str, agent_loop: str,
             shared: int = 0) -> dict[str, Any]:
    """One row's ATIF document (a plain dict, as written); `shared`: see token_steps."""
    gateway = row.get(GATEWAY_FIELD) if isinstance(row.get(GATEWAY_FIELD), dict) else None
    if gateway is not None and isinstance(gateway.get("messages"), list):
        steps = gateway_steps(gateway["messages"], tokens, int(gateway.get("calls") or 0))
    else:
        steps = token_steps(list(row.get(BatchColumns.RAW_PROMPT) or []), tokens, decode, shared)
    agent = [s for s in steps if s["source"] == "agent" and "metrics" in s]
    index, sample, trajectory = (int(row[k]) for k in (BatchColumns.INDEX, BatchColumns.SAMPLE,
                                                       BatchColumns.TRAJECTORY))
    extra = {"index": index, "sample": sample, "trajectory": trajectory, "uid": row.get(BatchColumns.UID),
             "data_source": row.get("data_source"), "reward": row.get("reward"),
             **{k: row.get(k) for k in PIECE_FIELDS if k in row}}
    session = row.get(PieceKeys.SESSION_ID) or session_id(row.get(BatchColumns.UID), sample)
    doc = {"schema_version": SCHEMA_VERSION, "session_id": session,
           "trajectory_id": f"{index}-{sample}-{trajectory}",
           "agent": {"name": "pipegen", "version": pipegen_version(), "model_name": model,
                     "extra": {"agent_loop": agent_loop}},
           "steps": steps,
           "final_metrics": {"total_prompt_tokens": sum(s["metrics"]["prompt_tokens"] for s in agent),
                             "total_completion_tokens": sum(s["metrics"]["completion_tokens"] for s in agent),
                             "total_steps": len(steps)},
           "extra": plain({**extra, **({"branch": gateway.get("branch"), "calls": gateway.get("calls")}
                                       if gateway is not None else {})})}
    if any(s.get("is_copied_context") for s in steps):
        doc["notes"] = ("steps marked is_copied_context were not sampled in this trajectory: the history it was "
                        "given, the calls of the trajectory it branched from, or an earlier piece of its sample")
    return doc


def _validator() -> Any:
    try:
        from atif import Trajectory
    except ImportError:  # Python 3.10, or atif not installed: documents are written unchecked
        return None
    return Trajectory.model_validate


def documents(cfg: DictConfig, plan: SortedRows, row_group_rows: int = ROW_GROUP_ROWS) -> Iterator[tuple[str, dict]]:
    """(file name, document) for every row of the run, in the output's order."""
    from pipegen.inputs.dataset import load_tokenizer

    tokenizer = load_tokenizer(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    model, loop = str(cfg.actor_rollout_ref.model.path), str(rollout.agent.get("default_agent_loop", ""))
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    session_key: tuple[int, int] | None = None
    pieces: list[np.ndarray] = []  # the full token ids of the current sample's pieces so far
    for lo, hi in plan.ranges(row_group_rows):
        t = plan.tensors(lo, hi)
        width = t[BatchColumns.PROMPTS].shape[1]
        attn = t[BatchColumns.ATTENTION_MASK].astype(bool)
        logprobs = t.get(BatchColumns.ROLLOUT_LOG_PROBS)
        scores = t[BatchColumns.RM_SCORES].sum(axis=1) if BatchColumns.RM_SCORES in t else None
        for i in range(hi - lo):
            keep = attn[i, width:]
            tokens = RowTokens(t[BatchColumns.PROMPTS][i][attn[i, :width]], t[BatchColumns.RESPONSES][i][keep],
                               t[BatchColumns.RESPONSE_MASK][i][keep],
                               logprobs[i][keep] if logprobs is not None else None)
            row = {k: v[lo + i] for k, v in plan.non_tensor.items()}
            row["reward"] = float(scores[i]) if scores is not None else None
            # rows come sorted by (index, sample, trajectory): a sample's pieces are consecutive
            key = (int(row[BatchColumns.INDEX]), int(row[BatchColumns.SAMPLE]))
            if key != session_key:
                session_key, pieces = key, []
            ids = np.concatenate([tokens.prompt, tokens.response])
            shared = shared_prefix(ids, pieces) - len(tokens.prompt)
            pieces.append(ids)
            doc = document(row, tokens, decode, model, loop, max(0, shared))
            yield f"{doc['trajectory_id']}.json", doc
    plan.release()


def export_atif(cfg: DictConfig, plan: SortedRows, folder: Path, row_group_rows: int = ROW_GROUP_ROWS) -> int:
    """Write every row's document into `folder` (built beside it, then moved into place); returns the count."""
    folder = Path(folder)
    validate = _validator()
    building = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    count = 0
    try:
        for name, doc in documents(cfg, plan, row_group_rows):
            if validate is not None:
                validate(doc)
            (building / name).write_bytes(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY))
            count += 1
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(building, folder)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return count
