"""Qdrant treated as a dependency: every call within a deadline, behind a circuit breaker,
its failures as UNAVAILABLE, and readiness that follows a Qdrant server.

qdrant-client calls are synchronous, so they run on one thread (the server's, from
MeshServer.executor, shut down after the drain), which also serialises access to the
embedded store. The caller waits for at most its remaining deadline, or timeout_s when
it brings none. A call still queued when its caller gives up is dropped; one already
running finishes on the thread (qdrant-client's own timeout, the same timeout_s, bounds
a call to a server), so a write its caller saw fail may still land, which is harmless
because writes are by id. Qdrant unreachable, timing out or answering 5xx (or the
embedded store's disk failing) is `NotReady` with reason VECTOR_STORE_UNAVAILABLE; those
count against the breaker, while a refusal of the request itself does not.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
from qdrant_client import AsyncQdrantClient
from qdrant_client.common.client_exceptions import ResourceExhaustedResponse
from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

from mesh import deadline
from mesh.breaker import CircuitBreaker, Outcome, classify
from mesh.config import BreakerSettings
from mesh.errors import local_error, status
from mesh.failures import Failure, NotReady, Overloaded

log = logging.getLogger(__name__)

T = TypeVar("T")

UNAVAILABLE = "VECTOR_STORE_UNAVAILABLE"
# Failures of the store itself rather than of the request: the server unreachable or
# answering garbage (ResponseHandlingException wraps httpx's errors), the embedded store's
# files failing.
_STORE_ERRORS = (ResponseHandlingException, OSError, sqlite3.Error)


def display(url: str) -> str:
    """The URL without credentials or path, fit for error messages."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def _deadline_exceeded(message: str, reason: str) -> grpc.aio.AioRpcError:
    return local_error(status(grpc.StatusCode.DEADLINE_EXCEEDED, message, reason=reason))


class StoreCalls:
    def __init__(
        self, where: str, timeout_s: float, breaker: BreakerSettings, thread: Executor
    ) -> None:
        self.where = where
        self.timeout_s = timeout_s
        # A call is slow only when it took its whole timeout: a large batch written to the
        # embedded store takes seconds and is no sign of trouble.
        self.breaker = CircuitBreaker(
            f"qdrant:{where}", breaker.model_copy(update={"slow_call_s": timeout_s})
        )
        self.thread = thread  # one thread: the embedded store takes one caller at a time

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on the store's thread, as a dependency call: see the module doc."""
        left = deadline.remaining()
        if left is not None and left <= 0:
            raise _deadline_exceeded("no time left to call the vector store", "BUDGET_SPENT")
        timeout_s = self.timeout_s if left is None else min(left, self.timeout_s)
        name = getattr(work, "__name__", "call")
        refusal = self.breaker.before_call(name)
        if refusal is not None:
            raise local_error(refusal)
        started = time.monotonic()
        # Unless the call ends otherwise: a cancelled caller must give back a half-open
        # breaker's trial slot without counting for or against Qdrant.
        outcome = Outcome.IGNORED
        try:
            call = asyncio.get_running_loop().run_in_executor(self.thread, work, *args)
            result = await asyncio.wait_for(call, timeout_s)
            outcome = Outcome.SUCCESS
            return result
        except TimeoutError:
            if left is not None and left <= self.timeout_s:
                outcome = classify(
                    grpc.StatusCode.DEADLINE_EXCEEDED, timeout_s, self.breaker.settings
                )
                raise _deadline_exceeded(
                    f"the vector store ({self.where}) did not answer {name} in the caller's "
                    "deadline",
                    "VECTOR_STORE_DEADLINE",
                ) from None
            outcome = Outcome.FAILURE
            raise NotReady(
                f"the vector store ({self.where}) did not answer {name} in {timeout_s:g} s",
                reason=UNAVAILABLE,
            ) from None
        except Failure:
            outcome = Outcome.SUCCESS  # the store answered; the request found nothing etc.
            raise
        except ResourceExhaustedResponse as error:
            self.breaker.push_back(error.retry_after_s)
            raise Overloaded(
                f"the vector store ({self.where}) is overloaded: {error}",
                retry_after_s=error.retry_after_s,
                reason="VECTOR_STORE_OVERLOADED",
            ) from error
        except UnexpectedResponse as error:
            if error.status_code is not None and error.status_code < 500:
                raise  # the request was valid, so Qdrant refusing it is this service's bug
            outcome = Outcome.FAILURE
            raise self._unavailable(name, error) from error
        except _STORE_ERRORS as error:
            outcome = Outcome.FAILURE
            raise self._unavailable(name, error) from error
        finally:
            self.breaker.record(outcome, time.monotonic() - started)

    def _unavailable(self, name: str, error: Exception) -> NotReady:
        log.warning(
            "vector store call failed",
            extra={"where": self.where, "call": name, "error": str(error)[:500]},
        )
        return NotReady(
            f"the vector store ({self.where}) failed {name}: {type(error).__name__}",
            reason=UNAVAILABLE,
        )


class ServerProbe:
    """Whether a Qdrant server answers, asked asynchronously so a hung server holds no
    thread: the readiness of retrieval in URL mode."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self._client = AsyncQdrantClient(
            url=url, api_key=api_key, timeout=1, check_compatibility=False
        )

    async def answers(self) -> bool:
        try:
            await asyncio.wait_for(self._client.info(), 1.0)
        except Exception:  # any failure to answer is "not ready"; never raise into readiness
            return False
        return True

    async def wait(self, where: str) -> None:
        """Returns once the server answers, logging every 30 s while it does not."""
        logged_at: float | None = None
        while not await self.answers():
            if logged_at is None or time.monotonic() - logged_at >= 30:
                log.warning("waiting for the vector store", extra={"where": where})
                logged_at = time.monotonic()
            await asyncio.sleep(1)

    async def close(self) -> None:
        await self._client.close()
