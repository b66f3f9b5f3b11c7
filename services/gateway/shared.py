"""What every model endpoint of the gateway works with, built once by the service."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.admission import Slots
from services.gateway.catalog import Catalog
from services.gateway.limits import Limiter


@dataclass(frozen=True)
class Shared:
    """The models the mesh serves, the gateway's compute slots, the tenants' limits, and
    how long one send to a client may stall before it counts as gone."""

    catalog: Catalog
    slots: Slots
    limiter: Limiter
    send_timeout_s: float
