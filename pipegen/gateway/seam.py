"""The actor <-> gateway seam, typed (as datatrove's pipeline/inference/types.py types the seam between its
pipeline and its inference servers): what the `external` loop needs of the server manager verl hands it
(`UnitServer`, which the actor's UnitServerManager satisfies). What one session call generates through and gets
back (`SessionGenerate`, `Generated`) is session.py's, the one module that calls it.

Owns: the shape of the seam. Must never: hold state, or import the actor (it satisfies the Protocol
structurally: the roles import the gateway, never the other way).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pipegen.gateway.http_server import Gateway
from pipegen.gateway.session import Generated


@runtime_checkable
class UnitServer(Protocol):
    """The server manager of one unit, as the `external` loop uses it: the actor's gateway, the unit's own
    sampling seed (None: the engine's), and generation with a seed chosen per call (a session's first call
    takes the unit's seed, its later calls seeds derived from it)."""

    gateway: Gateway
    sampling_seed: int | None

    async def generate_seeded(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                              seed: int | None) -> Generated: ...
