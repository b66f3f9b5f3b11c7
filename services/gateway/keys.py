"""The gateway's API keys: mesh/keys.py's file of digests (one key model with the edge),
plus optional limits per tenant in the same file:

    [[keys]]
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    tenant = "acme"
    scopes = ["generate", "embed"]

    [tenants.acme]               # optional limits per tenant (services/gateway/limits.py)
    requests_per_minute = 60
    tokens_per_minute = 20000
    token_budget = 1000000       # prompt + completion tokens
    budget_period = "month"      # renewed each UTC calendar month ("day"; "lifetime": never)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mesh import keys
from mesh.keys import ALL_SCOPES, KeyEntry
from services.gateway.periods import Period

ANONYMOUS = "anonymous"


class TenantLimits(BaseModel):
    """A tenant's limits; each one unset is no limit. The per-minute ones are token
    buckets (their whole minute is the burst, refilled continuously); the budget counts
    prompt + completion tokens in the limits store over each `budget_period` (a UTC
    calendar day or month, or the tenant's lifetime; raise it here to top it up)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    token_budget: int | None = Field(default=None, ge=0)
    budget_period: Period = "lifetime"


NO_LIMITS = TenantLimits()


@dataclass(frozen=True)
class Principal:
    """Who a request is for: the tenant its key belongs to, what it may do and within
    which limits."""

    tenant: str
    scopes: frozenset[str]
    limits: TenantLimits = NO_LIMITS


class KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry] = Field(default_factory=list)
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)


def _principals(data: Any) -> dict[str, Principal]:
    parsed = KeyFile.model_validate(data)
    return {
        e.sha256: Principal(e.tenant, frozenset(e.scopes), parsed.tenants.get(e.tenant, NO_LIMITS))
        for e in parsed.keys
    }


class KeyStore(keys.KeyStore[Principal]):
    """The keys of one file with their tenants' limits, re-read when it changes."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, _principals)


class OpenAccess:
    """No key file configured: every caller is the anonymous tenant with every scope (a
    gateway on loopback for one user, as vLLM without --api-key)."""

    def lookup(self, key: str | None) -> Principal | None:
        return Principal(ANONYMOUS, ALL_SCOPES)
