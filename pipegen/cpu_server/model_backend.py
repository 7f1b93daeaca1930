"""The contract between the CPU server and its model backend, and how a backend is named and built.

Owns: ``ModelBackend`` (the abstract backend: lifecycle, ``submit``/``abort``, counters, and the two class hooks
``add_arguments`` / ``from_args`` through which a backend declares and reads its own command-line flags, so the
server never knows a backend's constructor), ``load_backend_class`` (``--engine hf`` or an import path
``package.module:ClassName``), ``BackendRequest`` (one generation's life: abort flag, future, resolved once from
any thread), ``GenerationResult`` (what a backend hands back), and ``ModelFacts`` / ``read_model_facts`` (vocab
size, EOS ids and context length from a Hugging Face folder's JSON files, without torch).
Must never: import torch/transformers/aiohttp, import a backend implementation at module import time (they
are loaded by name when the server starts), or do network I/O.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import importlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipegen.cpu_server.parse import EntrySpec
from pipegen.config.schema import HF_BACKEND

HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"  # rids of the server's own /health_generate probes (as SGLang names them)
BUILTIN_BACKENDS = {HF_BACKEND: "pipegen.cpu_server.hf_backend:HFBackend"}

TopList = list[tuple[float, int]]


@dataclass
class GenerationResult:
    """What a backend hands back for one EntrySpec.

    ``output_logprobs`` / ``output_logprob_ids`` are per sampled token; with ``max_new_tokens = 0`` they hold
    the one phantom token that SGLang still samples while ``output_ids`` is empty. Input-side lists start at
    ``logprob_start_len``; their first element's logprob is None.
    """

    output_ids: list[int]
    finish_reason: dict
    output_logprobs: list[float] = field(default_factory=list)
    output_logprob_ids: list[int] = field(default_factory=list)
    input_logprobs: Optional[list[Optional[float]]] = None
    output_top_logprobs: Optional[list[TopList]] = None
    input_top_logprobs: Optional[list[Optional[TopList]]] = None
    output_token_ids_logprobs: Optional[list[TopList]] = None
    input_token_ids_logprobs: Optional[list[Optional[TopList]]] = None
    aborted_in_queue: bool = False
    num_retractions: int = 0
    cached_tokens: int = 0


class BackendRequest:
    """One generation travelling through a backend: the spec plus its mutable life (abort flag, future).

    Backends resolve it exactly once through ``finish`` (thread-safe); the server awaits ``future``.
    ``abort_requested`` is a plain attribute so a worker thread can poll it between decode steps.
    """

    __slots__ = ("spec", "future", "loop", "abort_requested", "state", "created", "started", "done", "live")

    def __init__(self, spec: EntrySpec, loop: asyncio.AbstractEventLoop) -> None:
        self.spec = spec
        self.loop = loop
        self.future: asyncio.Future[GenerationResult] = loop.create_future()
        self.abort_requested = False
        self.state = "waiting"  # waiting -> running -> done
        self.created = time.monotonic()
        self.started: Optional[float] = None
        self.done = False
        # the result the backend appends to while it generates, for a streamed answer's snapshots (server.py);
        # read from the loop while a worker thread appends: a snapshot takes the first len(output_ids) of each list
        self.live: Optional[GenerationResult] = None

    def finish(self, result: GenerationResult) -> None:
        """Resolve from any thread; later calls are ignored."""
        if self.done:
            return
        self.done = True
        self.state = "done"

        def _set() -> None:
            if not self.future.done():
                self.future.set_result(result)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            _set()
        else:
            try:
                self.loop.call_soon_threadsafe(_set)
            except RuntimeError:
                pass  # the loop is closed (shutdown): nobody is waiting any more


class ModelBackend(abc.ABC):
    """What the CPU server needs from a model backend (the built-in one: ``hf_backend.HFBackend``).

    Lifecycle: ``from_args`` (cheap, no model) -> ``load()`` in a worker thread after the port is bound ->
    ``await start()`` on the event loop -> ``submit``/``abort`` from the loop -> ``await close()``.
    """

    name: str = "backend"
    trivial_probe: bool = False  # True: /health_generate need not run a generation through this backend
    requires_model_path: bool = False  # True: --model-path must name a model folder (weights are loaded)
    vocab_size: int
    context_length: int
    eos_token_ids: frozenset[int]
    max_running_requests: int

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this backend's own command-line flags (the server's common ones are already there)."""

    @classmethod
    def from_args(cls, facts: ModelFacts, args: argparse.Namespace) -> ModelBackend:
        """Construct (not load) the backend from the model's facts and the parsed command line."""
        return cls(facts)  # type: ignore[call-arg]

    @abc.abstractmethod
    def load(self) -> None:
        """Blocking model load; runs in a worker thread while the server already answers /get_model_info."""

    async def start(self) -> None:
        """Start background work on the running loop (after load)."""

    @abc.abstractmethod
    def submit(self, req: BackendRequest) -> None:
        """Queue a generation; must not block. The backend later calls ``req.finish(result)``, and sets
        ``req.live`` to the result it appends each token to while it generates (a streamed answer reads it)."""

    @abc.abstractmethod
    def abort(self, req: BackendRequest) -> None:
        """Abort a queued or running generation: queued -> 'Abort in waiting queue', running -> 'Aborted'."""

    def stats(self) -> dict:
        """The backend's counters merged into /pipegen_stats."""
        return {}

    async def close(self) -> None:
        """Stop background work."""


def load_backend_class(name: str) -> type[ModelBackend]:
    """``hf`` -> the built-in transformers backend; ``package.module:ClassName`` -> that ModelBackend subclass.

    Raises ValueError (with a message for the command line) when the name does not lead to a ModelBackend.
    """
    path = BUILTIN_BACKENDS.get(name, name)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--engine {name!r}: expected 'hf' or an import path 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--engine {name!r}: cannot import {module_name}: {exc}") from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, ModelBackend)):
        raise ValueError(f"--engine {name!r}: {attr} in {module_name} is not a ModelBackend subclass")
    return cls


@dataclass(frozen=True)
class ModelFacts:
    """What the server needs to know about a model before (or without) loading it."""

    model_path: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    primary_eos: int  # config.json's eos (first of a list): what a synthetic backend emits to stop
    context_length: int
    model_type: Optional[str]
    architectures: Optional[list[str]]


def _as_id_set(v: Any) -> set[int]:
    if v is None:
        return set()
    if isinstance(v, list):
        return {int(x) for x in v if x is not None}
    return {int(v)}


def read_model_facts(model_path: Optional[str], *, default_vocab: int = 32000, default_eos: int = 2,
                     default_context: int = 4096) -> ModelFacts:
    """Read vocab size, EOS ids (config.json plus generation_config.json) and context length.

    Context length follows SGLang's get_context_length for the keys that matter here
    (max_position_embeddings and friends); no folder gives the defaults (a backend that needs no model).
    """
    cfg: dict = {}
    gen: dict = {}
    if model_path:
        p = Path(model_path)
        if (p / "config.json").is_file():
            cfg = json.loads((p / "config.json").read_text())
        if (p / "generation_config.json").is_file():
            gen = json.loads((p / "generation_config.json").read_text())
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    vocab = int(text_cfg.get("vocab_size") or cfg.get("vocab_size") or default_vocab)
    eos = _as_id_set(cfg.get("eos_token_id")) | _as_id_set(text_cfg.get("eos_token_id")) | _as_id_set(
        gen.get("eos_token_id"))
    if not eos:
        eos = {default_eos}
    cfg_eos = cfg.get("eos_token_id", text_cfg.get("eos_token_id"))
    if isinstance(cfg_eos, list):
        cfg_eos = cfg_eos[0] if cfg_eos else None
    primary = int(cfg_eos) if cfg_eos is not None else min(eos)
    ctx = None
    for key in ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings"):
        if text_cfg.get(key):
            ctx = int(text_cfg[key])
            break
    return ModelFacts(
        model_path=str(model_path or ""),
        vocab_size=vocab,
        eos_token_ids=frozenset(eos),
        primary_eos=primary,
        context_length=ctx or default_context,
        model_type=cfg.get("model_type"),
        architectures=cfg.get("architectures"),
    )
