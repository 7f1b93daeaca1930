"""The interface every engine implements (`Engine`, an abstract base class), the one attempt it sends
(`EngineRequest`), how a streamed answer is read (`StreamedAnswer`), and the engines' exceptions.

Every engine pipegen speaks (SGLang and pipegen's CPU server, vLLM, any server someone else runs behind either
protocol) subclasses `Engine` and implements every one of its methods: a method an engine cannot honour answers
for it (`group_limit` 1, `streams` False, `LoadUnavailable`), never by being left out. tests/test_engines.py's
conformance test fails when an engine lacks one.

- Building and reading: `build` turns a `Generation` (engines/request.py: prompt ids, params, the budget, seed,
  pictures) into the body; `renewed` gives it a fresh request id; `finish_type` and `parse` read an answer.
- Supervision's evidence: `load` (running, waiting) and `max_running`; `abort` stops a request on its server.
- Grouping: an engine whose server takes several generations in one HTTP request, each finishing on its own
  (SGLang's batched, streamed `/generate`), says how many a server takes (`group_limit`), builds the one body
  (`group_body`) and reads each member's chunks as they come (`group_chunks`); an engine that cannot answers
  `group_limit` with 1 and the client sends one request per generation.
- Streaming: an engine whose server can stream an answer (`streams`) builds the streamed body (`stream_body`),
  reads its chunks (`stream_chunks`) and makes the answer of them (`streamed`: a `StreamedAnswer`), so the client
  can hand the tokens so far to the generation's `on_tokens` while the answer is generated, and see that the
  engine is making progress on it.

Owns: the shape of an engine. Must never: import an engine (sglang.py, vllm.py import it), or hold
per-request state beyond an `EngineRequest`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Hashable, NamedTuple, Protocol

from pipegen.engines.request import Generation, Keep

if TYPE_CHECKING:
    import aiohttp
    from verl.workers.rollout.replica import TokenOutput


@dataclass
class EngineRequest:
    """One attempt at a generation as sent to one engine: its JSON body, its id, and the generation it asks for."""

    body: dict[str, Any]
    rid: str  # this attempt's id (renewed for every re-send and hedge copy)
    generation: Generation

    @property
    def max_new_tokens(self) -> int:
        return self.generation.max_new_tokens

    @property
    def return_logprob(self) -> bool:
        return self.generation.return_logprob

    @property
    def progress(self) -> Keep | None:
        """Where the answer so far goes while it is generated (None: read whole)."""
        return self.generation.on_tokens


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


class Load(NamedTuple):
    """A server's own account of its requests, over every client."""

    running: int
    waiting: int
    # engine steps recorded so far, where the counts are those of the last recorded step rather than of now (vLLM's
    # gauges); None where the counts are read live when asked (SGLang's schedulers)
    steps: int | None = None


class Engine(ABC):
    """What the actor's client (routing.py, sending.py, attempts.py), admission.py and readiness.py ask of a
    server (the package's docstring tells it)."""

    name: str
    generate_path: str  # POST the body here
    health_path: str  # GET: 200 once the server generates
    streams: bool  # whether `stream_body`, `stream_chunks` and `streamed` work: an answer read as it is generated
    # how long `load` may trail the requests the server holds: supervision looks at an attempt and holds a suspicion
    # this much longer than on an engine whose counts are read live
    load_trails_s: float

    # ---- one generation ----
    @abstractmethod
    def build(self, generation: Generation) -> EngineRequest:
        """The body that asks for `generation` (a fresh request id). An engine that cannot send its pictures raises
        ValueError, never drops them."""

    @abstractmethod
    def renewed(self, request: EngineRequest) -> EngineRequest:
        """The same generation under a fresh request id (a re-send, or a hedge copy)."""

    @abstractmethod
    def finish_type(self, answer: dict[str, Any]) -> str | None:
        """`stop`, `length` or `abort` (None when the answer names none: an unfinished chunk)."""

    @abstractmethod
    def parse(self, answer: dict[str, Any], request: EngineRequest) -> "TokenOutput":
        """The answer as verl's TokenOutput (its stop_reason one of finish_type's names)."""

    # ---- supervision's evidence ----
    @abstractmethod
    async def abort(self, session: "aiohttp.ClientSession", url: str, request: EngineRequest,
                    timeout_s: float) -> None:
        """Ask the server to stop `request`, before the client drops its connection."""

    @abstractmethod
    async def max_running(self, session: "aiohttp.ClientSession", url: str) -> int | None:
        """The server's own limit on requests running at once, if it reports one."""

    @abstractmethod
    async def load(self, session: "aiohttp.ClientSession", url: str) -> Load:
        """Its requests running and waiting, over every client of the server. Raises LoadUnavailable when the
        server does not report it."""

    # ---- grouping ----
    @abstractmethod
    async def group_limit(self, session: "aiohttp.ClientSession", url: str) -> int:
        """How many generations this server takes in one request, each answered as it finishes (1: none)."""

    @abstractmethod
    def group_key(self, request: EngineRequest) -> Hashable | None:
        """Requests with equal keys may share one grouped request; None: this one goes alone."""

    @abstractmethod
    def group_body(self, requests: list[EngineRequest], intervals: list[int]) -> dict[str, Any]:
        """One body for several generations (their ids, sampling params, seeds and request ids kept), each member
        streaming a chunk every `intervals[i]` tokens."""

    @abstractmethod
    def group_chunks(self, resp: "aiohttp.ClientResponse") -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """(position in the group, chunk) for each chunk of each member as it comes; a member's last chunk has a
        finish type. Raises GroupRefused when the server refused the group as a whole (each member is then sent
        on its own)."""

    # ---- streaming ----
    @abstractmethod
    def stream_body(self, request: EngineRequest, interval: int) -> dict[str, Any]:
        """The body that asks for `request` streamed, a chunk every `interval` tokens (only where `streams`)."""

    @abstractmethod
    def stream_chunks(self, resp: "aiohttp.ClientResponse") -> AsyncIterator[dict[str, Any]]:
        """A streamed answer's chunks in order (only where `streams`); the last has a finish type. An error
        chunk raises StreamError."""

    @abstractmethod
    def streamed(self, request: EngineRequest) -> StreamedAnswer:
        """What reads `request`'s streamed chunks into its answer (only where `streams`)."""


class StreamError(Exception):
    """An error chunk inside a streamed answer (SGLang sends its 400s so, under HTTP 200); `status` its code."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class GroupRefused(Exception):
    """A grouped request the server refused as a whole (a member's validation error): send each alone."""


class LoadUnavailable(Exception):
    """The server has no load endpoint: automatic concurrency keeps its start value for it, and supervision judges
    its requests by the clock alone."""


class NotStreamed(ValueError):
    """Asked to stream on an engine that does not (`Engine.streams` is False)."""
