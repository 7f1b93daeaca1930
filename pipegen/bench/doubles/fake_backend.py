"""A deterministic fake model backend for the CPU reference server: tests and benchmarks without a model.

    python -m pipegen.cpu_server --engine pipegen.bench.doubles.fake_backend:FakeBackend [--model-path DIR] [flags]

Owns:
  * ``FakeBackend`` - the ``ModelBackend`` the server runs with the ``--engine`` above: a fixed number of running
    slots (requests beyond ``--slots`` wait, FIFO) and aborts of waiting and running requests with SGLang's finish
    shapes. Two timing models: ``--token-latency L`` (each request on its own clock, L seconds per token), or
    the GPU-like ``--step-time BASE --step-time-per-request PER``: one decode loop steps every running request
    together, each step taking ``BASE + PER * running`` seconds, so throughput rises with the batch and
    flattens at the slots, as on a GPU (requests join the batch between steps). Its flags: ``--slots``,
    ``--token-latency``, ``--step-time``, ``--step-time-per-request``, ``--eos-prob``, ``--script``.
  * ``--script FILE`` mode: a JSON list of assistant reply texts; the reply for a request is ``script[k]`` where
    k = number of assistant turns already in the prompt (``<|im_start|>assistant`` headers in the decoded prompt
    minus one), encoded with the model folder's tokenizer and ended with the EOS id - enough to script a
    tool-calling conversation.
The tokens themselves come from fake_model.py's pure token function.
Must never: import torch or transformers (it must start in well under a second), use Python's randomized
``hash()``, or re-tokenize output: the output ids are exactly what gets returned.

Sampling parameters other than greedy vs. sampled (temperature < 1e-6), ``sampling_seed``, ``ignore_eos``,
``stop_token_ids`` and ``min_new_tokens`` are accepted and ignored. Without ``sampling_seed`` the seed is 42
(SGLang's deterministic-inference default), so identical prompts give identical samples unless the client
varies ``sampling_seed``; ``n > 1`` samples of one request differ through their sample index.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Optional

from pipegen.cpu_server.model_backend import BackendRequest, GenerationResult, ModelBackend, ModelFacts, TopList
from pipegen.cpu_server.parse import EntrySpec
from pipegen.cpu_server.responses import check_finish, finish_abort, finish_abort_waiting, finish_length
from pipegen.bench.doubles.fake_model import FNV_OFFSET, FakeModel, fold, fold_all, mix64

log = logging.getLogger("pipegen.fake_backend")

ASSISTANT_HEADER = "<|im_start|>assistant"


class FakeBackend(ModelBackend):
    """The deterministic backend (see the module docstring)."""

    name = "fake"
    trivial_probe = True

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--slots", type=int, default=None,
                            help="fake: max concurrently running requests (default --max-batch)")
        parser.add_argument("--token-latency", type=float, default=0.0, help="fake: seconds per generated token")
        parser.add_argument("--step-time", type=float, default=0.0,
                            help="fake: GPU-like batched decode, seconds per step at batch 1 (0 = off)")
        parser.add_argument("--step-time-per-request", type=float, default=0.0,
                            help="fake: GPU-like batched decode, extra seconds per step per running request")
        parser.add_argument("--eos-prob", type=float, default=0.02, help="fake: EOS chance per token")
        parser.add_argument("--script", default=None,
                            help="fake: JSON list of assistant replies (needs tokenizer.json)")

    @classmethod
    def from_args(cls, facts: ModelFacts, args: argparse.Namespace) -> FakeBackend:
        return cls(facts, seed=args.seed, slots=args.slots or args.max_batch, token_latency=args.token_latency,
                   eos_prob=args.eos_prob, script_path=args.script, context_length=args.context_length,
                   step_time=args.step_time, step_time_per_request=args.step_time_per_request)

    def __init__(self, facts: ModelFacts, *, seed: int = 0, slots: int = 8, token_latency: float = 0.0,
                 eos_prob: float = 0.02, script_path: Optional[str] = None,
                 context_length: Optional[int] = None, step_time: float = 0.0,
                 step_time_per_request: float = 0.0) -> None:
        self.facts = facts
        self.model = FakeModel(facts, seed=seed, eos_prob=eos_prob)
        self.vocab_size = facts.vocab_size
        self.context_length = context_length or facts.context_length
        self.eos_token_ids = facts.eos_token_ids
        self.max_running_requests = max(1, slots)
        self.token_latency = max(0.0, token_latency)
        self.script_path = script_path
        self._script: Optional[list[list[int]]] = None
        self._tokenizer = None
        self._sem: Optional[asyncio.Semaphore] = None
        self._tasks: dict[BackendRequest, asyncio.Task] = {}
        self._running = 0
        self._waiting = 0
        self._max_running = 0
        self._busy_slot_seconds = 0.0
        self._tokens = 0
        self.step_time = max(0.0, step_time)
        self.step_time_per_request = max(0.0, step_time_per_request)
        self.batched = self.step_time > 0 or self.step_time_per_request > 0
        self._queue: deque[BackendRequest] = deque()
        self._wake: Optional[asyncio.Event] = None
        self._loop_task: Optional[asyncio.Task] = None
        self._steps = 0

    # -- lifecycle --------------------------------------------------------------------------------------

    def load(self) -> None:
        """Load the script and tokenizer when ``--script`` is given; nothing else to load."""
        if not self.script_path:
            return
        texts = json.loads(Path(self.script_path).read_text())
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts) or not texts:
            raise ValueError(f"--script {self.script_path}: expected a non-empty JSON list of reply strings")
        tok_file = Path(self.facts.model_path) / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"--script needs a tokenizer: {tok_file} does not exist")
        from tokenizers import Tokenizer  # light (no torch); only needed in script mode

        self._tokenizer = Tokenizer.from_file(str(tok_file))
        self._script = [self._tokenizer.encode(t, add_special_tokens=False).ids + [self.model.eos] for t in texts]
        log.info("fake backend: loaded a script of %d replies from %s", len(texts), self.script_path)

    async def start(self) -> None:
        self._sem = asyncio.Semaphore(self.max_running_requests)
        if self.batched:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._decode_loop())

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._loop_task is not None:
            self._loop_task.cancel()

    # -- requests ---------------------------------------------------------------------------------------

    def submit(self, req: BackendRequest) -> None:
        self._waiting += 1
        if self.batched:
            assert self._wake is not None, "start() not called"
            self._queue.append(req)
            self._wake.set()
            return
        self._tasks[req] = asyncio.get_running_loop().create_task(self._run(req))

    def abort(self, req: BackendRequest) -> None:
        req.abort_requested = True
        if self.batched:
            if req.state == "waiting" and req in self._queue:
                self._queue.remove(req)
                self._waiting -= 1
                req.finish(GenerationResult([], finish_abort_waiting(), aborted_in_queue=True))
            return  # a running one is answered "Aborted" at the end of the current step
        task = self._tasks.get(req)
        if task is not None and req.state == "waiting":
            task.cancel()  # wakes it out of the slot queue; _run answers "Abort in waiting queue"

    async def _run(self, req: BackendRequest) -> None:
        assert self._sem is not None, "start() not called"
        try:
            try:
                await self._sem.acquire()
            except asyncio.CancelledError:
                self._waiting -= 1
                req.finish(GenerationResult([], finish_abort_waiting(), aborted_in_queue=True))
                return
            self._waiting -= 1
            if req.abort_requested:
                self._sem.release()
                req.finish(GenerationResult([], finish_abort_waiting(), aborted_in_queue=True))
                return
            req.state = "running"
            req.started = time.monotonic()
            self._running += 1
            self._max_running = max(self._max_running, self._running)
            try:
                result = await self._generate(req)
            except asyncio.CancelledError:
                result = GenerationResult([], finish_abort())
            finally:
                self._running -= 1
                self._busy_slot_seconds += time.monotonic() - req.started
                self._sem.release()
            self._tokens += len(result.output_ids)
            req.finish(result)
        finally:
            self._tasks.pop(req, None)

    # -- generation -------------------------------------------------------------------------------------

    def _script_reply(self, ids: tuple[int, ...]) -> tuple[list[int], int]:
        """The scripted reply for this prompt and how much of it the prompt already holds (resume)."""
        assert self._script is not None and self._tokenizer is not None
        text = self._tokenizer.decode(list(ids), skip_special_tokens=False)
        k = max(0, text.count(ASSISTANT_HEADER) - 1)
        reply = self._script[min(k, len(self._script) - 1)]
        # A resumed request ends with part of the reply after the last header: continue, do not restart.
        tail = text[text.rfind(ASSISTANT_HEADER) + len(ASSISTANT_HEADER):] if ASSISTANT_HEADER in text else ""
        if tail.strip("\n"):
            for p in range(min(len(reply), len(ids)), 0, -1):
                if list(ids[-p:]) == reply[:p]:
                    return reply, p
        return reply, 0

    def _prompt_pass(self, spec: EntrySpec, key: int) -> tuple[int, GenerationResult]:
        """Fold the prompt; fill prompt-side logprob lists when asked."""
        ids = spec.input_ids
        res = GenerationResult([], finish_length(0))
        k = spec.logprob_start_len
        if k < 0:
            return fold_all(ids), res
        m = self.model
        in_lp: list[Optional[float]] = []
        in_top: list[Optional[TopList]] = []
        in_tid: list[Optional[TopList]] = []
        h = FNV_OFFSET
        for i, t in enumerate(ids):
            if i >= k:
                if i == k:
                    in_lp.append(None)
                    in_top.append(None)
                    in_tid.append(None)
                else:
                    lp = m.token_logprob(h, key, t)
                    in_lp.append(lp)
                    if spec.top_logprobs_num > 0:
                        in_top.append(m.top_list(h, key, t, lp, spec.top_logprobs_num))
                    if spec.token_ids_logprob is not None:
                        in_tid.append([(lp if x == t else m.token_logprob(h, key, x), x) for x in spec.token_ids_logprob])
            h = fold(h, t)
        res.input_logprobs = in_lp
        res.input_top_logprobs = in_top if spec.top_logprobs_num > 0 else None
        res.input_token_ids_logprobs = in_tid if spec.token_ids_logprob is not None else None
        return h, res

    def _begin(self, spec: EntrySpec) -> dict:
        key = self.model.key(spec)
        h, res = self._prompt_pass(spec, key)
        reply, pos = (self._script_reply(spec.input_ids) if self._script is not None else ([], 0))
        if spec.top_logprobs_num > 0:
            res.output_top_logprobs = []
        if spec.token_ids_logprob is not None:
            res.output_token_ids_logprobs = []
        return {"key": key, "h": h, "res": res, "reply": reply, "pos": pos}

    def _step(self, spec: EntrySpec, st: dict) -> Optional[GenerationResult]:
        """One token; returns the finished result or None."""
        m = self.model
        res: GenerationResult = st["res"]
        h, key = st["h"], st["key"]
        n_out = len(res.output_ids)
        sp = spec.sampling
        if st["pos"] < len(st["reply"]):
            tok = st["reply"][st["pos"]]
            st["pos"] += 1
            lp = m.logprob(mix64(h ^ key))
        else:
            allow_stop = n_out >= sp.min_new_tokens and not sp.ignore_eos
            tok, lp = m.draw(h, key, allow_stop, sp.stop_token_ids)
        if spec.top_logprobs_num > 0:
            res.output_top_logprobs.append(m.top_list(h, key, tok, lp, spec.top_logprobs_num))
        if spec.token_ids_logprob is not None:
            res.output_token_ids_logprobs.append(
                [(lp if x == tok else m.token_logprob(h, key, x), x) for x in spec.token_ids_logprob])
        res.output_logprobs.append(lp)
        res.output_logprob_ids.append(tok)
        if spec.max_new_tokens == 0:
            # SGLang still samples one token: no output ids, one phantom logprob, finish length 0.
            res.finish_reason = finish_length(0)
            return res
        res.output_ids.append(tok)
        st["h"] = fold(h, tok)
        fin = check_finish(tok, n_out + 1, spec, self.eos_token_ids)
        if fin is not None:
            res.finish_reason = fin
            return res
        return None

    async def _generate(self, req: BackendRequest) -> GenerationResult:
        spec = req.spec
        st = self._begin(spec)
        req.live = st["res"]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        lat = self.token_latency
        i = 0
        while True:
            if lat > 0:
                # Deadline-based so timer jitter does not accumulate over long generations.
                delay = t0 + (i + 1) * lat - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            elif i % 256 == 255:
                await asyncio.sleep(0)  # stay responsive to health probes and aborts
            if req.abort_requested:
                res: GenerationResult = st["res"]
                res.finish_reason = finish_abort()
                return res
            done = self._step(spec, st)
            if done is not None:
                return done
            i += 1

    async def _decode_loop(self) -> None:
        """GPU-like continuous batching: admit waiting requests up to the slots between steps, then one
        step of ``step_time + step_time_per_request * running`` seconds gives every running request one token."""
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        running: list[tuple[BackendRequest, dict]] = []
        next_t = loop.time()
        while True:
            while self._queue and len(running) < self.max_running_requests:
                req = self._queue.popleft()
                self._waiting -= 1
                req.state = "running"
                req.started = time.monotonic()
                running.append((req, self._begin(req.spec)))
                req.live = running[-1][1]["res"]
            self._running = len(running)
            self._max_running = max(self._max_running, self._running)
            if not running:
                self._wake.clear()
                await self._wake.wait()
                next_t = loop.time()
                continue
            dt = self.step_time + self.step_time_per_request * len(running)
            next_t = max(next_t + dt, loop.time())  # deadline-based: timer jitter does not accumulate
            await asyncio.sleep(next_t - loop.time())
            self._busy_slot_seconds += dt * len(running)
            self._steps += 1
            still = []
            for req, st in running:
                if req.abort_requested:
                    res: GenerationResult = st["res"]
                    res.finish_reason = finish_abort()
                    req.finish(res)
                    continue
                done = self._step(req.spec, st)
                if done is None:
                    still.append((req, st))
                else:
                    self._tokens += len(done.output_ids)
                    req.finish(done)
            running = still

    def stats(self) -> dict:
        return {
            "running": self._running,
            "waiting": self._waiting,
            "max_batch_size": self._max_running,
            "busy_slot_seconds": round(self._busy_slot_seconds, 6),
            "slots": self.max_running_requests,
            "engine_tokens_generated": self._tokens,
            "decode_steps": self._steps,
        }
