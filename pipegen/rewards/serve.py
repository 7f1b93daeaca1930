"""`python -m pipegen.rewards.serve [--path my_reward.py] [--name compute_score] [--port 8000]`: a verl-style
reward function (verl's default_compute_score without --path) served as an HTTP verifier, for
`reward.verifier_url=http://HOST:PORT/score`: scoring then runs where this runs (another machine, its own
cores), not in the actors.

It speaks protocol.py's JSON; each sample is scored as an actor would score it (local.py: inline when
cheap, else in --processes processes); a sample whose function raises is answered {"error": ...}, which the
actor records as that unit's failure.

Owns: the server's command line and its one route.
Must never: bind anything but loopback unless --host says so, or answer a score the function did not return.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import orjson

from pipegen.rewards.local import FunctionReward
from pipegen.rewards.protocol import RewardFailure, ScoreRequest
from pipegen.config.schema import Reward, RewardSpec
from pipegen.run.atomic import replace_unsynced

log = logging.getLogger("pipegen.rewards.serve")
ROUTE = "/score"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipegen.rewards.serve",
                                description="serve a verl reward function as pipegen's HTTP verifier")
    p.add_argument("--path", default=None, help="the .py file (or pkg://module) with the function; default: "
                                                "verl's default_compute_score")
    p.add_argument("--name", default=RewardSpec.name, help="the function's name (default: %(default)s)")
    p.add_argument("--reward-kwargs", default="{}", help="JSON object of extra keyword arguments for every call")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one; see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving (atomic)")
    p.add_argument("--processes", type=int, default=Reward().processes,
                   help="processes for a function slower than 0.5 ms a sample (default: %(default)s, as reward.processes)")
    p.add_argument("--timeout-s", type=float, default=Reward().timeout_s,
                   help="seconds a sample may take; then it is answered {\"error\": ...} (default: %(default)s, as "
                        "reward.timeout_s; keep reward.verifier_timeout_s above a batch's worth)")
    return p.parse_args(argv)


async def answer(reward: FunctionReward, item: dict) -> object:
    try:
        request = ScoreRequest(data_source=item.get("data_source"), solution_str=item["solution_str"],
                               ground_truth=item.get("ground_truth"), extra_info=dict(item.get("extra_info") or {}))
        return await reward.score(request)
    except (RewardFailure, NotImplementedError, KeyError, TypeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    spec = RewardSpec(args.path, args.name, orjson.loads(args.reward_kwargs))
    reward = FunctionReward(spec, Reward(processes=args.processes, timeout_s=args.timeout_s))

    async def score(request: web.Request) -> web.Response:
        try:
            items = orjson.loads(await request.read())["requests"]
            if not isinstance(items, list):
                raise TypeError("requests is not a list")
        except (orjson.JSONDecodeError, KeyError, TypeError) as e:
            return web.Response(status=400, text=f'expected {{"requests": [...]}}: {e}')
        results = await asyncio.gather(*(answer(reward, item) for item in items))
        return web.Response(body=orjson.dumps({"results": results}, option=orjson.OPT_SERIALIZE_NUMPY),
                            content_type="application/json")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post(ROUTE, score)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    if args.port_file:
        replace_unsynced(Path(args.port_file), str(port).encode())  # a reader never sees it empty
    log.info("serving %s at http://%s:%d%s", spec.describe(), args.host, port, ROUTE)
    try:
        await asyncio.Event().wait()
    finally:
        await reward.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [reward-serve] %(message)s")
    try:
        asyncio.run(serve(parse_args(argv)))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
