"""One meter for every door: tenants' limits and the usage ledger, in one store.

A tenant's limits come from one file's `[tenants.<tenant>]` tables ([limits] tenants_file;
it may be the API key file itself), re-read when it changes:

    [tenants.acme]
    requests_per_minute = 60     # charged where a request enters: the edge or the gateway
    tokens_per_minute = 20000    # charged by the generation router, whoever sent the request
    token_budget = 1000000       # prompt + completion tokens
    budget_period = "month"      # renewed each UTC calendar month ("day"; "lifetime": never)

Requests are charged once, at the door they come in by (the edge's authorizer for gRPC and
JSON routes, the gateway for its HTTP API), to the tenant's one requests bucket. Tokens are
charged by the generation router, which every generation passes (the gateway's, the edge's
gRPC and JSON calls, an agent's runs) and which holds the tokenizer: it reserves the real
prompt tokens (chat template included) plus the most the request may generate, all or
nothing against the tokens bucket and the budget, then settles to what was computed however
the request ended - the prompt once it went to prefill, every generated token, a client
gone or not. Concurrent requests each hold their whole reservation, so a budget is never
overspent. The same settlement writes the ledger and the counters, so they agree with the
responses' usage to the token.

State lives in the store ([limits] store, mesh/ledger.py): one SQLite file for the
processes of one machine by default, Redis across machines.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from mesh.config import LimitsSettings
from mesh.failures import NotReady, QuotaExceeded
from mesh.keys import WatchedFile, read_key_file
from mesh.ledger import PREFIX, Limit, Refusal, Store, open_store
from mesh.periods import Period, Span, current

log = logging.getLogger(__name__)

# A past period's budget stays this long, for settlements of requests that ran across
# the period's end (they settle where they were charged).
BUDGET_GRACE = timedelta(days=1)
# A settlement the store refused is tried again this often, twice as long apart each time
# from 0.1 s (13 s of waiting in all, each try's own timeout besides), before it is given
# up (and logged, and counted): a store back within that loses no usage.
SETTLE_ATTEMPTS = 8
SETTLE_MAX_BACKOFF_S = 10.0
# At shutdown, settlements still waiting for the store get this long; the rest are lost
# (counted), so a store that is down cannot hold a draining process past its grace.
CLOSE_WAIT_S = 2.0

# Label values are bounded: tenants are the key file's (the edge and the gateway send no
# other), models the router's registry.
TOKENS = Counter(
    "aimesh_tenant_tokens_total",
    "The usage ledger: tokens computed, by tenant, model and kind (prompt, completion).",
    ["tenant", "model", "kind"],
)
REQUESTS = Counter(
    "aimesh_tenant_requests_total",
    "The usage ledger: requests served, by tenant and model.",
    ["tenant", "model"],
)
IMAGES = Counter(
    "aimesh_tenant_images_total",
    "The usage ledger: images generated, by tenant and model.",
    ["tenant", "model"],
)
LIMITED = Counter(
    "aimesh_tenant_limited_total",
    "Requests refused by a tenant's limit (requests_per_minute, tokens_per_minute, token_budget).",
    ["tenant", "limit"],
)
LOST = Counter(
    "aimesh_tenant_settlements_lost_total",
    "Settlements (usage and reservations' differences) the store would not take after every retry.",
)


class TenantLimits(BaseModel):
    """A tenant's limits; each one unset is no limit. The per-minute ones are token
    buckets (their whole minute is the burst, refilled continuously); the budget counts
    prompt + completion tokens over each `budget_period` (a UTC calendar day or month, or
    the tenant's lifetime; raise it in the file to top it up)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    token_budget: int | None = Field(default=None, ge=0)
    budget_period: Period = "lifetime"

    @property
    def counts_tokens(self) -> bool:
        return self.tokens_per_minute is not None or self.token_budget is not None


NO_LIMITS = TenantLimits()


class _TenantsTables(BaseModel):
    """The file's `tenants` tables; anything else in it (the keys) is not read here."""

    model_config = ConfigDict(extra="ignore")

    tenants: dict[str, TenantLimits] = Field(default_factory=dict)


def _parse_tenants(data: Any) -> dict[str, TenantLimits]:
    return _TenantsTables.model_validate(data).tenants


class TenantsFile:
    """Each tenant's limits from the file's `[tenants.NAME]` tables, re-read when it
    changes; a file that stops parsing leaves the limits read before in force."""

    def __init__(self, path: Path | None) -> None:
        self._file = (
            None if path is None else WatchedFile(path, _parse_tenants, {}, kind="tenants file")
        )

    def limits(self, tenant: str) -> TenantLimits:
        return NO_LIMITS if self._file is None else self._file.current().get(tenant, NO_LIMITS)


def warn_unenforced(key_file: Path, settings: LimitsSettings) -> None:
    """Says so, at start, when a door's key file has `[tenants]` tables that no meter
    reads ([limits] tenants_file names another file or none): limits written where they
    used to be read must not silently stop limiting."""
    if settings.tenants_file is not None and settings.tenants_file.resolve() == key_file.resolve():
        return
    try:
        tables = read_key_file(key_file).get("tenants")
    except (OSError, ValueError, AttributeError):
        return  # the key file's own reader reports a file it cannot read
    if tables:
        log.error(
            "the key file has [tenants] limits that are not enforced: set [limits] "
            "tenants_file to it (limits are read from that one file by every door and the "
            "generation router)",
            extra={"path": str(key_file)},
        )


class MeterUnavailable(NotReady):
    """The store does not answer: nobody can be charged, so nobody is served (a limit that
    could not be checked is not a limit)."""

    reason = "LIMITS_STORE_UNAVAILABLE"


def _store_down() -> MeterUnavailable:
    return MeterUnavailable("the limits store is unavailable; try again")


@dataclass
class Reservation:
    """What one admitted request holds against its tenant's token limits."""

    tenant: str
    limits: TenantLimits
    tokens: int  # reserved; 0 for a tenant without token limits
    span: Span  # the budget period charged


class Meter:
    def __init__(
        self,
        store: Store,
        tenants: TenantsFile,
        *,
        window_s: float = 60.0,
        reserve_tokens: int = 256,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.store = store
        self.tenants = tenants
        self.window_s = window_s
        self.reserve_tokens = reserve_tokens
        self.clock = clock
        # Settlements under way: a task each, so none is lost to a cancelled request and
        # `close` can wait for them.
        self._settling: set[asyncio.Task[None]] = set()

    @classmethod
    def from_settings(cls, settings: LimitsSettings, cache_dir: Path) -> Meter:
        return cls(
            open_store(settings.store, cache_dir),
            TenantsFile(settings.tenants_file),
            window_s=settings.window_s,
            reserve_tokens=settings.reserve_tokens,
        )

    def limits(self, tenant: str) -> TenantLimits:
        return self.tenants.limits(tenant)

    def _bucket(self, name: str, tenant: str, per_window: int, amount: float) -> Limit:
        return Limit(
            name, f"{PREFIX}{name}:{tenant}", per_window, per_window / self.window_s, amount
        )

    def _token_limits(
        self, tenant: str, limits: TenantLimits, tokens: float, span: Span
    ) -> list[Limit]:
        charged = []
        if limits.tokens_per_minute is not None:
            charged.append(
                self._bucket("tokens_per_minute", tenant, limits.tokens_per_minute, tokens)
            )
        if limits.token_budget is not None:
            key = f"{PREFIX}token_budget:{tenant}" + (f":{span.label}" if span.label else "")
            left = span.seconds_left(self.clock())
            ttl_s = 0.0 if left is None else left + BUDGET_GRACE.total_seconds()
            charged.append(Limit("token_budget", key, limits.token_budget, 0.0, tokens, ttl_s))
        return charged

    async def _take(
        self, tenant: str, limits: list[Limit], refusal: Callable[[Refusal], QuotaExceeded]
    ) -> None:
        if not limits:
            return
        try:
            refused = await self.store.take(limits)
        except Exception as error:
            log.error("the limits store failed", extra={"problem": type(error).__name__})
            raise _store_down() from None
        if refused is not None:
            LIMITED.labels(tenant, refused.limit).inc()
            raise refusal(refused)

    async def admit_request(self, tenant: str) -> None:
        """Charges one request to the tenant's requests_per_minute, or raises
        QuotaExceeded (NotReady while the store does not answer)."""
        rate = self.limits(tenant).requests_per_minute
        if rate is None:
            return
        per = f"{rate} per {self.window_s:g} s"

        def refusal(refused: Refusal) -> QuotaExceeded:
            wait_s = self.window_s if refused.wait_s is None else refused.wait_s
            return QuotaExceeded(
                f"rate limit reached for requests_per_minute (tenant {tenant!r}: {per}); "
                f"try again in {wait_s:.3f} s",
                reason="RATE_LIMIT_EXCEEDED",
                retry_after_s=wait_s,
                metadata={"tenant": tenant, "limit": "requests_per_minute"},
            )

        await self._take(tenant, [self._bucket("requests_per_minute", tenant, rate, 1)], refusal)

    async def reserve(self, tenant: str, tokens: int) -> Reservation:
        """Holds `tokens` (the most a request may use) against the tenant's
        tokens_per_minute and token_budget, all or none, or raises QuotaExceeded."""
        limits = self.limits(tenant)
        span = current(limits.budget_period, self.clock())
        if not limits.counts_tokens:
            return Reservation(tenant, limits, 0, span)

        def refusal(refused: Refusal) -> QuotaExceeded:
            return self._token_refusal(tenant, limits, refused, tokens, span)

        reservation = Reservation(tenant, limits, tokens, span)
        charging = asyncio.ensure_future(
            self._take(tenant, self._token_limits(tenant, limits, tokens, span), refusal)
        )
        try:
            await asyncio.shield(charging)
        except asyncio.CancelledError:
            # The caller left while the store charged: once it has, the tokens go back
            # (nobody will settle a reservation its caller never got).
            charging.add_done_callback(
                lambda done: (
                    None if done.cancelled() or done.exception() else self.settle(reservation, "")
                )
            )
            raise
        return reservation

    def _token_refusal(
        self, tenant: str, limits: TenantLimits, refused: Refusal, tokens: int, span: Span
    ) -> QuotaExceeded:
        metadata = {"tenant": tenant, "limit": refused.limit}
        if refused.limit == "token_budget":
            renews = f"; it renews at {span.ends.isoformat()}" if span.ends else ""
            return QuotaExceeded(
                f"tenant {tenant!r} has spent its token budget ({limits.token_budget} tokens; "
                f"this request needs up to {tokens})" + renews,
                reason="INSUFFICIENT_QUOTA",
                retry_after_s=None,
                metadata=metadata,
            )
        per = f"{limits.tokens_per_minute} per {self.window_s:g} s"
        if refused.wait_s is None:
            return QuotaExceeded(
                f"request too large: it may use {tokens} tokens, more than tenant {tenant!r}'s "
                f"tokens_per_minute ({per}); lower max_tokens",
                reason="REQUEST_TOO_LARGE",
                retry_after_s=None,
                metadata=metadata,
            )
        return QuotaExceeded(
            f"rate limit reached for tokens_per_minute (tenant {tenant!r}: {per}); "
            f"try again in {refused.wait_s:.3f} s",
            reason="RATE_LIMIT_EXCEEDED",
            retry_after_s=refused.wait_s,
            metadata=metadata,
        )

    def settle(
        self,
        reservation: Reservation,
        model: str,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        images: int = 0,
    ) -> None:
        """What a request used, settled against its reservation (the difference given
        back) and, when anything was computed, written to the ledger and the counters.
        Synchronous, so a `finally` of a cancelled request cannot be stopped halfway: the
        store's part runs as a task of its own, retried while the store does not answer."""
        tenant = reservation.tenant
        used = prompt_tokens + completion_tokens
        counts: dict[str, int] = {}
        if used or images:
            REQUESTS.labels(tenant, model).inc()
            TOKENS.labels(tenant, model, "prompt").inc(prompt_tokens)
            if completion_tokens:
                TOKENS.labels(tenant, model, "completion").inc(completion_tokens)
            if images:
                IMAGES.labels(tenant, model).inc(images)
            counts = {
                "requests": 1,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "images": images,
            }
        difference = used - reservation.tokens if reservation.tokens else 0
        if not counts and not difference:
            return
        task = asyncio.get_running_loop().create_task(
            self._settle(reservation, difference, model, counts), name=f"settle:{tenant}"
        )
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(
        self, reservation: Reservation, difference: int, model: str, counts: dict[str, int]
    ) -> None:
        """One write, retried with backoff while the store fails (the store lands it
        once, however often it is sent: mesh/ledger.py)."""
        limits = self._token_limits(
            reservation.tenant, reservation.limits, difference, reservation.span
        )
        settlement = os.urandom(16).hex()
        delay = 0.1
        for attempt in range(1, SETTLE_ATTEMPTS + 1):
            try:
                await self.store.settle(
                    settlement, limits if difference else [], reservation.tenant, model, counts
                )
                return
            except Exception as error:
                if attempt == SETTLE_ATTEMPTS:
                    LOST.inc()
                    log.error(
                        "the limits store would not take a tenant's settlement; it is lost",
                        extra={"problem": type(error).__name__, "attempts": attempt},
                    )
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, SETTLE_MAX_BACKOFF_S)

    async def usage(self) -> dict[tuple[str, str], dict[str, int]]:
        """The ledger: (tenant, model) -> counts by kind."""
        try:
            return await self.store.usage()
        except Exception as error:
            log.error("the limits store failed", extra={"problem": type(error).__name__})
            raise _store_down() from None

    async def flush(self) -> None:
        """Returns once every settlement made so far is in the store (or given up)."""
        while self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

    async def close(self) -> None:
        """Waits for the settlements under way (CLOSE_WAIT_S at most), then closes the
        store."""
        if self._settling:
            _, late = await asyncio.wait(self._settling, timeout=CLOSE_WAIT_S)
            for task in late:
                task.cancel()
            if late:
                LOST.inc(len(late))
                log.error(
                    "the limits store did not take %d settlements before shutdown; lost",
                    len(late),
                )
        await self.store.close()
