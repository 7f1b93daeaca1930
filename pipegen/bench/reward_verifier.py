"""Scenario `reward`: what a slow HTTP verifier (100 ms a request, as math_verify on a remote box takes)
costs the actor's throughput, against the default (verl's default_compute_score in the actor), on the
instant fake engine, where the actor's one core is the bottleneck and any cost scoring adds shows fully.

- default: the real actor (as scenario e2e runs it) on the demo data, scoring with verl's scorer.
- verifier: the same, with `reward.verifier_url` at a verifier subprocess that holds every request 100 ms
  (asyncio.sleep: the verifier's own cores, not this machine's, do the checking) and answers a score per
  sample; the actor batches waiting samples into requests (rewards/batching.py).
Runs alternate (A B B A ...). Ratio: verifier ÷ default samples/s, target ≥ 0.9 (issue 29: a slow
verifier may cost at most 10% of the actor's throughput).

Owns: this scenario's verifier, its runs and its row.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from pipegen.bench import common as c
from pipegen.bench.end_to_end import RunSpec, run_actor, steady_rate
from pipegen.run.atomic import replace_unsynced

KEY = "reward"
TITLE = "11. Scoring through a 100 ms HTTP verifier vs verl's scorer in the actor (instant fake server)"
TARGET = "≥ 0.9"
DELAY_S = 0.1


@dataclass
class WithVerifier(RunSpec):
    url: str = ""

    def overrides(self) -> list[str]:
        return [*super().overrides(), f"reward.verifier_url={self.url}"]


def serve_slow(port_file: str, delay_s: float) -> None:
    """The verifier: every request waits delay_s, then each sample gets a score."""
    from aiohttp import web

    async def score(request: web.Request) -> web.Response:
        items = orjson.loads(await request.read())["requests"]
        await asyncio.sleep(delay_s)
        return web.Response(body=orjson.dumps({"results": [{"score": float(len(i["solution_str"]) % 2)}
                                                           for i in items]}), content_type="application/json")

    async def main() -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/score", score)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        replace_unsynced(Path(port_file), str(runner.addresses[0][1]).encode())  # never seen empty
        await asyncio.Event().wait()

    asyncio.run(main())


def run(quick: bool) -> c.ScenarioResult:
    from pipegen.launch.servers import ServerProcess

    res = c.ScenarioResult(KEY, TITLE)
    reps = 2 if quick else 3
    base = RunSpec(256, n=8, concurrency=64)
    with c.scratch("reward") as tmp:
        port_file = tmp / "verifier.port"
        verifier = ServerProcess([sys.executable, "-m", "pipegen.bench.reward_verifier", "--port-file", str(port_file),
                                  "--delay-s", str(DELAY_S)], tmp / "verifier.log", port_file=port_file, cwd=c.REPO)
        verifier.start()
        try:
            with c.reference_server(tmp / "srv", c.fake_backend_args(slots=4096, eos_prob=0)) as server:
                while verifier.port is None:
                    if not verifier.alive:
                        raise RuntimeError(f"the verifier exited: {verifier.log_tail()}")
                    time.sleep(0.05)
                slow = WithVerifier(base.response_tokens, base.n, base.concurrency,
                                    url=f"http://127.0.0.1:{verifier.port}/score")
                rates: dict[str, list[float]] = {"default": [], "verifier": []}
                units = 0
                for i, kind in enumerate((["default", "verifier", "verifier", "default"] * reps)[: 2 * reps]):
                    arrivals, run, _ = run_actor(tmp / f"{kind}_{i}", server.url, base if kind == "default" else slow)
                    rates[kind].append(steady_rate(arrivals))
                    units = len(arrivals)
                    if kind == "verifier":  # the scores are the verifier's: every record carries one
                        lines = [orjson.loads(line) for line in c.shard_lines(run.rollouts)]
                        if any(t["reward_score"] is None for r in lines for t in r["trajectories"]):
                            raise RuntimeError("a record of the verifier run has no score")
        finally:
            verifier.stop()
    pairs = list(zip(rates["verifier"], rates["default"]))
    res.add(c.Row(
        what="256-token responses: 100 ms verifier vs verl's scorer in the actor",
        ratio=c.median([v / d for v, d in pairs]), label="verifier ÷ default (actor samples/s)", target=TARGET,
        raw=(f"verifier {c.fmt_rate(c.median(rates['verifier']), ' samples/s')}, default "
             f"{c.fmt_rate(c.median(rates['default']), ' samples/s')}; {units} units, concurrency 64, "
             f"{len(pairs)} pairs; verifier holds each request {DELAY_S * 1e3:.0f} ms, samples batched (up to "
             f"reward.verifier_batch per request, reward.verifier_concurrency requests in flight)"),
    ))
    res.notes.append(
        "reward: a unit frees its server slot when answered, then waits for its score; the actor sends waiting "
        "samples as one request, so the verifier's latency costs units in memory, not the actor's loop. The "
        "verifier models a remote one (asyncio.sleep), so its checking uses none of this machine's cores; its "
        "JSON handling does.")
    return res


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the slow verifier of scenario `reward`")
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--delay-s", type=float, default=DELAY_S)
    args = parser.parse_args()
    serve_slow(args.port_file, args.delay_s)
