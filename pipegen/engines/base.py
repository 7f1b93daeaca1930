"""The interface every engine implements (`Engine`), the one generation it sends (`EngineRequest`), and
`LoadUnavailable` (a server that reports no load).

Grouping: an engine whose server takes several generations in one HTTP request, each finishing on its own
(SGLang's batched, streamed `/generate`), says how many a server takes (`group_limit`), builds the one body
(`group_body`) and reads each member's answer as it finishes (`group_answers`); an engine that cannot answers
`group_limit` with 1 and the client sends one request per generation.

Streaming: an engine whose server can stream one answer (`streams`) builds the streamed body (`stream_body`), reads
its chunks (`stream_chunks`) and makes the answer of them (`streamed`: a `StreamedAnswer`), so the client can hand
the tokens so far to `EngineRequest.progress` while the answer is generated (actor/continuation.py keeps them).

Owns: the shape of an engine. Must never: import an engine (sglang.py, vllm.py import it), or hold
per-request state beyond an `EngineRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Hashable, Protocol

if TYPE_CHECKING:
    import aiohttp

    from pipegen.engines.request import TokenBudget


@dataclass
class EngineRequest:
    """One generation as sent to one engine: the JSON body and what the client must know about it."""

    body: dict[str, Any]
    rid: str  # this attempt's id (renewed for every re-send and hedge copy)
    max_new_tokens: int
    return_logprob: bool
    # where the answer so far goes while it is generated (actor/continuation.py keeps it on disk): called with
    # the attempt's rid, its ids so far and their log-probs (None without); None: the answer is read whole
    progress: Callable[[str, list[int], "list[float] | None"], None] | None = None


class Engine(Protocol):
    """What the actor's client.py, admission.py and readiness.py ask of a server (the package's docstring tells it)."""

    name: str
    generate_path: str  # POST the body here
    health_path: str  # GET: 200 once the server generates
    streams: bool  # whether `stream_body` and `stream_chunks` work: an answer read as it is generated

    def stream_body(self, request: EngineRequest) -> dict[str, Any]:
        """The body that asks for `request` streamed (only where `streams`)."""
        ...

    def stream_chunks(self, resp: "aiohttp.ClientResponse") -> AsyncIterator[dict[str, Any]]:
        """A streamed answer's chunks in order (only where `streams`); the last has a finish reason. An error
        chunk raises StreamError."""
        ...

    def streamed(self, request: EngineRequest) -> "StreamedAnswer":
        """What reads `request`'s streamed chunks into its answer (only where `streams`)."""
        ...


class StreamedAnswer(Protocol):
    """One streamed answer, read chunk by chunk."""

    ids: list[int]  # the answer's ids so far
    logprobs: "list[float] | None"  # theirs (None when the request asked for none)

    def add(self, chunk: dict[str, Any]) -> None:
        """An unfinished chunk."""
        ...

    def whole(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The last chunk as the whole answer, as an unstreamed request would have it."""
        ...

    def build(self, prompt_ids: list[int], sampling_params: dict[str, Any], limits: "TokenBudget",
              sampling_seed: int | None, image_data: list[str] | None = None) -> EngineRequest:
        """image_data: the prompt's pictures as PNG data URLs (run/pictures.py); an engine that cannot send them
        raises ValueError, never drops them."""
        ...

    def renewed(self, request: EngineRequest) -> EngineRequest:
        """The same generation under a fresh request id (a re-send, or a hedge copy)."""
        ...

    def finish_type(self, answer: dict[str, Any]) -> str | None:
        """`stop`, `length` or `abort` (None when the answer names none)."""
        ...

    def parse(self, answer: dict[str, Any], request: EngineRequest):
        """The answer as verl's TokenOutput (its stop_reason one of finish_type's names)."""
        ...

    async def abort(self, session: "aiohttp.ClientSession", url: str, request: EngineRequest,
                    timeout_s: float) -> None:
        """Ask the server to stop `request`, before the client drops its connection."""
        ...

    async def max_running(self, session: "aiohttp.ClientSession", url: str) -> int | None:
        """The server's own limit on requests running at once, if it reports one."""
        ...

    async def load(self, session: "aiohttp.ClientSession", url: str) -> tuple[int, int]:
        """(running, waiting) now. Raises LoadUnavailable when the server does not report it."""
        ...

    async def group_limit(self, session: "aiohttp.ClientSession", url: str) -> int:
        """How many generations this server takes in one request, each answered as it finishes (1: none)."""
        ...

    def group_key(self, request: EngineRequest) -> Hashable | None:
        """Requests with equal keys may share one grouped request; None: this one goes alone."""
        ...

    def group_body(self, requests: list[EngineRequest]) -> dict[str, Any]:
        """One body for several generations (their ids, sampling params, seeds and request ids kept)."""
        ...

    def group_answers(self, resp: "aiohttp.ClientResponse") -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """(position in the group, finished answer) for each member as it finishes. Raises GroupRefused when
        the server refused the group as a whole (each member is then sent on its own)."""
        ...


class StreamError(Exception):
    """An error chunk inside a streamed answer (SGLang sends its 400s so, under HTTP 200); `status` its code."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class GroupRefused(Exception):
    """A grouped request the server refused as a whole (a member's validation error): send each alone."""


class LoadUnavailable(Exception):
    """The server has no load endpoint: automatic concurrency keeps its start value for it."""
