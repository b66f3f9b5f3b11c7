"""How a process stands with a store it keeps shared state in (the model registry, the
agent's run store), for processes that keep serving while that store fails.

A store fault must not end a process that can still do its work: the router serves the
last registry table it read, the agent retries its lease upkeep. What such a process owes
its operators is to say so, once, and to retry without hammering a store that is coming
back. `StoreHealth` is that, in one place:

- `aimesh_store_state{store, state}`: 1 for the state the store is in here (`ok`, or why
  not: `unreachable`, `invalid`, ...), 0 for the states it was in before;
  `aimesh_store_last_success_timestamp_seconds{store}`: when it last answered well.
- One log line per change of state (WARNING when it fails, with the error; INFO when it
  is back), never one per try.
- The health service name `<service>.<store>` (grpc.health.v1, beside readiness):
  SERVING while the store answers, NOT_SERVING while it fails. A detail for operators and
  alerts, not readiness: the process keeps serving, and taking every replica out of
  rotation for a fault they all share would turn it into an outage.
- `retry_in()`: the wait before the next try, doubling from `base_s` to `max_s` with
  jitter, so replicas that failed together do not retry together.
"""

from __future__ import annotations

import logging
import random
import time

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer
from prometheus_client import Gauge

log = logging.getLogger(__name__)

OK = "ok"
STATE = Gauge(
    "aimesh_store_state",
    "1 for the state a shared store is in as this process sees it (ok, unreachable, "
    "invalid, ...), 0 for the states it was in before.",
    ["store", "state"],
)
LAST_SUCCESS = Gauge(
    "aimesh_store_last_success_timestamp_seconds",
    "Unix time this process last read or wrote the shared store successfully.",
    ["store"],
)


class StoreHealth:
    """The state of one store as this process sees it; see the module's docstring."""

    def __init__(
        self,
        store: str,
        *,
        health: HealthServicer | None = None,
        service: str = "",
        base_s: float = 0.5,
        max_s: float = 2.0,
    ) -> None:
        self.store = store
        self.health_name = f"{service}.{store}" if service else store
        self._health = health
        self.base_s = base_s
        self.max_s = max_s
        self.state: str | None = None  # None until the first try
        self.problem = ""
        self.failures = 0  # tries failed in a row

    @property
    def ok(self) -> bool:
        return self.state == OK

    async def succeeded(self) -> None:
        """The store answered well: back to ok (said once, if it was not)."""
        LAST_SUCCESS.labels(self.store).set(time.time())
        self.failures = 0
        if self.state == OK:
            return
        if self.state is not None:
            log.info(
                "store answers again",
                extra={"store": self.store, "was": self.state, "problem": self.problem},
            )
        self.problem = ""
        await self._enter(OK)

    async def failed(self, state: str, error: BaseException) -> None:
        """A try failed: `state` says how (unreachable, invalid, ...). Said once per change
        of state, with the error; the next try waits `retry_in()`."""
        self.failures += 1
        problem = str(error) or type(error).__name__
        if state == self.state:
            self.problem = problem
            return
        log.warning(
            "store failing; this process keeps serving and retries",
            extra={
                "store": self.store,
                "state": state,
                "problem": problem[:500],
                "error": type(error).__name__,
            },
        )
        self.problem = problem
        await self._enter(state)

    def retry_in(self) -> float:
        """Seconds before the next try after `failures` failed ones: base_s doubling to
        max_s, times a random 0.5..1."""
        step = min(self.max_s, self.base_s * 2 ** max(0, self.failures - 1))
        return step * random.uniform(0.5, 1.0)

    async def _enter(self, state: str) -> None:
        if self.state is not None:
            STATE.labels(self.store, self.state).set(0)
        STATE.labels(self.store, state).set(1)
        self.state = state
        if self._health is not None:
            serving = health_pb2.HealthCheckResponse.SERVING
            status = serving if state == OK else health_pb2.HealthCheckResponse.NOT_SERVING
            await self._health.set(self.health_name, status)
