"""API keys: a file of sha256 digests, each naming a tenant and its scopes, re-read when
it changes (a rotated key works, and a revoked one stops, without a restart).

The file holds only digests, so it can live in a Kubernetes Secret or a repo without
handing out keys; a key itself is never stored, compared or logged, only its digest.
JSON (`{"keys": [...]}`) or TOML (`[[keys]]`), chosen by the file's suffix:

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

import hashlib
import json
import logging
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.periods import Period

log = logging.getLogger(__name__)

Scope = Literal["generate", "embed", "images", "admin"]
ALL_SCOPES: frozenset[str] = frozenset(Scope.__args__)  # type: ignore[attr-defined]
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


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tenant: str = Field(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")
    scopes: list[Scope]


class KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry] = Field(default_factory=list)
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)


def digest(key: str) -> str:
    """What the file stores for `key`."""
    return hashlib.sha256(key.encode()).hexdigest()


def _parse(path: Path) -> dict[str, Principal]:
    text = path.read_text()
    data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    parsed = KeyFile.model_validate(data)
    return {
        e.sha256: Principal(e.tenant, frozenset(e.scopes), parsed.tenants.get(e.tenant, NO_LIMITS))
        for e in parsed.keys
    }


class KeyStore:
    """The keys of one file, re-read on the first lookup after the file changed. A file
    that does not parse leaves the keys read before in force (and says so in the log), so
    a half-written rotation never locks every tenant out."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._principals: dict[str, Principal] = {}

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def _refresh(self) -> None:
        stamp = self._stamp()
        if stamp == self._seen:
            return
        self._seen = stamp
        if stamp is None:
            log.error(
                "API key file is missing; every key is refused", extra={"path": str(self.path)}
            )
            self._principals = {}
            return
        try:
            self._principals = _parse(self.path)
        except (OSError, ValueError, ValidationError) as error:
            # ValidationError names fields and positions, never a value that could be a key.
            log.error(
                "API key file did not parse; the keys read before stay in force",
                extra={"path": str(self.path), "problem": type(error).__name__},
            )
            return
        log.info("API keys loaded", extra={"path": str(self.path), "keys": len(self._principals)})

    def lookup(self, key: str | None) -> Principal | None:
        """The principal `key` stands for; None for no key or an unknown one."""
        self._refresh()
        return None if key is None else self._principals.get(digest(key))


class OpenAccess:
    """No key file configured: every caller is the anonymous tenant with every scope (a
    gateway on loopback for one user, as vLLM without --api-key)."""

    def lookup(self, key: str | None) -> Principal | None:
        return Principal(ANONYMOUS, ALL_SCOPES)
