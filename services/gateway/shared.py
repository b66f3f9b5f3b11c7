"""What every model endpoint of the gateway works with, built once by the service."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from mesh.errors import local_error, status_for_failure
from mesh.failures import Failure
from mesh.metering import Meter
from services.gateway.admission import Slots
from services.gateway.catalog import Catalog
from services.gateway.errors import ApiError, from_rpc
from services.gateway.keys import Principal

# Characters per token for the up-front estimate of an embedding's or a rerank's input
# (OpenAI's rule of thumb); the service's own count settles it.
CHARS_PER_TOKEN = 4


def prompt_estimate(text_chars: int) -> int:
    return math.ceil(text_chars / CHARS_PER_TOKEN)


@dataclass
class Charge:
    """What an admitted request was served, as its service counted it: what its
    reservation is settled to and the ledger records."""

    prompt_tokens: int = 0
    images: int = 0


def refusal(failure: Failure) -> ApiError:
    """The meter's refusal as the router's would read at the gateway: one translation
    (errors.from_rpc) for a limit met here and one met in the mesh."""
    return from_rpc(local_error(status_for_failure(failure)), {})


@dataclass(frozen=True)
class Shared:
    """The models the mesh serves, the gateway's compute slots, the mesh's meter, and
    how long one send to a client may stall before it counts as gone."""

    catalog: Catalog
    slots: Slots
    meter: Meter
    send_timeout_s: float

    @asynccontextmanager
    async def admitted(
        self,
        principal: Principal,
        route: str,
        *,
        model: str | None,
        tokens: int = 0,
        streaming: bool = False,
    ) -> AsyncIterator[Charge]:
        """One request through the gate every endpoint shares: charged to its tenant's
        requests_per_minute (this is the door it came in by) and `tokens` (estimated)
        against its token limits, then holding a compute slot; at the end, however it ends,
        settled to what the Charge says was served and written to the ledger under `model`.
        Generations pass no model: the generation router meters their tokens, whoever
        sends them."""
        tenant = principal.tenant
        try:
            await self.meter.admit_request(tenant)
            reservation = await self.meter.reserve(tenant, tokens)
        except Failure as refused:
            raise refusal(refused) from None
        charge = Charge()
        try:
            async with self.slots.held(route, streaming=streaming):
                yield charge
        finally:
            if model is not None:
                self.meter.settle(
                    reservation, model, prompt_tokens=charge.prompt_tokens, images=charge.images
                )
