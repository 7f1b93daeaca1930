"""vLLM as an `Engine`: OpenAI `POST /v1/completions` with the prompt as a list of token ids.

Why this endpoint and not `/inference/v1/generate` (vLLM's tokens-only route): /v1/completions is served
by every vLLM deployment as it comes (the other needs `--enable-scale-out`, which a team's existing
server rarely has), and with `return_token_ids` it is just as token-exact: ids go in as ids, the
answer's `choices[0].token_ids` are the sampled ids and `logprobs.token_logprobs` one log-prob per id,
never detokenized and re-tokenized. It takes `seed` per request (reproducible across calls and
restarts), `n` and `stop_token_ids`.

- finish reasons: `stop` (EOS or a stop id; the stop token is the last id and has a log-prob, as in
  SGLang), `length`, `abort`;
- abort: closing the HTTP connection aborts the request inside vLLM (its abort endpoint needs vLLM's
  internal request id and `--enable-scale-out`), so `abort` sends nothing: the client cancels the
  request's task, which closes its connection;
- readiness: `GET /health` (the API server binds only once the engine is loaded);
- running limit: not reported over HTTP (`--max-num-seqs`): the launcher passes
  `llm.max_running_requests` to the servers it starts and to the actors;
- load: `/metrics` (Prometheus text) `vllm:num_requests_running` and `vllm:num_requests_waiting`;
- groups: none. `/v1/completions` takes a list of prompts, but one `seed` and one `request_id` for all of
  them, and a member can only be aborted by closing the connection, which aborts the whole group: every
  generation goes as its own request (`group_limit` is 1), so seeds, aborts and hedges stay per unit.

Log-probs: vLLM reports raw log-probs (before temperature) unless the server runs with
`--logprobs-mode processed_logprobs`; verl recomputes `log_softmax(logits / temperature)`, which is the
processed value (top-k/top-p left at their defaults). The launcher starts vLLM with that flag; an
external server needs it too for `rollout_log_probs` to match verl at a temperature other than 1.

Owns: vLLM's endpoints and their answers. Must never: retry, or re-tokenize anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Hashable

import aiohttp

from pipegen.engines.base import Engine, EngineRequest, Load, LoadUnavailable, NotStreamed, StreamedAnswer
from pipegen.engines.request import Generation, new_rid

RUNNING_METRIC = "vllm:num_requests_running"
WAITING_METRIC = "vllm:num_requests_waiting"
# one observation per engine step the API server has recorded: the two gauges above are set at the same moment,
# from that step's scheduler, so they say nothing of requests that reached the engine after the step began
STEPS_METRIC = "vllm:iteration_tokens_total_count"
# verl's agent-loop names that vLLM's completion request spells the same way; anything else the loop
# sends is dropped rather than risking a 400 for an unknown field
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "stop_token_ids", "ignore_eos", "min_tokens")


def parse_metrics(text: str) -> Load:
    """Running, waiting and steps recorded from vLLM's Prometheus text, summed over its label sets (engines,
    models). Three names in a page of histograms: a scan of line starts, not a full exposition-format parser."""
    totals = {RUNNING_METRIC: 0.0, WAITING_METRIC: 0.0, STEPS_METRIC: 0.0}
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_", STEPS_METRIC)):
            # the name ends at its labels or the value: vllm:num_requests_waiting_by_reason is another metric
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
    return Load(int(totals[RUNNING_METRIC]), int(totals[WAITING_METRIC]), int(totals[STEPS_METRIC]))


# vLLM 0.32 can take pictures beside token ids on its other route (`/inference/v1/generate` with `content_parts`,
# behind --enable-scale-out); pipegen does not speak it: no vLLM that pipegen could run beside torchvision (which
# vLLM's Qwen2-VL needs) was at hand to check it against, and an unchecked route would be worse than a refusal.
NO_IMAGES = ("vLLM's /v1/completions takes token ids without images: this prompt's images cannot be sent; serve "
             "the model with SGLang (llm.protocol=sglang) or drop the dataset's image column")


class VLLM(Engine):
    name = "vllm"
    generate_path = "/v1/completions"
    streams = False  # its answers are read whole: long answers keep their progress in chunks (actor/continuation.py)
    health_path = "/health"
    # /metrics: gauges of the last step the API server recorded (a first prefill on a busy CPU: seconds); which attempts
    # a reading surely counts follows the recorded steps (routing.ServerState.note_reading), and its looks and
    # suspicions take a second longer (2 s each, as measured passing beside a CPU hog)
    load_trails_s = 1.0

    def build(self, generation: Generation) -> EngineRequest:
        if generation.pictures:  # refused at launch for llm=vllm (inputs/media.py); this catches llm.protocol=auto
            raise ValueError(NO_IMAGES)
        params = generation.params
        rid = new_rid()
        body: dict[str, Any] = {k: params[k] for k in SAMPLING_KEYS if params.get(k) is not None}
        # return_tokens_as_token_ids: the answer's per-token strings (which pipegen never reads) are written as
        # "token_id:N" instead of each being detokenized in vLLM's API server; a server without a tokenizer
        # (--skip-tokenizer-init, how pipegen starts vLLM) refuses log-probs without it
        body.update(prompt=generation.prompt_ids, max_tokens=generation.max_new_tokens, return_token_ids=True,
                    return_tokens_as_token_ids=True, request_id=rid)
        if generation.return_logprob:
            body["logprobs"] = 0  # the sampled token's own log-prob, no alternatives
        if generation.seed is not None:
            body["seed"] = int(generation.seed)
        return EngineRequest(body, rid, generation)

    def renewed(self, request: EngineRequest) -> EngineRequest:
        rid = new_rid()
        return dataclasses.replace(request, body={**request.body, "request_id": rid}, rid=rid)

    @staticmethod
    def _choice(answer: dict[str, Any]) -> dict[str, Any]:
        choices = answer.get("choices")
        if not choices or not isinstance(choices[0], dict):
            raise ValueError("no choices in the answer")
        return choices[0]

    def finish_type(self, answer: dict[str, Any]) -> str | None:
        return self._choice(answer).get("finish_reason")

    def parse(self, answer: dict[str, Any], request: EngineRequest):
        from verl.workers.rollout.replica import TokenOutput

        choice = self._choice(answer)
        token_ids = choice.get("token_ids") or []
        if request.return_logprob:
            log_probs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if len(log_probs) != len(token_ids):  # as verl does for a mismatch: keep nothing
                token_ids, log_probs = [], []
        else:
            log_probs = None
        extra = {"global_steps": None, "min_global_steps": None, "max_global_steps": None}
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=choice.get("finish_reason"),
                           extra_fields=extra)

    async def abort(self, session: aiohttp.ClientSession, url: str, request: EngineRequest,
                    timeout_s: float) -> None:
        """Nothing to send: the caller closes the request's connection, which aborts it in vLLM."""

    async def max_running(self, session: aiohttp.ClientSession, url: str) -> int | None:
        return None

    async def load(self, session: aiohttp.ClientSession, url: str) -> Load:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
            text = await resp.text()
            if resp.status == 404:
                raise LoadUnavailable(f"{url} has no /metrics")
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
        return parse_metrics(text)

    async def group_limit(self, session: aiohttp.ClientSession, url: str) -> int:
        return 1  # see the header: one request per generation

    def group_key(self, request: EngineRequest) -> Hashable | None:
        return None

    def group_body(self, requests: list[EngineRequest], intervals: list[int]) -> dict[str, Any]:
        raise ValueError("vLLM takes no grouped request (group_limit is 1)")

    def group_chunks(self, resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        raise ValueError("vLLM takes no grouped request (group_limit is 1)")

    # Not streamed: its /v1/completions stream would need token ids per chunk, not checked against vLLM 0.32; a long
    # answer's tokens are kept in chunks instead (actor/continuation.py), and supervision reads /metrics.
    def stream_body(self, request: EngineRequest, interval: int) -> dict[str, Any]:
        raise NotStreamed("vLLM's answers are read whole here (streams is False)")

    def stream_chunks(self, resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
        raise NotStreamed("vLLM's answers are read whole here (streams is False)")

    def streamed(self, request: EngineRequest) -> StreamedAnswer:
        raise NotStreamed("vLLM's answers are read whole here (streams is False)")
