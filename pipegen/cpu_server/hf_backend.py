"""The transformers model backend of the CPU server (``--engine hf``): one model on CPU, continuous batching.

Owns:
  * loading ``AutoModelForCausalLM`` from a local Hugging Face folder on CPU (``--dtype auto`` = bfloat16 only
    where the CPU has native bf16, i.e. ``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo, else float32);
  * batching concurrent requests: requests that arrive within ``batch_wait_ms`` of an idle backend are prefilled
    together (left padding); while a batch decodes, newly queued requests are prefilled at the next step boundary
    and merged into the running batch (KV caches left-padded to a common length), up to ``max_batch`` rows. One
    forward per decode step for the whole batch; finished rows leave the batch at once (KV rows dropped, common
    left padding trimmed), so a short answer never waits for a long one;
  * per-row stop: EOS ids (config.json + generation_config.json, lists allowed) and ``stop_token_ids`` unless
    ``ignore_eos``, per-row max_new_tokens, length checked before stop (SGLang's order); aborts between steps.
Sampling and logprobs of a row (its own parameters and seeded RNG; logprobs after temperature, as SGLang reports
them) live in ``hf_sampling``.
Own loop rather than transformers' continuous batching (``generate_batch`` / ``init_continuous_batching``,
transformers 5.10): that API samples every row with one ``torch.multinomial`` on the global RNG under one
manager-wide ``do_sample``, so per-request ``sampling_seed`` and mixed greedy/sampled batches cannot be honoured;
its per-request processors cover only temperature/top_k/top_p (no min_p, penalties, logit_bias,
min_new_tokens), and it returns post-processing logprobs only, with no prompt or top-k logprobs.
Must never: run torch work on the event loop thread (all of it happens in one worker thread, so /health and
/get_model_info keep answering), import torch at module import time (the server binds its port first), or
touch the network / Hugging Face Hub (local folders only).
"""

from __future__ import annotations

import argparse
import collections
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import cachetools

from pipegen.cpu_server.model_backend import (HEALTH_CHECK_PREFIX, BackendRequest, GenerationResult, ModelBackend,
                                              ModelFacts)
from pipegen.cpu_server.hf_sampling import keyed_uniform, prompt_logprobs, row_seed, sample
from pipegen.cpu_server.responses import check_finish, finish_abort, finish_abort_waiting, finish_length
from pipegen.run.precision import resolve_dtype_name
from pipegen.config.schema import HF_BACKEND, CpuServers

log = logging.getLogger("pipegen.hf_backend")
# prompts whose keys and values a reproducible server keeps for the next prompt sharing a prefix (a few-shot preamble,
# a prompt's other samples, a continuation's own prompt): ~46 KB a token on SmolLM2-135M in float32
PREFIXES_KEPT = 8


@dataclass(eq=False)
class _Row:
    """One generation inside the running batch (worker-thread state only)."""

    req: BackendRequest
    seed: int  # its draws: keyed_uniform(seed, position), hf_sampling
    last: int = 0
    result: GenerationResult = field(default_factory=lambda: GenerationResult([], finish_length(0)))
    finished: bool = False
    rope_delta: int = 0  # a vision model's M-RoPE offset of this row's decoded positions (vision.py)


class HFBackend(ModelBackend):
    """Transformers on CPU behind the CPU server (see the module docstring)."""

    name = HF_BACKEND
    requires_model_path = True

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--batch-wait-ms", type=float, default=5.0,
                            help="hf: gather window when the backend is idle")
        parser.add_argument("--reproducible", action="store_true",
                            help="hf: a row's ids and log-probs depend on its own tokens only, bit for bit, at any "
                                 "batch, concurrency or server count, prefilled or decoded (canonical.py)")

    @classmethod
    def from_args(cls, facts: ModelFacts, args: argparse.Namespace) -> HFBackend:
        return cls(facts, dtype=args.dtype, threads=args.threads, max_batch=args.max_batch,
                   batch_wait_ms=args.batch_wait_ms, seed=args.seed, context_length=args.context_length,
                   reproducible=args.reproducible)

    def __init__(self, facts: ModelFacts, *, dtype: str = CpuServers.dtype, threads: int = CpuServers.threads,
                 max_batch: int = CpuServers.max_batch,
                 batch_wait_ms: float = 5.0, seed: int = 0, context_length: Optional[int] = None,
                 reproducible: bool = False) -> None:
        self.model_path = facts.model_path
        self.vocab_size = facts.vocab_size
        self.context_length = context_length or facts.context_length
        self.eos_token_ids = facts.eos_token_ids
        self.max_running_requests = max(1, max_batch)
        self.max_batch = max(1, max_batch)
        self.batch_wait = max(0.0, batch_wait_ms) / 1000.0
        self.threads = max(1, threads)
        self.dtype_name = resolve_dtype_name(dtype)
        self._rng = random.Random(seed)  # seeds rows without a sampling_seed
        self.reproducible = reproducible
        self.not_reproducible = ""  # why a --reproducible server is not (a vision model), for /get_server_info
        self._keys: Any = None  # canonical.Keys where reproducible
        # reproducible: the last prompts' keys and values by layer, so a prompt sharing a prefix computes only the rest
        self._prefixes: cachetools.LRUCache = cachetools.LRUCache(maxsize=PREFIXES_KEPT)
        self._cv = threading.Condition()
        self._waiting: collections.deque[BackendRequest] = collections.deque()
        self._admitting = 0  # taken from the queue, being prefilled: not in a row yet
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        # Running batch (worker thread only).
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask: Any = None
        # Counters (written by the worker, read by the loop; plain ints are fine under the GIL).
        self._max_batch_seen = 0
        self._decode_steps = 0
        self._prefills = 0
        self._busy_slot_seconds = 0.0
        self._tokens = 0
        self._torch: Any = None
        self.model: Any = None
        self.vision: Any = None  # vision.VisionInputs for a vision-language model

    # -- lifecycle --------------------------------------------------------------------------------------

    def load(self) -> None:
        """Import torch, load the model, warm it up. Runs in a worker thread after the port is bound."""
        t0 = time.monotonic()
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        self._torch = torch
        torch.set_num_threads(self.threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # already set / parallel work started: harmless
        torch_dtype = getattr(torch, self.dtype_name)
        from pipegen.inputs.models import quiet_progress_bars  # keeps the weight-loading bar out of the server log

        from transformers import AutoConfig

        from pipegen.cpu_server.vision import VisionInputs, is_vision_model

        vision = is_vision_model(AutoConfig.from_pretrained(self.model_path))
        model_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        with quiet_progress_bars():
            self.model = model_class.from_pretrained(self.model_path, dtype=torch_dtype).eval()
        if vision:
            self.vision = VisionInputs(self.model, self.model_path)
        if self.reproducible and vision:
            self.not_reproducible = "a vision-language model: its image tower runs batched, as without --reproducible"
        elif self.reproducible:
            from pipegen.cpu_server.canonical import check_row_invariance, make_canonical

            self._keys = make_canonical(self.model, torch)
            with torch.inference_mode():
                failed = check_row_invariance(self.model, torch)
            if failed:
                raise RuntimeError(f"--reproducible: this CPU's matrix multiply gives a row different results by its "
                                   f"place in a block ({failed}); serve without it (generation.reproducible=false)")
        cfg_vocab = getattr(self.model.config, "vocab_size", None)
        if cfg_vocab and cfg_vocab != self.vocab_size:
            self.vocab_size = int(cfg_vocab)
        # Warm up: the first forward pays for lazy initialisation; keep that out of the first request.
        with torch.inference_mode():
            self._forward_prefill([[1 % self.vocab_size, 2 % self.vocab_size, 3 % self.vocab_size]], keep_all=False)[0]
        log.info("hf backend: loaded %s (%s, %d thread(s)%s) in %.2f s", self.model_path, self.dtype_name,
                 self.threads, ", reproducible" if self._keys is not None else "", time.monotonic() - t0)

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._worker, name="hf-backend", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    # -- requests (event-loop side) ---------------------------------------------------------------------

    def submit(self, req: BackendRequest) -> None:
        with self._cv:
            if req.spec.rid.startswith(HEALTH_CHECK_PREFIX):
                self._waiting.appendleft(req)  # a health probe must not time out behind a long queue
            else:
                self._waiting.append(req)
            self._cv.notify()

    def abort(self, req: BackendRequest) -> None:
        req.abort_requested = True  # a running row sees it at the next step boundary
        with self._cv:
            try:
                self._waiting.remove(req)
            except ValueError:
                return
        req.finish(GenerationResult([], finish_abort_waiting(), aborted_in_queue=True))

    def stats(self) -> dict:
        return {
            # a request taken from the queue is running from then on, its prefill included (as SGLang counts it):
            # a client comparing its requests with these counts must find every one of them
            "running": len(self._rows) + self._admitting,
            "waiting": len(self._waiting),
            "max_batch_size": self._max_batch_seen,
            "busy_slot_seconds": round(self._busy_slot_seconds, 6),
            "slots": self.max_batch,
            "decode_steps": self._decode_steps,
            "prefill_batches": self._prefills,
            "engine_tokens_generated": self._tokens,
            "dtype": self.dtype_name,
            "threads": self.threads,
            "reproducible": self._keys is not None,
        }

    # -- worker thread ----------------------------------------------------------------------------------

    def _worker(self) -> None:
        torch = self._torch
        with torch.inference_mode():
            while True:
                newcomers: list[BackendRequest] = []
                with self._cv:
                    while not self._stop and not self._waiting and not self._rows:
                        self._cv.wait()
                    if self._stop:
                        break
                    if not self._rows and self.batch_wait > 0:
                        # Idle backend: give concurrent arrivals a few ms to join the first prefill.
                        deadline = self._waiting[0].created + self.batch_wait
                        while not self._stop and len(self._waiting) < self.max_batch:
                            remaining = deadline - time.monotonic()
                            if remaining <= 0:
                                break
                            self._cv.wait(remaining)
                    room = self.max_batch - len(self._rows)
                    while room > 0 and self._waiting:
                        req = self._waiting.popleft()
                        req.state = "running"
                        newcomers.append(req)
                        room -= 1
                    self._admitting = len(newcomers)
                try:
                    if newcomers:
                        self._admit(newcomers)
                        self._admitting = 0
                    if self._rows:
                        self._decode_step()
                except Exception as exc:  # a bug or OOM: fail the affected requests, keep serving
                    log.exception("hf backend: step failed")
                    reason = {"type": "abort", "message": f"internal error: {exc!r}", "status_code": 500,
                              "err_type": "InternalServerError"}
                    for row in self._rows:
                        row.result.finish_reason = reason
                        self._finish_row(row)
                    for req in newcomers:
                        req.finish(GenerationResult([], reason))
                    self._rows, self._cache, self._mask, self._admitting = [], None, None, 0

    # -- model work (worker thread) ---------------------------------------------------------------------

    def _forward_prefill(self, prompts: list[tuple[int, ...]] | list[list[int]], keep_all: bool,
                         images: list[tuple[str, ...]] | None = None) -> tuple[Any, Any, Any, Any]:
        """Left-padded prefill of a group; returns (logits, cache, mask, each row's rope delta or None).
        ``keep_all``: logits at every position. ``images``: each row's image_data (a vision model's)."""
        torch = self._torch
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        if self._keys is not None and self.vision is None:
            return self._canonical_prefill(list(prompts[0]), keep_all) + (None,)
        cache = DynamicCache()
        extra: dict[str, Any] = {"position_ids": pos}
        deltas = None
        if self.vision is not None:
            extra, deltas = self.vision.prefill(ids, mask, images or [()] * len(prompts))
        out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache,
                         use_cache=True, logits_to_keep=0 if keep_all else 1, **extra)
        return out.logits, cache, mask, deltas

    def _canonical_prefill(self, prompt: list[int], keep_all: bool) -> tuple[Any, Any, Any]:
        """One prompt, reproducible: its longest prefix prefilled before (kept in ``_prefixes``) is taken as it was
        (the same keys and values a prefill of it now would give: canonical.py), and only the rest computed.
        ``keep_all`` (prompt log-probs) computes every position."""
        torch = self._torch
        from transformers import DynamicCache

        best, known = 0, None
        if not keep_all:
            for key in list(self._prefixes.keys()):
                n = 0
                for a, b in zip(key, prompt):
                    if a != b:
                        break
                    n += 1
                if n > best:
                    best, known = n, key
        reuse = min(best, len(prompt) - 1)  # at least the last token is computed: its logits draw the first answer token
        cache = DynamicCache()
        if known is not None and reuse > 0:
            for i, (k, v) in enumerate(self._prefixes[known]):
                cache.update(k[:, :, :reuse], v[:, :, :reuse], i)
        self._keys.lead = [0]
        ids = torch.tensor([prompt[reuse:]], dtype=torch.long)
        mask = torch.ones((1, len(prompt)), dtype=torch.long)
        out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                         position_ids=torch.arange(reuse, len(prompt))[None, :], logits_to_keep=0 if keep_all else 1)
        self._prefixes[tuple(prompt)] = [(layer.keys, layer.values) for layer in cache.layers]
        return out.logits, cache, mask

    def _admit(self, reqs: list[BackendRequest]) -> None:
        """Prefill newcomers (plain ones together; prompt-logprob ones alone), sample their first token, merge."""
        plain = [r for r in reqs if r.spec.logprob_start_len < 0]
        full = [r for r in reqs if r.spec.logprob_start_len >= 0]
        # reproducible: each prompt alone, so its prefill never meets another prompt's padding
        groups = ([plain] if plain and self._keys is None else []) + [[r] for r in (full if self._keys is None else reqs)]
        for group in groups:
            now = time.monotonic()
            rows = []
            for req in group:
                sp = req.spec.sampling
                seed = row_seed(sp.sampling_seed, req.spec.sample_index) if sp.sampling_seed is not None \
                    else self._rng.getrandbits(64)
                req.started = now
                rows.append(_Row(req=req, seed=seed))
                req.live = rows[-1].result
                if req.spec.top_logprobs_num > 0:
                    rows[-1].result.output_top_logprobs = []
                if req.spec.token_ids_logprob is not None:
                    rows[-1].result.output_token_ids_logprobs = []
            keep_all = group[0].spec.logprob_start_len >= 0
            logits, cache, mask, deltas = self._forward_prefill([r.req.spec.input_ids for r in rows], keep_all=keep_all,
                                                                images=[r.req.spec.image_data for r in rows])
            if deltas is not None:
                for row, delta in zip(rows, deltas.tolist()):
                    row.rope_delta = int(delta)
            self._prefills += 1
            if keep_all:
                res = rows[0].result
                res.input_logprobs, res.input_top_logprobs, res.input_token_ids_logprobs = prompt_logprobs(
                    logits[0], rows[0].req.spec)
            last = logits[:, -1, :].float()
            self._merge(cache, mask, rows)
            self._max_batch_seen = max(self._max_batch_seen, len(self._rows))
            # Sampling after the merge: the new rows are the last len(rows) of the batch.
            self._advance(rows, last)
            self._prune()

    def _merge(self, cache: Any, mask: Any, rows: list[_Row]) -> None:
        """Append a prefilled group to the running batch, left-padding KV and mask to a common length."""
        torch = self._torch
        if self._cache is None or not self._rows:
            self._cache, self._mask, self._rows = cache, mask, list(rows)
            return
        ta, tb = self._mask.shape[1], mask.shape[1]
        width = max(ta, tb)

        def lpad(t: Any, n: int, dim: int) -> Any:
            if n == 0:
                return t
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([torch.zeros(shape, dtype=t.dtype), t], dim=dim)

        for la, lb in zip(self._cache.layers, cache.layers):
            la.keys = torch.cat([lpad(la.keys, width - ta, 2), lpad(lb.keys, width - tb, 2)], dim=0)
            la.values = torch.cat([lpad(la.values, width - ta, 2), lpad(lb.values, width - tb, 2)], dim=0)
        self._mask = torch.cat([lpad(self._mask, width - ta, 1), lpad(mask, width - tb, 1)], dim=0)
        self._rows = self._rows + list(rows)

    def _prune(self) -> None:
        """Drop finished rows from the batch and trim padding columns no remaining row needs."""
        torch = self._torch
        keep = [i for i, r in enumerate(self._rows) if not r.finished]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._cache, self._mask = [], None, None
            return
        idx = torch.tensor(keep, dtype=torch.long)
        mask = self._mask[idx]
        lead = int((mask.cumsum(1) == 0).sum(1).min())  # leading all-padding columns
        for layer in self._cache.layers:
            layer.keys = layer.keys[idx, :, lead:]
            layer.values = layer.values[idx, :, lead:]
        self._mask = mask[:, lead:]
        self._rows = [self._rows[i] for i in keep]

    def _decode_step(self) -> None:
        torch = self._torch
        for row in self._rows:
            if row.req.abort_requested and not row.finished:
                row.result.finish_reason = finish_abort()
                self._finish_row(row)
        self._prune()
        if not self._rows:
            return
        b = len(self._rows)
        ids = torch.tensor([[r.last] for r in self._rows], dtype=torch.long)
        self._mask = torch.cat([self._mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
        pos = self._mask.sum(dim=1, keepdim=True) - 1
        if self.vision is not None:
            pos = self.vision.decode_positions(pos, torch.tensor([r.rope_delta for r in self._rows]))
        if self._keys is not None:
            self._keys.lead = (self._mask.shape[1] - self._mask.sum(dim=1)).tolist()
        out = self.model(input_ids=ids, attention_mask=self._mask, position_ids=pos, past_key_values=self._cache,
                         use_cache=True, logits_to_keep=1)
        self._decode_steps += 1
        self._max_batch_seen = max(self._max_batch_seen, b)
        self._advance(list(self._rows), out.logits[:, -1, :].float())
        self._prune()

    def _advance(self, rows: list[_Row], logits: Any) -> None:
        """Sample one token per row (``logits``: [len(rows), V] float32), record it, check finish."""
        torch = self._torch
        # the token after absolute position len(input) + len(output) - 1: a continuation lands on the same draw
        uniforms = [keyed_uniform(r.seed, len(r.req.spec.input_ids) + len(r.result.output_ids) - 1) for r in rows]
        samplings = [r.req.spec.sampling for r in rows]
        outputs = [r.result.output_ids for r in rows]
        if self._keys is None:
            tokens, lps, lp_matrix = sample(logits, samplings, uniforms, outputs, self.eos_token_ids)
        else:  # row by row: no batched reduction can reach across rows
            parts = [sample(logits[i:i + 1], samplings[i:i + 1], uniforms[i:i + 1], outputs[i:i + 1],
                            self.eos_token_ids) for i in range(len(rows))]
            tokens = [p[0][0] for p in parts]
            lps = [p[1][0] for p in parts]
            lp_matrix = torch.cat([p[2] for p in parts]) if parts else None
        for i, row in enumerate(rows):
            spec = row.req.spec
            res = row.result
            tok, lp = tokens[i], lps[i]
            if spec.top_logprobs_num > 0:
                tv, ti = lp_matrix[i].topk(spec.top_logprobs_num)
                res.output_top_logprobs.append(list(zip(tv.tolist(), ti.tolist())))
            if spec.token_ids_logprob is not None:
                sel = lp_matrix[i, list(spec.token_ids_logprob)].tolist()
                res.output_token_ids_logprobs.append(list(zip(sel, spec.token_ids_logprob)))
            res.output_logprobs.append(lp)
            res.output_logprob_ids.append(tok)
            if spec.max_new_tokens == 0:
                # SGLang still samples one token: empty output_ids, one phantom logprob, finish length 0.
                res.finish_reason = finish_length(0)
                self._finish_row(row)
                continue
            res.output_ids.append(tok)
            row.last = tok
            fin = check_finish(tok, len(res.output_ids), spec, self.eos_token_ids)
            if fin is not None:
                res.finish_reason = fin
                self._finish_row(row)

    def _finish_row(self, row: _Row) -> None:
        if row.finished:
            return
        row.finished = True
        self._busy_slot_seconds += time.monotonic() - row.req.started
        self._tokens += len(row.result.output_ids)
        row.req.finish(row.result)
