"""What every model endpoint of the gateway works with, built once by the service."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from services.gateway.admission import Slots
from services.gateway.catalog import Catalog
from services.gateway.keys import Principal
from services.gateway.limits import Limiter


@dataclass
class Charge:
    """The tokens an admitted request used: what its reservation is settled to."""

    used: int = 0


@dataclass(frozen=True)
class Shared:
    """The models the mesh serves, the gateway's compute slots, the tenants' limits, and
    how long one send to a client may stall before it counts as gone."""

    catalog: Catalog
    slots: Slots
    limiter: Limiter
    send_timeout_s: float

    @asynccontextmanager
    async def admitted(
        self, principal: Principal, tokens: int, route: str, *, streaming: bool = False
    ) -> AsyncIterator[Charge]:
        """One request through the gate every endpoint shares: charged against its
        tenant's limits (`tokens` estimated), then holding a compute slot; at the end,
        however it ends, its reservation is settled to the Charge's `used` (0 unless the
        work set it: a request the mesh refused costs nothing)."""
        reservation = await self.limiter.admit(principal, tokens)
        charge = Charge()
        try:
            async with self.slots.held(route, streaming=streaming):
                yield charge
        finally:
            await reservation.settle(charge.used)
