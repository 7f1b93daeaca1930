"""What an actor's requests may ask and how its client behaves: `ClientLimits`.

The request itself (the token budget rule, the ids check, each engine's body and answer) is
pipegen/engines/'s; the limits here add the client's timing knobs to the token budget engines read (a request's clock
deadline and hedging are the actor's admission policy: admission.py; a stall, the engine's evidence: attempts.py).
Owns: `ClientLimits`. Must never: do I/O (sending.py sends, attempts.py retries).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipegen.engines import READY_TIMEOUT_S
from pipegen.config.schema import CpuServers, Generation

@dataclass
class ClientLimits:
    prompt_length: int
    response_length: int
    max_model_len: int
    request_timeout_s: float = CpuServers.request_timeout_s  # the schema's defaults: one place for each
    max_attempts: int = Generation.max_attempts  # tries per request (over servers) before RetriesExhausted
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    quarantine_after: int = 3  # consecutive failures that take a server out of rotation
    probe_interval_s: float = 1.0
    probe_timeout_s: float = READY_TIMEOUT_S  # the readiness probe's own bound
    vocab_size: int | None = None  # ids >= this are refused before sending (SGLang does not check)
    abort_timeout_s: float = 5.0  # POST /abort_request; a wedged server may not answer it either
    # the engine draws each token from (seed, absolute position) (pipegen's CPU server; SGLang in deterministic mode):
    # an answer's rest keeps the call's seed and lands on the uninterrupted answer's draws (engines/request.py)
    draws_by_position: bool = False
