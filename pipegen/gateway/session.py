"""One unit's session: its harness's calls become token-exact trajectories.

A call continues a trajectory when its messages are that trajectory's messages (every earlier message plus each
reply exactly as returned) followed by new ones (tool results, a user turn): its prompt is then the trajectory's
ids so far plus verl's Continuous Token rendering of only the new messages (`merge_context_tokens`, the same
builder verl's ToolAgentLoop uses), so nothing sampled is ever re-tokenized. The reply's ids carry mask 1 and
their log-probs; the new messages' ids carry mask 0: verl's multi-turn layout.
A call that matches a trajectory only up to an earlier reply, or one in flight, forks it there (a branch that
shares the prefix the model really saw); a call that matches none (the harness edited the history: compaction, a
sub-agent, a rewritten tool call) starts a new trajectory rendered from its messages. Each trajectory's
`branch` says why it exists. Nothing is merged silently.
A retry (same body with `x-stainless-retry-count` >= 1, or an `Idempotency-Key` already seen) is answered with
the first call's reply and never samples again; an identical request without those headers is a new sample.

Owns: the trajectories of one session, the retry book, per-call sampling (the request's temperature / top_p /
max tokens over the run's, a seed per call derived from the unit's), stop strings, the reply's parse (verl's
tool parser; a tool call that does not parse stays text and is counted).
Must never: re-tokenize sampled ids, change a trajectory for a call that failed, or exceed the run's
prompt_length / response_length (a call past the response budget gets an empty `length` reply).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

import orjson

from pipegen.gateway.dialects.shapes import BadRequest, ChatRequest, Choice, Reply, ToolCall, reply_message

log = logging.getLogger("pipegen.gateway")

RETRY_BOOK_SIZE = 256  # replies kept per session for retries (a harness retries its last calls, not old ones)


class Generated(Protocol):
    """One engine answer as verl's server manager returns it (verl's TokenOutput)."""

    token_ids: list[int]
    log_probs: list[float] | None


class SessionGenerate(Protocol):
    """A session's one way to the engines: the unit's server manager (gateway/seam.py's UnitServer), with the
    seed of this call."""

    def __call__(self, prompt_ids: list[int], sampling_params: dict[str, Any],
                 seed: int | None) -> Awaitable[Generated]: ...


class SessionClosed(Exception):
    """The session's unit has finished: its trajectories are final."""


@dataclass
class Trajectory:
    """One unbroken conversation: the ids the model saw, in verl's multi-turn layout."""

    number: int
    branch: str  # why this trajectory exists
    tools_key: bytes
    prompt_ids: list[int]
    messages: list[dict[str, Any]] = field(default_factory=list)  # canonical, through the last reply
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    checkpoints: list[tuple[int, int]] = field(default_factory=list)  # (messages, response ids) after each call
    calls: int = 0
    unparsed_tool_calls: int = 0
    last_used: int = 0  # the session's call counter at its last call (the freshest trajectory goes last)
    busy: bool = False  # a call extending it is in flight

    def at(self, checkpoint: int) -> tuple[list[int], list[int], list[float]]:
        """Copies of (response ids, mask, log-probs) as they stood after call `checkpoint`."""
        n = self.checkpoints[checkpoint][1]
        return list(self.response_ids[:n]), list(self.mask[:n]), list(self.logprobs[:n])


class Renderer:
    """The model's side of a session: verl's Continuous Token builder (chat template, boundaries), verl's tool
    parser, the tokenizer (for reply text only), and the end-of-turn ids."""

    def __init__(self, builder: Any, tool_parser: Any, tokenizer: Any):
        self.builder = builder
        self.parser = tool_parser
        self.tokenizer = tokenizer
        ends = {tokenizer.eos_token_id}
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tid = tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
                ends.add(tid)
        self.end_ids = frozenset(t for t in ends if t is not None)

    def initial(self, messages: list[dict], tools: list | None) -> list[int]:
        return list(self.builder.build_initial_tokens(messages, tools=tools))

    def extend(self, previous: list[dict], messages: list[dict], runtime_ids: list[int],
               tools: list | None) -> tuple[list[int], int]:
        """(the ids appended after runtime_ids, how many of runtime_ids' last ids to drop): verl's merge."""
        merged = self.builder.merge_context_tokens(previous, messages, runtime_ids, tools=tools)
        keep = len(runtime_ids) - merged.removed_prefix_token_count
        return list(merged.token_ids[keep:]), merged.removed_prefix_token_count

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def parse(self, ids: list[int], tools: list | None, parse_tools: bool) -> tuple[str, list, int]:
        """(content, [(name, arguments)], unparsed count) of a reply's ids, its end-of-turn id left out."""
        body = ids[:-1] if ids and ids[-1] in self.end_ids else ids
        text = self.decode(body)
        if not (parse_tools and tools and self.parser is not None):
            return text, [], 0
        content, calls = await self.parser.extract_tool_calls(body, tools)
        start = getattr(self.parser, "tool_call_start_token", None)
        raw = self.tokenizer.decode(body)
        found = raw.count(start) if start else len(calls)
        if len(calls) < found:  # a call that does not parse is returned as text, never dropped
            return text, [], found - len(calls)
        content = content.strip() if calls else text
        return content, [(c.name, c.arguments) for c in calls], 0


def _truncate_at_stop(ids: list[int], stops: list[str], decode: Callable[[list[int]], str]) -> tuple[int, str] | None:
    """(ids to keep, the stop string) where the earliest stop string completes, or None."""
    text = decode(ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return None
    pos, stop = min(hits)
    for j in range(1, len(ids) + 1):  # the first prefix whose text holds the stop string
        if stop in decode(ids[:j]):
            return j, stop
    return len(ids), stop


def messages_key(messages: list[dict]) -> list[bytes]:
    return [orjson.dumps(m, option=orjson.OPT_SORT_KEYS) for m in messages]


class Session:
    """One unit's calls (see the module docstring). `generate(prompt_ids, sampling_params, seed)` is the unit's
    server manager: the actor's pool, its admission, its retries."""

    def __init__(self, sid: str, key: str, renderer: Renderer,
                 generate: SessionGenerate,
                 sampling: dict[str, Any], seed: int | None, prompt_length: int, response_length: int):
        self.sid = sid
        self.key = key
        self.renderer = renderer
        self._generate = generate
        self.sampling = sampling
        self.seed = seed
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.trajectories: list[Trajectory] = []
        self.closed = False
        self.calls = 0  # engine requests asked for (each gets its own seed)
        self.retries_answered = 0
        self.tasks: dict[bytes, asyncio.Task] = {}  # body digest -> its latest call (retries)
        self.idempotent: dict[str, asyncio.Task] = {}
        self.histories: dict[str, list[dict]] = {}  # responses: response id -> its conversation
        self.with_logprobs = bool(sampling.get("logprobs"))
        self.generate_s = 0.0
        self.last_refusal: str | None = None  # "HTTP <status>: <message>" of its newest call answered with an error

    # ---- retries ----
    def call(self, req: ChatRequest, digest: bytes, retry_count: int, idempotency_key: str | None) -> asyncio.Task:
        """The task answering this request: a retry's original, or a new call."""
        first = self.idempotent.get(idempotency_key) if idempotency_key else None
        if first is None and retry_count >= 1:
            first = self.tasks.get(digest)
        if first is not None and not (first.done() and (first.cancelled() or first.exception() is not None)):
            self.retries_answered += 1
            return first  # a retry of a call that failed samples again: nothing was recorded for it
        if self.closed:
            raise SessionClosed(self.sid)
        task = asyncio.get_running_loop().create_task(self.complete(req))
        self.tasks.pop(digest, None)
        self.tasks[digest] = task
        if idempotency_key:
            self.idempotent[idempotency_key] = task
        while len(self.tasks) > RETRY_BOOK_SIZE:
            self.tasks.pop(next(iter(self.tasks)))
        return task

    def close(self) -> None:
        """The unit is done: no call gets in, and calls in flight are dropped (never half-recorded)."""
        self.closed = True
        for task in self.tasks.values():
            task.cancel()

    # ---- matching a call to a trajectory ----
    def _match(self, keys: list[bytes], tools_key: bytes) -> tuple[Trajectory, int] | None:
        """The trajectory and checkpoint this conversation continues: the longest prefix it holds."""
        best = None
        for traj in self.trajectories:
            if traj.tools_key != tools_key:
                continue
            held = messages_key(traj.messages)
            for c in range(len(traj.checkpoints) - 1, -1, -1):
                n = traj.checkpoints[c][0]
                if n < len(keys) and keys[:n] == held[:n] and (best is None or n > best[2]):
                    best = (traj, c, n)
                    break
        return None if best is None else best[:2]

    def _why_new(self, keys: list[bytes], tools_key: bytes) -> str:
        if not self.trajectories:
            return "first call"
        last = max(self.trajectories, key=lambda t: t.last_used)
        if last.tools_key != tools_key:
            return f"tools differ from trajectory {last.number}'s"
        held = messages_key(last.messages)
        for i, (a, b) in enumerate(zip(keys, held)):
            if a != b:
                return f"history edited: message {i} ({orjson.loads(b)['role']}) differs from trajectory {last.number}'s"
        return f"history edited: {len(keys)} messages, trajectory {last.number} holds {len(held)}"

    # ---- one call ----
    async def complete(self, req: ChatRequest) -> Reply:
        if self.closed:
            raise SessionClosed(self.sid)
        messages = req.messages
        if req.previous_response_id is not None:
            if req.previous_response_id not in self.histories:
                raise BadRequest(f"previous_response_id {req.previous_response_id!r} is not a response of this session")
            messages = self.histories[req.previous_response_id] + messages
        if messages[-1]["role"] == "assistant":
            raise BadRequest("the last message is the assistant's: continuing a prefilled reply is not supported")
        tools_key = orjson.dumps(req.tools, option=orjson.OPT_SORT_KEYS)
        keys = messages_key(messages)
        match = self._match(keys, tools_key)
        base: Trajectory | None = None
        if match is not None:
            traj, c = match
            n_msgs = traj.checkpoints[c][0]
            response, mask, lps = traj.at(c)
            runtime = traj.prompt_ids + response
            appended, dropped = self.renderer.extend(traj.messages[:n_msgs], messages, runtime, req.tools)
            if dropped:
                response, mask, lps = response[:-dropped], mask[:-dropped], lps[:-dropped]
            response += appended
            mask += [0] * len(appended)
            lps += [0.0] * len(appended)
            prompt_ids = traj.prompt_ids
            if c == len(traj.checkpoints) - 1 and not traj.busy:
                base = traj
                branch = traj.branch
            else:
                branch = (f"forked from trajectory {traj.number} after its call {c + 1}"
                          + (" (a call on it was in flight)" if c == len(traj.checkpoints) - 1 else ""))
        else:
            branch = self._why_new(keys, tools_key)
            prompt_ids = self.renderer.initial(messages, req.tools)
            if len(prompt_ids) > self.prompt_length:
                raise BadRequest(f"the conversation renders to {len(prompt_ids)} prompt tokens, more than the run's "
                                 f"prompt_length={self.prompt_length} (max_prompt_length)")
            response, mask, lps = [], [], []
        if base is not None:
            base.busy = True
        try:
            choices = await asyncio.gather(*(self._sample(req, prompt_ids + response, len(response))
                                             for _ in range(req.n)))
        finally:
            if base is not None:
                base.busy = False
        if self.closed:
            raise SessionClosed(self.sid)
        reply = Reply(id=f"pg{os.urandom(12).hex()}", model=req.model, choices=[c for c, _ in choices],
                      prompt_tokens=len(prompt_ids) + len(response))
        for k, (choice, unparsed) in enumerate(choices):
            traj = base if (k == 0 and base is not None) else Trajectory(
                number=len(self.trajectories), branch=branch if k == 0 else f"choice {k} of a call with n={req.n}",
                tools_key=tools_key, prompt_ids=list(prompt_ids))
            if traj is not base:
                self.trajectories.append(traj)
            traj.response_ids = response + choice.token_ids
            traj.mask = mask + [1] * len(choice.token_ids)
            traj.logprobs = lps + list(choice.logprobs or [0.0] * len(choice.token_ids))
            traj.messages = messages + [reply_message(choice)]
            traj.checkpoints.append((len(traj.messages), len(traj.response_ids)))
            traj.calls += 1
            traj.unparsed_tool_calls += unparsed
            traj.last_used = self.calls
        self.histories[reply.id] = messages + [reply_message(reply.choices[0])]
        return reply

    def _next_seed(self) -> int | None:
        self.calls += 1
        if self.seed is None:
            return None
        # the first call samples with the unit's own seed (a one-call harness = verl's single-turn loop)
        return self.seed if self.calls == 1 else int.from_bytes(
            hashlib.blake2b(f"{self.seed}:{self.calls}".encode(), digest_size=4).digest(), "little") >> 1

    async def _sample(self, req: ChatRequest, ids: list[int], used: int) -> tuple[Choice, int]:
        """One choice: the engine's ids (cut at a stop string), parsed; and how many tool calls did not parse."""
        budget = self.response_length - used
        max_new = budget if req.max_tokens is None else min(req.max_tokens, budget)
        seed = self._next_seed()
        if max_new <= 0:  # the unit's response budget is spent: nothing more can be sampled into it
            return Choice(content="", tool_calls=[], finish="length", logprobs=[] if self.with_logprobs else None), 0
        params = dict(self.sampling)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                params[name] = getattr(req, name)
        params["max_tokens"] = max_new
        started = time.monotonic()
        out = await self._generate(ids, params, seed)
        self.generate_s += time.monotonic() - started
        token_ids = list(out.token_ids)
        logprobs = list(out.log_probs) if out.log_probs is not None else None
        if self.with_logprobs and logprobs is None:
            raise RuntimeError("the engine returned no log-probs although the run asks for them")
        stop_sequence = None
        cut = _truncate_at_stop(token_ids, req.stop, self.renderer.decode) if req.stop else None
        if cut is not None:
            keep, stop_sequence = cut
            token_ids = token_ids[:keep]
            logprobs = logprobs[:keep] if logprobs is not None else None
            text = self.renderer.decode(token_ids)
            content, calls, unparsed = text[:text.find(stop_sequence)], [], 0
        else:
            content, calls, unparsed = await self.renderer.parse(token_ids, req.tools, req.parse_tools)
        if calls:
            finish = "tool_calls"
        elif cut is not None or (token_ids and token_ids[-1] in self.renderer.end_ids) or len(token_ids) < max_new:
            finish = "stop"
        else:
            finish = "length"
        tool_calls = [ToolCall(id=f"call_{os.urandom(8).hex()}", name=name, arguments=args) for name, args in calls]
        pieces = [self.renderer.tokenizer.decode([t]) for t in token_ids] if req.logprobs else []
        return Choice(content=content, tool_calls=tool_calls, finish=finish, stop_sequence=stop_sequence,
                      token_ids=token_ids, logprobs=logprobs, pieces=pieces), unparsed
