"""A unit's model calls, kept so that a crash costs little of the answers in flight: a long answer's tokens are kept
as they come (or chunk by chunk) and continued, and a rerun of a unit answers the calls it asks as before from the
record.

Per unit (`UnitProgress`, held by the unit's server manager in rollout.py):
- **long answers**: an answer whose token budget exceeds `actors.progress_chunk_tokens` keeps its tokens in the
  unit's progress file (run/unit_progress.py) while it is generated.
  - On an engine that streams (SGLang, pipegen's CPU server: `Engine.streams`) it is one request, streamed: each
    chunk the engine sends (the answer so far) writes its new tokens as one line (`_keeper`), so a crash loses what
    came after the engine's last chunk (SGLang: up to 1/32 of the budget or 64 tokens, engines/sglang.py's
    `stream_interval`; the CPU server: at most 50 ms of generation). An attempt the client re-sends writes from the request's start
    again.
  - On one that does not (vLLM) it is asked for in chunks of that many tokens, each request the prompt plus the
    ids so far with `max_new_tokens` = what is left of the chunk and of the answer's budget (the budget verl's rule
    gives the whole answer, engines/request.py). A chunk that ends before its budget, or with a finish other than
    `length`, ends the answer, as the same stop would end an uninterrupted answer; a chunk that fills its budget is
    written before the next chunk is asked. A crash loses at most the chunk in flight.
  The first request keeps the call's seed (an answer shorter than the threshold is today's answer); a continuation
  keeps it too where the engine keys its draws on (seed, position) (the CPU server; SGLang deterministic), so it
  draws exactly what the uninterrupted answer drew; elsewhere (vLLM) it gets a seed derived from the call's and its
  first token's position, so it does not replay the earlier random draws, and its row says `resumed`.
- **replay**: on a unit's next start, its calls are compared in order with the record: a call whose request
  (its digest) equals the recorded call's is answered from the record when that call was finished (no engine
  work; the same ids and log-probs), or continued from its recorded tokens when it was not. From the first call
  that differs (or is not recorded) every call goes to the engine, and the record beyond it is dropped.
- **what is not chunked**: an answer asked with a penalty or minimum over its own tokens, or with stop strings
  (`continuable`), goes in one request as before: a continuation would not see them across the boundary.
- **cost**: a unit with one short call writes nothing (one failed open() at its start, no unlink() at its end). A
  finished call is written when the unit makes its next call (the last call's answer is the unit's shard line). A
  streamed answer costs its chunks' parsing and one line each; an answer the CPU server generates within 50 ms is one
  chunk. Each chunk past the first of a chunked answer is one more request: its HTTP round, the prompt plus the ids
  so far sent, checked and taken in again by the engine (from its prefix cache), and its line written: ~0.6 ms of
  the actor's CPU and ~0.4 ms of the bench's instant fake server's, negligible beside a GPU's seconds a chunk
  (BENCHMARKS row 14).

Owns: keeping a long answer's tokens (streamed or chunked), what a resumed call is answered with, and what it tells
the row (`resumed`, `resumed_at_token`, `replayed_calls`). Must never: re-tokenize, send a chunk before the previous
one is durable, let a whole answer exceed the budget an uninterrupted request would have had.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from pipegen.engines.request import Generation, Keep, TokenBudget
from pipegen.run.pictures import image_data_url
from pipegen.run.unit_progress import ProgressFile, RecordedCall, parse_calls, read_progress, request_digest

if TYPE_CHECKING:
    from verl.workers.rollout.replica import TokenOutput

# one engine request (the unit's server manager sends it through the actor's ServerPool) -> verl's TokenOutput
Send = Callable[[Generation], Awaitable["TokenOutput"]]

# the row's fields for a unit that continued from its record (AgentLoopOutput.extra_fields -> verl's non_tensor_batch)
RESUMED = "resumed"
RESUMED_AT_TOKEN = "resumed_at_token"
REPLAYED_CALLS = "replayed_calls"


# what an engine applies to the answer so far only: a chunk would start them afresh, so such answers go in one request
# (verl sends repetition_penalty=1.0 and none of the others)
NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_new_tokens": 0,
           "min_tokens": 0}


def continuable(params: dict[str, Any]) -> bool:
    """Whether an answer asked with these params may be generated in chunks and continued: no penalty or minimum
    over the answer's own tokens, no stop strings (a string may straddle two chunks); stop token ids are fine."""
    if params.get("stop"):
        return False
    return all(params.get(k) in (None, v) for k, v in NEUTRAL.items())


def token_output(ids: list[int], logprobs: list[float] | None, stop_reason: str | None, extra: dict | None = None):
    """verl's TokenOutput of ids and log-probs already checked (the engine's answers, which TokenOutput validated as
    they came, or the record's, read as ints and floats): not validated again (~70 us at 2k tokens)."""
    from verl.workers.rollout.replica import TokenOutput

    return TokenOutput.model_construct(token_ids=ids, log_probs=logprobs, stop_reason=stop_reason,
                                       extra_fields=extra if extra is not None else
                                       {"global_steps": None, "min_global_steps": None, "max_global_steps": None})


class UnitProgress:
    """One unit's calls against its record (run/unit_progress.py's file at `path`)."""

    def __init__(self, path: Path, chunk_tokens: int, limits: TokenBudget, streams: bool = False,
                 divide_tokens: int = 0, lengths: Callable[[int, bool], None] | None = None,
                 stop_ids: frozenset[int] = frozenset()):
        data = read_progress(path)
        # the model's EOS ids: an engine checks the length before them (SGLang's order), so a chunk whose last token
        # is one says `length`, where the whole answer would have stopped there
        self.stop_ids = stop_ids
        self.divide_tokens = int(divide_tokens)  # divided answers: at most this many new tokens a request (0: off)
        self.lengths = lengths  # told (tokens so far, finished) as an answer grows: the admission's evidence
        self.recorded = parse_calls(data or b"")
        self.file = ProgressFile(path, exists=data is not None)
        self.chunk_tokens = int(chunk_tokens)
        self.streams = streams  # the engine streams answers: a long one is one request, its tokens kept as they come
        self.limits = limits
        self.calls = 0  # calls asked so far
        self.live = not self.recorded  # True from the first call the record cannot answer
        # the last finished call, written when the next call starts: (call, its piece, how to name its request)
        self.pending: tuple[int, RecordedCall, Callable[[], str]] | None = None
        self.replayed = 0  # calls answered from the record
        self.resumed_at: int | None = None  # the answer token a recorded unfinished call continued from
        self.tokens_generated = 0  # tokens the engine generated for this unit (the bench's cost measure)

    @property
    def resumed(self) -> bool:
        return self.replayed > 0 or self.resumed_at is not None

    def row_fields(self) -> dict[str, Any]:
        """What a resumed unit's trajectories carry in extra_fields ({} for a unit that started afresh)."""
        if not self.resumed:
            return {}
        return {RESUMED: True, RESUMED_AT_TOKEN: self.resumed_at or 0, REPLAYED_CALLS: self.replayed}

    async def generate(self, send: Send, prompt_ids: list[int], sampling_params: dict[str, Any], seed: int | None,
                       image_data: list | None = None) -> TokenOutput:
        """One model call of the unit: from the record, continued from it, or from the engine in chunks."""
        call = self.calls
        self.calls += 1
        if self.pending is not None:  # the previous call is finished: durable before this one starts
            done, piece, name = self.pending
            piece.digest = piece.digest or name()
            self.file.append(done, piece)
            self.pending = None
        # the request's name costs ~10 us at 1k tokens: computed only where a record is read or written (a unit of
        # one short call never needs it); a loop may extend prompt_ids in place after the call, hence its length now
        asked = len(prompt_ids)

        def name() -> str:
            return request_digest(prompt_ids[:asked], sampling_params, seed, image_data)

        digest = "" if self.live else name()
        ids: list[int] = []
        logprobs: list[float] | None = None
        if not self.live:
            record = self.recorded[call] if call < len(self.recorded) else None
            if record is None or record.digest != digest:
                self.live = True
                if call < len(self.recorded):  # the rerun asks differently: the rest of the record is not its
                    self.file.keep_only(self.recorded[:call])
            elif record.end is not None:
                self.replayed += 1
                return token_output(list(record.ids), None if record.logprobs is None else list(record.logprobs),
                                    record.end)
            else:  # the call the crash interrupted: continue it from its durable tokens
                self.live = True
                ids, logprobs = list(record.ids), record.logprobs
                self.resumed_at = len(ids)
        pictures = [i if isinstance(i, str) else image_data_url(i) for i in image_data] if image_data else None
        # the whole answer's request, its budget computed once (verl's rule); a chunk or a continuation is its rest
        call_gen = Generation.of(prompt_ids, sampling_params, self.limits, seed, pictures)
        budget = call_gen.max_new_tokens
        keeps = 0 < self.chunk_tokens < budget  # a long answer: its tokens are kept as they come
        divided = 0 < self.divide_tokens < budget
        if not ids and (not (keeps or divided) or not continuable(call_gen.params)):
            out = await send(call_gen)  # today's request, unchanged
            self.tokens_generated += len(out.token_ids)
            self._tell(len(out.token_ids), True)
            # copies: a loop may extend the lists it was given before the next call writes this one
            self.pending = (call, RecordedCall(digest, list(out.token_ids),
                                               None if out.log_probs is None else list(out.log_probs),
                                               out.stop_reason), name)
            return out
        if logprobs is not None:
            logprobs = list(logprobs)
        durable = len(ids)
        out = None
        while True:
            # streamed, chunking off (0), or a recorded unfinished call: the rest of the answer in one request;
            # divided answers: at most divide_tokens of it
            want = budget - len(ids)
            if not self.streams and self.chunk_tokens > 0:
                want = min(want, self.chunk_tokens)
            if self.divide_tokens > 0:
                want = min(want, self.divide_tokens)
            if want <= 0:  # resumed exactly at the end of the budget
                stop_reason = "length"
                break
            if self.streams:
                digest = digest or name()
            keep = self._keeper(call, digest, len(ids), durable=keeps) if self.streams else None
            rest = call_gen.continued(ids)
            out = await send(dataclasses.replace(rest, max_new_tokens=want, on_tokens=keep))
            got = out.token_ids
            self.tokens_generated += len(got)
            if not ids and logprobs is None and out.log_probs is not None:
                logprobs = []
            ids += got
            if logprobs is not None:
                logprobs += out.log_probs or []
            stop_reason = out.stop_reason
            if stop_reason != "length" or len(got) < want or len(ids) >= budget:
                break
            if got and self._stops(got[-1], call_gen.params):  # the chunk ended on EOS: so does the answer
                stop_reason = "stop"
                break
            self._tell(len(ids), False)
            # the answer goes on: this chunk is durable before the next one is asked (kept answers only)
            if keeps:
                digest = digest or name()
                self.file.append(call, RecordedCall(digest, ids[durable:],
                                                    None if logprobs is None else logprobs[durable:], None,
                                                    at=durable))
                durable = len(ids)
        self._tell(len(ids), True)
        # (a streamed request's lines are superseded from where it started: its last attempt may not be the one kept)
        self.pending = (call, RecordedCall(digest, ids[durable:], None if logprobs is None else logprobs[durable:],
                                           stop_reason, at=durable), name)
        return token_output(ids, logprobs, stop_reason, None if out is None else out.extra_fields)

    def _stops(self, token: int, params: dict[str, Any]) -> bool:
        """Whether an answer ends at `token` (EOS or one of the request's stop ids, unless it ignores EOS)."""
        if params.get("ignore_eos"):
            return False
        return token in self.stop_ids or token in (params.get("stop_token_ids") or ())

    def _tell(self, tokens: int, finished: bool) -> None:
        if self.lengths is not None:
            self.lengths(tokens, finished)

    def _keeper(self, call: int, digest: str, start: int, durable: bool = True) -> Keep:
        """Where a streamed request's tokens so far go: each new piece one line, at its place in the answer (the
        request starts at answer token `start`), and their count to the admission's evidence. A re-sent attempt
        starts from `start` again, superseding what an earlier attempt of the request wrote. `durable` False (a
        divided answer within the keeping threshold): the count only."""
        attempt, written = "", 0

        def keep(rid: str, got: list[int], logprobs: list[float] | None) -> None:
            nonlocal attempt, written
            if rid != attempt:
                attempt, written = rid, 0
            if len(got) <= written:
                return
            if durable:
                self.file.append(call, RecordedCall(digest, got[written:],
                                                    None if logprobs is None else logprobs[written:], None,
                                                    at=start + written))
            written = len(got)
            self._tell(start + written, False)

        return keep

    def close(self) -> None:
        self.file.close()

    def discard(self) -> None:
        """The unit's line is in its shard: its record goes."""
        self.pending = None
        self.file.discard()
