"""The HTTP verifier: samples scored by a server somewhere else (as PipelineRL's verifier server scores
math answers off the actor), over protocol.py's JSON.

Each actor keeps one aiohttp session to `reward.verifier_url` and sends waiting samples in batches of up
to `reward.verifier_batch`, `reward.verifier_concurrency` requests at once (batching.py), so a verifier
that takes 100 ms a request costs the actor a fraction of one HTTP exchange per sample, not 100 ms of its
loop. Each request may take `reward.verifier_timeout_s`; a timeout, a refused connection, a 429 or a 5xx is
tried again (`reward.verifier_attempts` tries in all, waiting 0.5 s, 1 s, 2 s ... between them); any other
status, an answer that is not the protocol's, or the last try's failure fails every sample of the request
with a RewardFailure that names the URL and the reason.

Owns: the verifier's session, its retries and time limit.
Must never: give a sample a score the verifier did not send.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from pipegen.rewards.batching import MicroBatcher
from pipegen.rewards.protocol import RewardFailure, ScoreRequest
from pipegen.config.schema import Reward, RewardSpec

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
BACKOFF_S = 0.5
BACKOFF_MAX_S = 8.0


class _Retry(Exception):
    """A failure the next try may not see."""


class VerifierReward:
    def __init__(self, spec: RewardSpec, settings: Reward):
        """`spec`: a verifier's RewardSpec (its url); `settings`: the reward.verifier_* limits."""
        if spec.url is None:
            raise ValueError(f"{spec.describe()} is not a verifier")
        self.spec = spec
        self.url = spec.url
        self.timeout_s = float(settings.verifier_timeout_s)
        self.attempts = int(settings.verifier_attempts)
        self.batch = int(settings.verifier_batch)
        self.concurrency = int(settings.verifier_concurrency)
        self._session = None
        self._batcher = MicroBatcher(self._send, self.batch, self.concurrency)

    def describe(self) -> str:
        return self.spec.describe()

    @property
    def capacity(self) -> int:
        """Samples the verifier checks at once: its requests in flight times their batch."""
        return self.batch * self.concurrency

    async def score(self, request: ScoreRequest) -> Any:
        """The verifier's raw result for this sample (protocol.parse_result reads it)."""
        return await self._batcher.submit(request)

    def _open(self):
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def _send(self, batch: list[ScoreRequest]) -> list[Any]:
        import aiohttp

        body = orjson.dumps({"requests": [r.kwargs() for r in batch]}, option=orjson.OPT_SERIALIZE_NUMPY)
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (attempt - 1)))
            try:
                return await self._post(body, len(batch))
            except _Retry as e:
                last = str(e)
            except asyncio.TimeoutError:
                last = f"no answer within reward.verifier_timeout_s={self.timeout_s:g}"
            except aiohttp.ClientError as e:
                last = f"{type(e).__name__}: {e}"
        raise RewardFailure(f"{self.describe()} failed {self.attempts} tries, the last: {last}")

    async def _post(self, body: bytes, expected: int) -> list[Any]:
        async with self._open().post(self.url, data=body,
                                     headers={"Content-Type": "application/json"}) as response:
            text = await response.read()
            if response.status in RETRY_STATUSES:
                raise _Retry(f"HTTP {response.status}: {text[:200].decode(errors='replace')}")
            if response.status != 200:
                raise RewardFailure(f"{self.describe()} answered HTTP {response.status}: "
                                    f"{text[:200].decode(errors='replace')}")
        try:
            results = orjson.loads(text)["results"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise RewardFailure(f"{self.describe()} answered something other than {{\"results\": [...]}}: "
                                f"{text[:120].decode(errors='replace')}") from None
        if not isinstance(results, list) or len(results) != expected:
            raise RewardFailure(f"{self.describe()} answered {len(results) if isinstance(results, list) else 'no'} "
                                f"results for {expected} requests")
        return results

    async def close(self) -> None:
        await self._batcher.close()
        if self._session is not None:
            await self._session.close()
