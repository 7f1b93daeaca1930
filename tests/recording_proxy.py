"""A transparent recording proxy for tests: forwards every request to one upstream server and appends one
JSON line per generation request to a log (what the server was asked and what it answered): SGLang's
POST /generate and vLLM's POST /v1/completions alike.

    python tests/recording_proxy.py --upstream http://127.0.0.1:PORT --port-file F --log FILE [--stall-first K]

A streamed /generate (`stream: true`, as pipegen sends every SGLang request) is streamed through chunk by chunk as
it comes, and logged once its last chunk passed (its chunks joined, whether each holds the answer so far or only its
new tokens).

Log line: {"t", "rid", "seed" (the unit's sampling seed), "input_ids", "max_new_tokens", "status",
"output_ids", "logprobs", "finish", "stalled"}; `status` is null when the client went away before the
answer (timeouts, stall aborts). Tests use it to count requests per unit (the seed identifies the unit)
and to check that records are token-exact against what the server really produced.

--stall-first K (vLLM): the first K generation requests are forwarded asking for the whole context with
`ignore_eos`, so the server really works on them far past any stall deadline; the client's abort (it
closes the connection) closes the upstream connection too, as it would reach a server directly.
Binds 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import aiohttp
import orjson
from aiohttp import web


class Proxy:
    def __init__(self, upstream: str, log_path: str, stall_first: int = 0):
        self.upstream = upstream.rstrip("/")
        self.log = open(log_path, "ab", buffering=0)
        self.session: aiohttp.ClientSession | None = None
        self.stall_left = stall_first
        self.context_len: int | None = None

    def write(self, entry: dict) -> None:
        self.log.write(orjson.dumps(entry) + b"\n")

    async def generate(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = {}
        params = body.get("sampling_params") or {}
        entry = {"t": time.time(), "rid": body.get("rid"), "seed": params.get("sampling_seed"),
                 "input_ids": body.get("input_ids"), "max_new_tokens": params.get("max_new_tokens"),
                 "status": None, "output_ids": None, "logprobs": None, "finish": None}
        read = lambda ans: {  # noqa: E731
            "output_ids": ans.get("output_ids"),
            "logprobs": [t[0] for t in (ans.get("meta_info") or {}).get("output_token_logprobs") or []],
            "finish": ((ans.get("meta_info") or {}).get("finish_reason") or {}).get("type")}
        if body.get("stream") and isinstance(body.get("input_ids", [None])[0], int):
            return await self.stream("/generate", raw, entry, request, read)
        return await self.forward("/generate", raw, entry, read)

    async def stream(self, path: str, raw: bytes, entry: dict, request: web.Request, read_answer):
        """A single streamed generation: each upstream read passed on at once; logged from its joined chunks."""
        from pipegen.engines.sglang import StreamedAnswer

        answer, events, buffer, out = StreamedAnswer(True), [], b"", None
        try:
            async with self.session.post(f"{self.upstream}{path}", data=raw,
                                         headers={"Content-Type": "application/json"}) as resp:
                entry["status"] = resp.status
                if resp.status != 200 or resp.content_type != "text/event-stream":
                    body = await resp.read()
                    if resp.status == 200:
                        entry.update(read_answer(orjson.loads(body)))
                    self.write(entry)
                    return web.Response(status=resp.status, body=body, content_type=resp.content_type)
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                async for data in resp.content.iter_any():
                    await out.write(data)
                    buffer += data
                    *done, buffer = buffer.split(b"\n\n")
                    events += [e[5:].strip() for e in done if e.startswith(b"data:")]
        except asyncio.CancelledError:
            # the client went away: after the last chunk (it reads no further), or before (an abort; the upstream
            # connection closes with this block)
            self.write(self.joined(entry, events, answer, read_answer))
            raise
        except aiohttp.ClientError as e:
            entry["status"] = 502
            self.write(entry)
            if out is None:
                return web.Response(status=502, text=str(e))
            raise
        self.write(self.joined(entry, events, answer, read_answer))
        await out.write_eof()
        return out

    async def forward(self, path: str, raw: bytes, entry: dict, read_answer) -> web.Response:
        """POST raw upstream, log `entry` with what came back (read_answer: the answer -> the entry's fields)."""
        try:
            async with self.session.post(f"{self.upstream}{path}", data=raw,
                                         headers={"Content-Type": "application/json"}) as resp:
                out = await resp.read()
                status, ctype = resp.status, resp.content_type
        except asyncio.CancelledError:
            # the client gave up (a timeout, an abort): the upstream saw the request, and leaving this block
            # closed the upstream connection too, as the client's own close would reach a server directly
            self.write(entry)
            raise
        except aiohttp.ClientError as e:
            entry["status"] = 502
            self.write(entry)
            return web.Response(status=502, text=str(e))
        entry["status"] = status
        if status == 200:
            entry.update(read_answer(orjson.loads(out)))
        self.write(entry)
        return web.Response(status=status, body=out, content_type=ctype)

    @staticmethod
    def joined(entry: dict, events: list[bytes], answer, read_answer) -> dict:
        """The entry of a streamed answer from its events so far: answered when its last chunk came, else none."""
        chunks = [orjson.loads(e) for e in events if e != b"[DONE]"]
        if not chunks or not (chunks[-1].get("meta_info") or {}).get("finish_reason"):
            return {**entry, "status": None}
        for chunk in chunks[:-1]:
            answer.add(chunk)
        return {**entry, "status": 200, **read_answer(answer.whole(chunks[-1]))}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        entry = {"t": time.time(), "rid": body.get("request_id"), "seed": body.get("seed"),
                 "input_ids": body.get("prompt"), "max_new_tokens": body.get("max_tokens"), "status": None,
                 "output_ids": None, "logprobs": None, "finish": None, "stalled": False}
        if self.stall_left > 0:
            self.stall_left -= 1
            if self.context_len is None:
                async with self.session.get(f"{self.upstream}/v1/models") as resp:
                    self.context_len = int((await resp.json())["data"][0]["max_model_len"])
            body.update(max_tokens=self.context_len - len(body["prompt"]), ignore_eos=True)
            raw, entry["stalled"] = orjson.dumps(body), True
        return await self.forward("/v1/completions", raw, entry, lambda ans: {
            "output_ids": ans["choices"][0].get("token_ids"), "finish": ans["choices"][0].get("finish_reason"),
            "logprobs": (ans["choices"][0].get("logprobs") or {}).get("token_logprobs")})

    async def passthrough(self, request: web.Request) -> web.Response:
        url = f"{self.upstream}{request.rel_url}"
        async with self.session.request(request.method, url, data=await request.read()) as resp:
            return web.Response(status=resp.status, body=await resp.read(), content_type=resp.content_type)


async def serve(args) -> None:
    proxy = Proxy(args.upstream, args.log, args.stall_first)
    proxy.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=None))
    app = web.Application(client_max_size=512 * 1024 * 1024)
    app.router.add_post("/generate", proxy.generate)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_route("*", "/{tail:.*}", proxy.passthrough)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    tmp = f"{args.port_file}.tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, args.port_file)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", required=True)
    p.add_argument("--port-file", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--stall-first", type=int, default=0)
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
