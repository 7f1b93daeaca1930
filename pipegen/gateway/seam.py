"""The actor <-> gateway seam, typed (as datatrove's pipeline/inference/types.py types the seam between its
pipeline and its inference servers): what the `external` loop needs of the server manager verl hands it
(`UnitServer`, which the actor's UnitServerManager satisfies), what one session call generates through
(`SessionGenerate`), and what it gets back (`Generated`).

Owns: these three shapes. Must never: hold state, or import the actor (it satisfies them structurally: the
roles import the gateway, never the other way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pipegen.gateway.http_server import Gateway


class Generated(Protocol):
    """One engine answer as verl's server manager returns it (verl's TokenOutput)."""

    token_ids: list[int]
    log_probs: list[float] | None


class SessionGenerate(Protocol):
    """A session's one way to the engines: the unit's server manager, with the seed of this call."""

    def __call__(self, prompt_ids: list[int], sampling_params: dict[str, Any],
                 seed: int | None) -> Awaitable[Generated]: ...


@runtime_checkable
class UnitServer(Protocol):
    """The server manager of one unit, as the `external` loop uses it: the actor's gateway, the unit's own
    sampling seed (None: the engine's), and generation with a seed chosen per call (a session's first call
    takes the unit's seed, its later calls seeds derived from it)."""

    gateway: Gateway
    sampling_seed: int | None

    async def generate_seeded(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                              seed: int | None) -> Generated: ...
