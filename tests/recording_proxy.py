"""A transparent recording proxy for tests: forwards every request to one upstream SGLang-protocol server
and appends one JSON line per POST /generate to a log (what the server was asked and what it answered).

    python tests/recording_proxy.py --upstream http://127.0.0.1:PORT --port-file F --log FILE

Log line: {"t", "rid", "seed" (sampling_seed), "input_ids", "max_new_tokens", "status", "output_ids",
"logprobs", "finish"}; `status` is null when the client went away before the answer (timeouts).
Tests use it to count requests per unit (sampling_seed identifies the unit) and to check that records
are token-exact against what the server really produced. Binds 127.0.0.1 only.
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
    def __init__(self, upstream: str, log_path: str):
        self.upstream = upstream.rstrip("/")
        self.log = open(log_path, "ab", buffering=0)
        self.session: aiohttp.ClientSession | None = None

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
        try:
            async with self.session.post(f"{self.upstream}/generate", data=raw,
                                         headers={"Content-Type": "application/json"}) as resp:
                out = await resp.read()
                status, ctype = resp.status, resp.content_type
        except asyncio.CancelledError:
            self.write(entry)  # the client gave up (its timeout): the upstream saw the request
            raise
        except aiohttp.ClientError as e:
            entry["status"] = 502
            self.write(entry)
            return web.Response(status=502, text=str(e))
        entry["status"] = status
        if status == 200:
            ans = orjson.loads(out)
            meta = ans.get("meta_info") or {}
            entry["output_ids"] = ans.get("output_ids")
            entry["logprobs"] = [t[0] for t in meta.get("output_token_logprobs") or []]
            entry["finish"] = (meta.get("finish_reason") or {}).get("type")
        self.write(entry)
        return web.Response(status=status, body=out, content_type=ctype)

    async def passthrough(self, request: web.Request) -> web.Response:
        url = f"{self.upstream}{request.rel_url}"
        async with self.session.request(request.method, url, data=await request.read()) as resp:
            return web.Response(status=resp.status, body=await resp.read(), content_type=resp.content_type)


async def serve(args) -> None:
    proxy = Proxy(args.upstream, args.log)
    proxy.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=None))
    app = web.Application(client_max_size=512 * 1024 * 1024)
    app.router.add_post("/generate", proxy.generate)
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
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
