"""The gateway's HTTP server: one per actor process, on loopback, on a port the OS picks, started when the
actor's first `external` unit opens a session.

Routes (every one under a session's URL, `http://HOST:PORT/s/<session>/v1`):
- `POST .../v1/chat/completions`, `POST .../v1/responses` (OpenAI), `POST .../v1/messages` (Anthropic: its SDK
  takes the base URL without `/v1`), `GET .../v1/models` (frameworks that list models first).
Who gets in: the session id is unguessable, and its key (`Authorization: Bearer KEY` or Anthropic's
`x-api-key`) is checked in constant time. An unknown or finished session is a 404, a wrong key a 401: neither
reaches an engine or a trajectory.

Owns: the sessions of one actor, the server's lifetime, the mapping of failures to HTTP statuses.
Must never: listen beyond `external.host`, answer a call without its session's key, or record a call itself
(session.py does).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
from typing import Any, Callable

import orjson
from aiohttp import web
from cachetools import FIFOCache

from pipegen.gateway.dialects import DIALECTS, BadRequest
from pipegen.gateway.session import Session, SessionClosed
from pipegen.config.schema import External

log = logging.getLogger("pipegen.gateway")

FINISHED_KEPT = 100_000  # finished session ids remembered (their calls are told "finished", not "unknown")


class Gateway:
    """The actor's gateway server and its open sessions."""

    def __init__(self, host: str = External.host):
        self.host = host
        self.port: int | None = None
        self.sessions: dict[str, Session] = {}
        self.finished: FIFOCache = FIFOCache(maxsize=FINISHED_KEPT)  # the oldest finished id goes first
        self.refused = 0  # calls refused for their session or key
        self._runner: web.AppRunner | None = None
        self._starting: asyncio.Lock | None = None

    async def start(self) -> None:
        """Start serving (once; later calls return at once)."""
        if self._runner is not None:
            return
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._runner is not None:
                return
            app = web.Application(client_max_size=64 << 20)
            for dialect, path in (("chat", "chat/completions"), ("responses", "responses"),
                                  ("messages", "messages")):
                app.router.add_post(f"/s/{{sid}}/v1/{path}", self._handler(dialect))
            app.router.add_get("/s/{sid}/v1/models", self._models)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, self.host, 0)
            await site.start()
            self.port = runner.addresses[0][1]
            self._runner = runner
            log.info("gateway for external agents listening on http://%s:%d", self.host, self.port)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- sessions ----
    def open(self, make: Callable[[str, str], Session]) -> Session:
        sid = secrets.token_urlsafe(18)
        session = make(sid, f"pg-{secrets.token_urlsafe(32)}")
        self.sessions[sid] = session
        return session

    def finish(self, session: Session) -> None:
        session.close()
        self.sessions.pop(session.sid, None)
        self.finished[session.sid] = None

    def base_url(self, session: Session) -> str:
        """The session's OpenAI base URL (ends in /v1; Anthropic's is the same without it)."""
        return f"http://{self.host}:{self.port}/s/{session.sid}/v1"

    # ---- HTTP ----
    def _session(self, request: web.Request, dialect: str) -> Session | web.Response:
        sid = request.match_info["sid"]
        session = self.sessions.get(sid)
        if session is None:
            self.refused += 1
            why = "finished: its unit's trajectories are final" if sid in self.finished else "unknown"
            return _error(dialect, 404, f"session {why}")
        auth = request.headers.get("Authorization", "")
        key = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(key.encode(), session.key.encode()):
            self.refused += 1
            return _error(dialect, 401, "wrong API key for this session")
        return session

    async def _models(self, request: web.Request) -> web.Response:
        session = self._session(request, "chat")
        if isinstance(session, web.Response):
            return session
        return web.json_response({"object": "list", "data": [{"id": "pipegen", "object": "model", "created": 0,
                                                              "owned_by": "pipegen"}]}, dumps=_dumps)

    @staticmethod
    def _refuse(session: Session, dialect: str, status: int, message: str) -> web.Response:
        """A call of a live session answered with an error: logged, and kept as the session's last refusal
        (a harness that swallows it and fails names it: gateway/loop.py)."""
        log.warning("gateway refused a call (HTTP %d): %s", status, message)
        session.last_refusal = f"HTTP {status}: {message}"
        return _error(dialect, status, message)

    def _handler(self, dialect: str):
        speaks = DIALECTS[dialect]
        parse, whole, stream = speaks.read, speaks.whole, speaks.stream

        async def handle(request: web.Request) -> web.StreamResponse:
            session = self._session(request, dialect)
            if isinstance(session, web.Response):
                return session
            raw = await request.read()
            try:
                body = orjson.loads(raw)
                if not isinstance(body, dict):
                    raise BadRequest("the request body must be a JSON object")
                req = parse(body)
                retry = request.headers.get("x-stainless-retry-count", "0")
                task = session.call(req, hashlib.blake2b(dialect.encode() + raw, digest_size=16).digest(),
                                    int(retry) if retry.isdigit() else 0, request.headers.get("Idempotency-Key"))
                reply = await asyncio.shield(task)  # a client that hangs up does not cancel the call
            except (BadRequest, orjson.JSONDecodeError) as e:
                return self._refuse(session, dialect, 400, str(e))
            except (SessionClosed, asyncio.CancelledError):
                if session.closed:
                    return _error(dialect, 404, "session finished: its unit's trajectories are final")
                raise
            except Exception as e:  # the engine gave up (RetriesExhausted, RequestRejected): the harness may retry
                return self._refuse(session, dialect, 502, f"{type(e).__name__}: {e}")
            if not req.stream:
                return web.json_response(whole(reply, req), dumps=_dumps)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            for event in stream(reply, req):
                await resp.write(event)
            await resp.write_eof()
            return resp

        return handle


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def _error(dialect: str, status: int, message: str) -> web.Response:
    return web.json_response(DIALECTS[dialect].error(status, message), status=status, dumps=_dumps)
