"""One unit of work: a dataset row -> a verl agent loop over HTTP -> one RolloutRecord -> its line in the
actor's shard.

`UnitRunner` is built once per actor process: it loads the tokenizer, the dataset (verl's
RLHFDataset) and the tools, registers the user's agent loops the verl way
(`rollout.agent.agent_loop_config_path`), and then, per unit, instantiates the row's verl agent loop
(loop_cache.py builds it) with a `UnitServerManager` over the actor's ServerPool (attempts.py), checks
what the loop returned, scores it, packs it into a `RolloutRecord` (run/stream.py) and appends its line to
the actor's rollout stream (or a `FailureRecord` to its failures stream): a shard, or a Redis stream
(run/medium.py). A unit whose reward fails keeps its generated
record, unscored, in its FailureRecord; the next launch scores that record (`rescore`) instead of generating.

Owns: the row -> agent-loop kwargs mapping (uid, priority, seed), the per-unit server manager (sticky server,
seed, concurrency slot), a loop's result as its pieces in order (`loop_pieces`), checked before a shard.
Must never: re-tokenize what the server returned, turn a failed or malformed unit into a record (its
line is a FailureRecord), or open a file (it appends to the shards the worker opened for it; a unit's
progress file is actor/continuation.py's).
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import orjson
from omegaconf import DictConfig, OmegaConf

from pipegen.inputs.dataset import dataset_indices, load_dataset, load_processor, load_tokenizer
from pipegen.actor.loop_cache import AgentLoops
from pipegen.actor.detokenize import response_decoder
from pipegen.actor.continuation import UnitProgress
from pipegen.actor.scoring import KeptPiece, Scorer
from pipegen.rewards.protocol import RewardFailure
from pipegen.config.compose import CONF_DIR
from pipegen.run.layout import LaunchRecord, RunDir
from pipegen.run.pictures import encode_multi_modal_data, has_media, load_pictures, strip_media
from pipegen.verl_private import agent_loop_registry
from pipegen.engines.request import turn_seed
from pipegen.run.medium import Appender
from pipegen.run.stream import (NOT_SCORED, FailureRecord, RolloutRecord, TrajectoryKeys, UnitKeys, prompt_uid,
                                 unit_seed)

if TYPE_CHECKING:
    from verl.workers.rollout.replica import TokenOutput

    from pipegen.actor.admission import UnitSlot
    from pipegen.actor.attempts import ServerPool
    from pipegen.engines.request import Generation
    from pipegen.gateway.http_server import Gateway


# The response text a line carries up front: with the head, the reward and the finish it fits the 200 characters
# of docs/outputs.md's `tail -f ... | cut -c1-200`; decoding 48 tokens costs microseconds (detokenize.py's byte table).
PEEK_CHARS = 120
PEEK_TOKENS = 48


class InvalidTrajectory(ValueError):
    """An agent loop returned something the writer could not turn into verl rows."""


def row_fields(dataset, position: int) -> dict[str, Any]:
    """The row's non-tensor fields, as verl's collate + agent-loop worker would pass them on."""
    row = dataset[position]
    fields = {k: v for k, v in row.items() if not hasattr(v, "dtype") or isinstance(v, np.ndarray)}
    fields.pop("dummy_tensor", None)
    # Arrow unifies struct schemas, so a missing tools_kwargs reads back as None; verl's tool loop
    # then fails inside the tool call. Normalise to {} as verl's own collate path would.
    if fields.get("tools_kwargs") is None:
        fields["tools_kwargs"] = {}
    if fields.get("interaction_kwargs") is None:
        fields["interaction_kwargs"] = {}
    if has_media(fields.get("raw_prompt")):
        load_pictures(fields["raw_prompt"])
    return fields


def resolve_user_path(path: str) -> str:
    """A config file path as verl resolves it (absolute, or under the working directory), falling back
    to pipegen's own folder so the shipped `conf/tools/...` and `conf/agent_loops/...` work from anywhere."""
    from verl.utils.import_utils import resolve_config_path

    p = Path(os.path.expanduser(str(path)))
    if not p.is_absolute() and not p.exists():
        shipped = CONF_DIR.parent / p
        if shipped.exists():
            return str(shipped)
    return resolve_config_path(str(p))


def register_agent_loops(config_path: str | None) -> None:
    """Add the YAML-declared loops (`- {name, _target_, **kwargs}`) to verl's registry, as
    AgentLoopWorker.__init__ does; extra keys reach the loop's constructor."""
    if not config_path:
        return
    loops = OmegaConf.load(resolve_user_path(config_path))
    for loop_cfg in loops:
        if "name" not in loop_cfg or "_target_" not in loop_cfg:
            raise ValueError(f"{config_path}: every agent loop entry needs 'name' and '_target_', got {dict(loop_cfg)}")
        agent_loop_registry()[loop_cfg.name] = loop_cfg


def vision_placeholders(processor: Any) -> dict[int, str]:
    """{token id: name} of a vision-language processor's picture and video placeholders ({} without one)."""
    from verl.utils.tokenizer import get_processor_token_id

    ids = {kind: get_processor_token_id(processor, kind) for kind in ("image", "video")}
    return {int(i): f"its {kind} placeholder" for kind, i in ids.items() if i is not None}


def loop_pieces(result: Any) -> list:
    """A loop's result as its trajectories, in order: the `trajectories` list of a wrapper (the fork's
    MultiTrajectoryAgentLoopOutput, or any object or dict with one), a list (verl's TQ worker's), or one output."""
    pieces = result.get("trajectories") if isinstance(result, dict) else getattr(result, "trajectories", None)
    if isinstance(pieces, (list, tuple)):
        return list(pieces)
    return list(result) if isinstance(result, (list, tuple)) else [result]


def check_trajectories(result: Any, prompt_length: int, response_length: int,
                       placeholders: Mapping[int, str] | None = None) -> list:
    """What an agent loop returned (`loop_pieces`), as a non-empty list of AgentLoopOutput that verl's padding
    accepts.
    placeholders (`vision_placeholders`): token ids the model must not sample. verl's postprocessing takes every
    such id in prompt and response for a picture's (or video's) span and wants a grid for it; a sampled one has
    none, so verl's `get_rope_index` raises on the row, in pipegen's writer as in verl's own trainer. The unit
    fails here instead, named in the failures stream, and the writer never sees the row."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    outputs = loop_pieces(result)
    if not outputs:
        raise InvalidTrajectory("the agent loop returned no trajectory")
    checked = []
    for t, out in enumerate(outputs):
        if isinstance(out, dict):
            out = AgentLoopOutput.model_validate(out)
        if not isinstance(out, AgentLoopOutput):
            raise InvalidTrajectory(f"trajectory {t} is a {type(out).__name__}, not an AgentLoopOutput")
        where = f"trajectory {t}"
        if not out.prompt_ids:
            raise InvalidTrajectory(f"{where}: empty prompt_ids")
        if len(out.prompt_ids) > prompt_length:
            raise InvalidTrajectory(f"{where}: {len(out.prompt_ids)} prompt tokens > prompt_length={prompt_length}")
        if len(out.response_ids) > response_length:
            raise InvalidTrajectory(
                f"{where}: {len(out.response_ids)} response tokens > response_length={response_length}")
        if len(out.response_mask) != len(out.response_ids):
            raise InvalidTrajectory(f"{where}: response_mask has {len(out.response_mask)} entries for "
                                    f"{len(out.response_ids)} response tokens")
        if not set(out.response_mask) <= {0, 1}:  # a set: a generator over every token costs 20 us a unit
            raise InvalidTrajectory(f"{where}: response_mask holds values other than 0 and 1")
        if out.response_logprobs is not None and len(out.response_logprobs) != len(out.response_ids):
            raise InvalidTrajectory(f"{where}: {len(out.response_logprobs)} logprobs for "
                                    f"{len(out.response_ids)} response tokens")
        if placeholders and not placeholders.keys().isdisjoint(out.response_ids):
            # mask-0 tokens (a tool's reply rendered by the processor) may hold a picture's span with its grid
            for pos, (token, sampled) in enumerate(zip(out.response_ids, out.response_mask)):
                if sampled and token in placeholders:
                    raise InvalidTrajectory(
                        f"{where}: the model sampled {placeholders[token]} token (id {token}) at response position "
                        f"{pos}: verl cannot compute M-RoPE position ids for a placeholder with no picture behind it")
        checked.append(out)
    return checked


_TOKEN_LIST_SET = frozenset(TrajectoryKeys.TOKEN_LISTS)


class Unscored(Exception):
    """A unit that generated but whose reward failed: its record (unscored) and the reward's failure."""

    def __init__(self, record: RolloutRecord, cause: Exception):
        super().__init__(f"not scored: {cause}")
        self.record = record
        self.cause = cause


def trajectory_json(output) -> dict[str, Any]:
    """An AgentLoopOutput as the record carries it: `model_dump(mode="json")`, except that plain token
    lists go to orjson as they are (pydantic's JSON mode copies every element: about half the cost of
    this function at 256 tokens, for the same bytes)."""
    lists = {k: getattr(output, k) for k in TrajectoryKeys.TOKEN_LISTS}
    media = output.multi_modal_data
    if media:  # PIL images: pydantic's JSON mode cannot write them; encoded below
        output = output.model_copy(update={"multi_modal_data": None})
    if all(type(v) is list for k, v in lists.items() if v is not None or k != TrajectoryKeys.RESPONSE_LOGPROBS):
        rest = output.model_dump(mode="json", exclude=_TOKEN_LIST_SET)
        data = {k: lists[k] if k in lists else rest[k] for k in type(output).model_fields}
    else:  # anything unusual (arrays, tensors) goes through pydantic's conversion
        data = output.model_dump(mode="json")
    if media:  # the pictures as lossless PNG (run/pictures.py): the writer rebuilds multi_modal_inputs from them
        data[TrajectoryKeys.MULTI_MODAL_DATA] = encode_multi_modal_data(media)
    if data.get(TrajectoryKeys.RESPONSE_LOGPROBS) is not None:
        # float32 shortest repr: half the bytes, and bit-identical after verl's float32 conversion
        data[TrajectoryKeys.RESPONSE_LOGPROBS] = np.asarray(data[TrajectoryKeys.RESPONSE_LOGPROBS], dtype=np.float32)
    return data


class UnitServerManager:
    """The object handed to one verl agent loop: pins the unit's prompt to one server and its seed, and
    tells the unit's slot (admission.UnitSlot) when it asks a server and when it was answered."""

    def __init__(self, pool: ServerPool, sticky_key: Hashable, sampling_seed: int | None, slot: UnitSlot,
                 gateway: Gateway, progress: UnitProgress):
        self.pool = pool
        self.progress = progress  # the unit's record: long answers' kept tokens, calls a rerun answers from it
        self.sticky_key = sticky_key
        self.sampling_seed = sampling_seed
        self.turns = 0  # the model calls verl's loop made so far: each turn's seed is the unit's `turn_seed`
        self.slot = slot
        self.gateway = gateway  # the actor's gateway (pipegen/gateway/), for the `external` loop

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: list | None = None, video_data: list | None = None,
                       audio_data: list | None = None, **_verl_only: Any) -> TokenOutput:
        """verl's generate call, with the unit's seed for this turn (`turn_seed`). image_data (PIL images) travels to the engine (attempts.py);
        videos and audio, which no engine pipegen speaks takes, fail the unit in one line (refused at launch
        already). Not sent: `priority` (admission.py orders the units) and `mm_processor_kwargs`/
        `mm_processor_output` (the pictures are already at the processor's size; verl's SGLang server sends
        neither for images either)."""
        if video_data or audio_data:
            raise ValueError("this prompt holds videos or audio, which no engine pipegen speaks takes; drop the "
                             "dataset's video/audio column")
        seed = turn_seed(self.sampling_seed, self.turns, self.pool.limits.draws_by_position)
        self.turns += 1
        return await self.generate_seeded(request_id, prompt_ids, sampling_params, seed, image_data)

    async def generate_seeded(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                              seed: int | None, image_data: list | None = None) -> TokenOutput:
        """One request with this seed: verl's calls take the unit's, a gateway session's calls their own
        (pipegen/gateway/seam.py's UnitServer)."""
        self.slot.ask()  # a failed request leaves the unit holding its slot until it ends (worker.run_unit)

        async def send(generation: Generation) -> TokenOutput:
            return await self.pool.send(generation, self.sticky_key)

        # one call may be several requests (a long answer's chunks on an engine that does not stream) or none
        # (answered from the record)
        output = await self.progress.generate(send, prompt_ids, sampling_params, seed, image_data)
        await self.slot.answered()
        return output


def model_stop_ids(cfg: Any, tokenizer: Any) -> frozenset[int]:
    """The model's EOS ids as the engines read them (inputs/models.py's `eos_ids`)."""
    from pipegen.inputs.models import eos_ids

    eos = tokenizer.eos_token_id
    return eos_ids(str(cfg.actor_rollout_ref.model.path), int(eos) if eos is not None else None)


class UnitRunner:
    """Everything one actor needs to turn (position, sample) into a RolloutRecord."""

    def __init__(self, cfg: DictConfig, run: RunDir, launch: LaunchRecord, who: str = "actor"):
        from transformers import AutoConfig
        from verl.experimental.agent_loop import agent_loop as verl_agent_loop
        from verl.tools.tool_registry import load_all_tools
        from verl.utils.dataset.rl_dataset import get_dataset_class

        self.cfg = cfg
        self.launch = launch
        rollout = cfg.actor_rollout_ref.rollout
        self.keys = UnitKeys(int(rollout.n))
        self.prompt_length = int(rollout.prompt_length)
        self.response_length = int(rollout.response_length)
        self.tokenizer = load_tokenizer(cfg)
        self.processor = load_processor(cfg)  # a vision-language model's; None for a text model
        self.placeholders = vision_placeholders(self.processor)
        self.dataset = load_dataset(cfg, self.tokenizer, self.processor)
        self.indices = run.read_manifest()
        if dataset_indices(self.dataset) != self.indices:
            # e.g. data.shuffle=true without data.seed: verl then samples a different subset per process
            raise SystemExit(
                f"{who}: the dataset's rows differ from {run.units_file}; the data files changed or "
                "row selection is random (set data.seed, or data.shuffle=false)"
            )
        hf_config = AutoConfig.from_pretrained(cfg.actor_rollout_ref.model.path,
                                               trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
        model_type = getattr(hf_config, "model_type", None)
        self.hf_model_type = model_type if isinstance(model_type, str) else None
        # a vision-language model keeps its language model's limits in text_config
        text_config = getattr(hf_config, "text_config", None) or hf_config
        self.max_model_len = int(rollout.get("max_model_len") or getattr(hf_config, "max_position_embeddings", None)
                                 or text_config.max_position_embeddings)
        vocab = getattr(hf_config, "vocab_size", None) or getattr(getattr(hf_config, "text_config", None),
                                                                  "vocab_size", None)
        self.vocab_size = int(vocab) if vocab else None
        multi_turn = rollout.multi_turn
        self.tools = load_all_tools(
            tool_config_path=resolve_user_path(multi_turn.tool_config_path) if multi_turn.tool_config_path else None,
            function_tool_path=resolve_user_path(multi_turn.function_tool_path) if multi_turn.function_tool_path else None,
        )
        # verl adds YAML-registered loops only inside AgentLoopWorker.__init__; do the same here.
        register_agent_loops(rollout.agent.agent_loop_config_path)
        import pipegen.gateway.loop  # noqa: F401  (registers the `external` agent loop, as verl's own register)
        from pipegen.gateway.http_server import Gateway

        self.gateway = Gateway(cfg.external.host)  # started by the first `external` unit
        self.registry = agent_loop_registry()
        self.loops = AgentLoops(self.registry, dict(
            trainer_config=verl_agent_loop.DictConfigWrap(cfg),  # verl only reads through these wrappers
            tokenizer=self.tokenizer,
            processor=self.processor,
            hf_model_type=self.hf_model_type,
            dataset_cls=get_dataset_class(cfg.data),
            data_config=verl_agent_loop.DictConfigWrap(cfg.data),
        ), verl_agent_loop.ToolListWrap, self.tools)
        self.default_agent = rollout.agent.default_agent_loop
        self.sampling_params = dict(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            repetition_penalty=1.0,
            logprobs=rollout.calculate_log_probs,
        )
        self.scorer = Scorer(cfg, self.tokenizer) if cfg.actors.scoring else None
        self._decode = response_decoder(self.tokenizer)
        self._rows: dict[int, dict[str, Any]] = {}
        self._stripped: dict[int, dict[str, Any]] = {}
        self._uids: dict[int, str] = {}
        # read once: a DictConfig lookup costs tens of microseconds, and these are read per unit
        self.run_dir = run
        self.chunk_tokens = int(cfg.actors.progress_chunk_tokens)
        self.divide_tokens = int(cfg.actors.chunk_tokens)
        self.stop_ids = model_stop_ids(cfg, self.tokenizer)
        # where a unit's answer lengths go as they grow (the actor's admission order: units.py's LengthEvidence)
        self.lengths: Callable[[int, int, bool], None] | None = None
        self._base_seed = int(cfg.seed)
        self._per_unit_seed = bool(cfg.actors.per_unit_seed)

    def row_sampling_params(self, row: dict[str, Any]) -> dict[str, Any]:
        """The run's sampling params, greedy for a row whose `__do_sample__` is false (verl's per-row override, as
        verl's AgentLoopWorker applies it with apply_greedy_sampling_params)."""
        params = dict(self.sampling_params)
        if "__do_sample__" in row and row["__do_sample__"] is not None and not bool(row["__do_sample__"]):
            params.update(temperature=0, top_p=1.0, top_k=-1)
        return params

    def peek(self, response_ids: list[int]) -> str:
        """The start of a response as one line of text: what `tail -f` of the shards shows a person."""
        return " ".join(self._decode(response_ids[:PEEK_TOKENS]).split())[:PEEK_CHARS]

    def row(self, pos: int) -> dict[str, Any]:
        if pos not in self._rows:
            self._rows[pos] = row_fields(self.dataset, pos)
        return self._rows[pos]

    def record_row(self, pos: int) -> dict[str, Any]:
        """The row as its line keeps it: a multimodal prompt's pictures reduced to their places
        (run/pictures.py's strip_media; the pictures travel once, in the trajectory's multi_modal_data)."""
        stripped = self._stripped.get(pos)
        if stripped is None:  # verl's dataset puts the pictures into `raw_prompt` and the prompt column alike
            row = self.row(pos)
            stripped = self._stripped[pos] = {k: strip_media(v) if has_media(v) else v for k, v in row.items()}
        return stripped

    def seed(self, index: int, sample: int, attempt: int = 0) -> int | None:
        """The unit's sampling seed; a retry's has its attempt mixed in (run/stream.py's unit_seed)."""
        return unit_seed(self._base_seed, index, sample, attempt) if self._per_unit_seed else None

    def agent_name(self, pos: int) -> str:
        return self.row(pos).get("agent_name") or self.default_agent

    def uid(self, index: int) -> str:
        uid = self._uids.get(index)
        if uid is None:  # a uuid5 per unit costs more than the rest of the unit's bookkeeping
            uid = self._uids[index] = prompt_uid(self.launch.run_key, index)
        return uid

    def unit_progress(self, pool, index: int, sample: int, pos: int | None = None) -> UnitProgress:
        """The unit's record of its calls (actor/continuation.py), read back when a crash left one."""
        lengths = self.lengths
        return UnitProgress(self.run_dir.progress_file(index, sample), self.chunk_tokens, pool.limits,
                            streams=pool.engine.streams, divide_tokens=self.divide_tokens, stop_ids=self.stop_ids,
                            lengths=None if lengths is None or pos is None else
                            (lambda tokens, finished: lengths(pos, tokens, finished)))

    async def run(self, pool, pos: int, sample: int, slot, progress: UnitProgress, attempt: int = 0) -> RolloutRecord:
        """Run the unit's agent loop against the server pool (`slot`: the unit's admission.UnitSlot; `progress`:
        its record; `attempt`: its earlier failed tries, mixed into its seed); raises on any failure of the unit."""
        index = self.indices[pos]
        row = self.row(pos)
        seed = self.seed(index, sample, attempt)
        agent_name = self.agent_name(pos)
        uid = self.uid(index)
        priority = self.keys.priority(pos, sample)
        kwargs = {k: v for k, v in row.items() if k not in ("agent_name", "__do_sample__")}
        kwargs.update(uid=uid, priority=priority)
        if agent_name not in self.registry:
            raise ValueError(f"agent loop '{agent_name}' is not registered; known: {sorted(self.registry)} "
                             "(register yours with actor_rollout_ref.rollout.agent.agent_loop_config_path)")
        agent = self.loops.build(agent_name, UnitServerManager(pool, sticky_key=index, sampling_seed=seed, slot=slot,
                                                               gateway=self.gateway, progress=progress))
        result = await agent.run(self.row_sampling_params(row), **kwargs)
        outputs = check_trajectories(result, self.prompt_length, self.response_length, self.placeholders)
        resumed = progress.row_fields()
        for out in outputs if resumed else ():  # a user filters resumed rows by these (docs/outputs.md)
            out.extra_fields.update(resumed)
        not_scored = None  # a failed reward keeps the samples unscored (Unscored below), never given a number
        try:  # a loop's own scores are kept (scoring.py)
            await self.score(outputs, row, slot)
        except RewardFailure as e:
            not_scored = e
        last = outputs[-1]
        record = RolloutRecord(index=index, sample=sample, reward=last.reward_score, text=self.peek(last.response_ids),
                             finish="length" if len(last.response_ids) >= self.response_length else "stop",
                             uid=uid, priority=priority, seed=seed,
                             agent_name=agent_name, launch=self.launch.launch, row=self.record_row(pos),
                             trajectories=[trajectory_json(o) for o in outputs])
        if not_scored is not None:
            raise Unscored(record, not_scored)
        return record

    async def rescore(self, pos: int, kept: dict[str, Any], slot) -> RolloutRecord:
        """A unit generated by an earlier try whose scoring failed: its kept record scored now, generating
        nothing. A reward that fails again raises Unscored with the record kept once more."""
        record = RolloutRecord(**{k: v for k, v in kept.items() if k in RolloutRecord.__dataclass_fields__})
        record.launch = self.launch.launch
        pieces = [KeptPiece(t) for t in record.trajectories]
        try:
            await self.score(pieces, self.row(pos), slot)
        except RewardFailure as e:
            raise Unscored(record, e) from None
        record.reward = pieces[-1].reward_score
        return record

    async def score(self, pieces: list, row: dict[str, Any], slot) -> None:
        """The unit's pieces scored by the run's rule (scoring.py), the row's reward looked up once."""
        if self.scorer is None:  # actors.scoring=false: as generated
            return
        reward = self.scorer.reward_for(row)
        with slot.awaiting_verifier(self.scorer.remote_capacity(reward) if reward is not None else 0):
            await self.scorer.score_pieces(pieces, row, reward)

    async def close(self) -> None:
        """Stop what scoring started (a process pool, a verifier session)."""
        if self.scorer is not None:
            await self.scorer.close()

    async def run_unit(self, pool, pos: int, sample: int, slot, attempt: int, rollouts: Appender,
                       failures: Appender, kept: dict[str, Any] | None = None) -> RolloutRecord | Exception:
        """One unit from its dataset row to its line: the RolloutRecord appended to `rollouts`, or, on any
        failure of the unit, a FailureRecord appended to `failures` (never a sample). `kept`: the unit's
        record of an earlier try that generated but could not be scored; it is scored, not generated again.
        A unit whose reward fails keeps its record in its FailureRecord (`unscored`). Returns the record, or
        the unit's exception. A failed append (the disk) raises: that is the actor's failure, not the unit's."""
        index = self.indices[pos]
        progress = self.unit_progress(pool, index, sample, pos)
        try:
            record = await (self.rescore(pos, kept, slot) if kept is not None
                            else self.run(pool, pos, sample, slot, progress, attempt))
            record.attempt = attempt
            line = record.to_line()
        except Unscored as e:  # generated, not scored: the samples are kept for the next launch to score
            e.record.attempt = attempt
            await failures.append(FailureRecord(
                index=index, sample=sample, launch=self.launch.launch, seed=e.record.seed,
                agent_name=e.record.agent_name, attempt=attempt,
                reason=f"{NOT_SCORED}: {type(e.cause).__name__}: {e.cause}",
                unscored=orjson.loads(e.record.to_line())).to_line())
            progress.discard()  # its samples are in the failure line
            return e
        except Exception as e:  # any failure of this unit is recorded, never turned into a sample
            await failures.append(FailureRecord(index=index, sample=sample, launch=self.launch.launch,
                                                seed=self.seed(index, sample, attempt), agent_name=self.agent_name(pos),
                                                reason=f"{type(e).__name__}: {e}", attempt=attempt).to_line())
            # kept: a retry that asks the same requests continues from it; one whose seed has its attempt mixed in
            # (a per-unit seed) asks differently, so its first call drops the record
            progress.close()
            return e
        await rollouts.append(line)  # returns once the medium holds it (a Redis outage: it waits, held in memory)
        progress.discard()  # after the line: a crash between the two leaves a file the next start tidies
        return record
