"""Per-tenant limits and the usage ledger, over a Store (services/gateway/store.py).

A request is admitted before the mesh is called (before its compute slot too): one
all-or-nothing charge of 1 request against `requests_per_minute` and of its token
estimate against `tokens_per_minute` and `token_budget` (of the current `budget_period`,
services/gateway/periods.py). The estimate is the prompt's
characters / 4 (rounded up) plus the completion tokens it may generate: its `max_tokens`,
or `reserve_tokens` when it names none, and that number then becomes its hard limit, so
no generation (streamed or not) runs past what it reserved. At the end the charge is
settled to what was really used (the generation's prompt + completion tokens; tokens
already streamed when it failed or the client went away; nothing when the mesh refused it),
giving back or taking the difference.

Refusals are 429s in OpenAI's shape: a bucket says when it will have room in
`Retry-After` (seconds, rounded up) and `retry-after-ms`, which the openai SDK waits for
before its retry; a request larger than the tokens-per-minute bucket (`request_too_large`)
or past the budget (`insufficient_quota`, OpenAI's code) carries no retry time; its
message says when a periodic budget renews.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from services.gateway import metrics
from services.gateway.errors import ApiError, retry_headers
from services.gateway.keys import Principal
from services.gateway.periods import Span, current
from services.gateway.store import PREFIX, Limit, Refusal, Store

log = logging.getLogger(__name__)

# Characters per token for the up-front estimate of a prompt (OpenAI's rule of thumb).
CHARS_PER_TOKEN = 4
# A past period's budget stays this long, for settlements of requests that ran across
# the period's end (they settle where they were charged).
BUDGET_GRACE = timedelta(days=1)


def prompt_estimate(text_chars: int) -> int:
    return math.ceil(text_chars / CHARS_PER_TOKEN)


def _unavailable() -> ApiError:
    return ApiError(
        503,
        "the limits store is unavailable; try again",
        type="service_unavailable_error",
        code="limits_store_unavailable",
        headers=retry_headers(1.0),
    )


@dataclass
class Reservation:
    """What one admitted request holds against its tenant's token limits."""

    limiter: Limiter
    principal: Principal
    tokens: int
    span: Span  # the budget period charged
    settled: bool = False

    async def settle(self, used: int) -> None:
        """Gives back (or takes) the difference between the reservation and `used`."""
        if self.settled:
            return
        self.settled = True
        limits = self.limiter.token_limits(self.principal, used - self.tokens, self.span)
        if not limits or used == self.tokens:
            return
        try:
            await self.limiter.store.take(limits, force=True)
        except Exception as error:  # the request is answered; its accounting is not
            log.error(
                "could not settle a tenant's tokens",
                extra={"tenant": self.principal.tenant, "problem": type(error).__name__},
            )


class Limiter:
    def __init__(
        self,
        store: Store,
        *,
        window_s: float = 60.0,
        reserve_tokens: int = 256,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ):
        self.store = store
        self.window_s = window_s
        self.reserve_tokens = reserve_tokens
        self.clock = clock

    def _bucket(self, name: str, tenant: str, per_window: int, amount: float) -> Limit:
        return Limit(
            name, f"{PREFIX}{name}:{tenant}", per_window, per_window / self.window_s, amount
        )

    def token_limits(self, principal: Principal, tokens: float, span: Span) -> list[Limit]:
        limits = principal.limits
        tenant = principal.tenant
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

    def counts_tokens(self, principal: Principal) -> bool:
        limits = principal.limits
        return limits.tokens_per_minute is not None or limits.token_budget is not None

    async def admit(self, principal: Principal, tokens: int) -> Reservation:
        """Charges one request and `tokens` (estimated) or raises the 429."""
        limits = []
        if principal.limits.requests_per_minute is not None:
            rpm = principal.limits.requests_per_minute
            limits.append(self._bucket("requests_per_minute", principal.tenant, rpm, 1))
        span = current(principal.limits.budget_period, self.clock())
        limits += self.token_limits(principal, tokens, span)
        if limits:
            try:
                refused = await self.store.take(limits)
            except Exception as error:
                log.error("the limits store failed", extra={"problem": type(error).__name__})
                raise _unavailable() from None
            if refused is not None:
                metrics.LIMITED.labels(principal.tenant, refused.limit).inc()
                raise self._refusal(principal, refused, tokens, span)
        return Reservation(self, principal, tokens if self.counts_tokens(principal) else 0, span)

    def _refusal(self, principal: Principal, refused: Refusal, tokens: int, span: Span) -> ApiError:
        tenant = principal.tenant
        if refused.limit == "token_budget":
            renews = f"; it renews at {span.ends.isoformat()}" if span.ends else ""
            return ApiError(
                429,
                f"tenant {tenant!r} has spent its token budget "
                f"({principal.limits.token_budget} tokens; this request needs up to {tokens})"
                + renews,
                type="insufficient_quota",
                code="insufficient_quota",
            )
        limit = getattr(principal.limits, refused.limit)
        per = f"{limit} per {self.window_s:g} s"
        if refused.wait_s is None:
            return ApiError(
                429,
                f"request too large: it may use {tokens} tokens, more than tenant {tenant!r}'s "
                f"tokens_per_minute ({per}); lower max_tokens",
                type="rate_limit_error",
                code="request_too_large",
            )
        return ApiError(
            429,
            f"rate limit reached for {refused.limit} (tenant {tenant!r}: {per}); "
            f"try again in {refused.wait_s:.3f} s",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers=retry_headers(refused.wait_s),
        )

    async def record(
        self,
        tenant: str,
        model: str,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        images: int = 0,
    ) -> None:
        """One served request in the ledger (the store's and Prometheus')."""
        metrics.record_usage(tenant, model, prompt_tokens, completion_tokens, images)
        counts = {
            "requests": 1,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "images": images,
        }
        try:
            await self.store.record(tenant, model, counts)
        except Exception as error:
            log.error(
                "could not record usage",
                extra={"tenant": tenant, "problem": type(error).__name__},
            )

    async def usage(self, principal: Principal) -> list[dict[str, object]]:
        """GET /v1/usage: every tenant's rows for an admin, else the caller's own."""
        try:
            rows = await self.store.usage()
        except Exception as error:
            log.error("the limits store failed", extra={"problem": type(error).__name__})
            raise _unavailable() from None
        everyone = "admin" in principal.scopes
        return [
            {"tenant": tenant, "model": model, **counts}
            for (tenant, model), counts in sorted(rows.items())
            if everyone or tenant == principal.tenant
        ]
